"""Times bucket.lua's pieces and its candidate variants on the server; checks the
variants answer exactly like the current script. See __init__.py."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from benches import peers
from benches.script_study.pieces import ABLATIONS, BASE, PIECES, Piece, arguments, stored
from benches.server_stats import Summary, client, load, own_form, sample, start_server
from bucketlimit import _core

HERE = Path(__file__).resolve().parent
KEYS = [f"study:{i:04d}" for i in range(1000)]


def rotate(items: Sequence[Any], rep: int) -> list[Any]:
    """Round robin: repetition ``rep`` starts ``rep`` items later."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


# --- pieces -------------------------------------------------------------------------

Subjects = dict[str, tuple[Callable[[], object], int, tuple[str, ...]]]
TOP = ("evalsha", "eval")


def keys_for(prefix: str) -> list[str]:
    return [f"{prefix}:{i:04d}" for i in range(len(KEYS))]


def piece_subjects(c: redis.Redis, per_batch: int) -> Subjects:
    subjects: Subjects = {}
    execute = c.execute_command
    for index, piece in enumerate(PIECES):
        keys = keys_for(f"piece{index}")
        c.delete(*keys)
        if piece.value is not None:
            with c.pipeline(transaction=False) as pipe:
                for i, key in enumerate(keys):
                    value = stored(i, short=piece.value == "short")
                    if piece.hash_value:
                        balance, last = value.split()
                        pipe.hset(key, mapping={"b": balance, "l": last})
                    else:
                        pipe.set(key, value)
                pipe.execute()
        sha = c.script_load(piece.lua)
        counter = [0]

        def run(
            sha: str = sha,
            piece: Piece = piece,
            keys: list[str] = keys,
            counter: list[int] = counter,
        ) -> None:
            numkeys = piece.keys
            for _ in range(per_batch):
                n = counter[0]
                counter[0] += 1
                call = ((keys[n % len(keys)],) if numkeys else ()) + (
                    arguments(n) if piece.args else ()
                )
                execute("EVALSHA", sha, numkeys, *call)

        subjects[piece.name] = (run, per_batch, TOP)
    return subjects


# --- ablations ---------------------------------------------------------------------


def ablated(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        if old == "@all":
            return new
        if old not in source:
            raise RuntimeError(f"ablation: {old!r} is not in the script")
        source = source.replace(old, new)
    return source


def cycling(
    c: redis.Redis, sha: str, keys: list[str], per_batch: int, args: tuple[Any, ...] = ()
) -> Callable[[], object]:
    """One batch: ``per_batch`` EVALSHAs over ``keys`` round robin, continuing where
    the last batch stopped."""
    execute = c.execute_command
    position = [0]

    def run() -> None:
        n = position[0]
        for i in range(n, n + per_batch):
            execute("EVALSHA", sha, 1, keys[i % len(keys)], *args)
        position[0] = n + per_batch

    return run


def ablation_subjects(c: redis.Redis, per_batch: int) -> Subjects:
    """The current script's allowed form with one piece taken out at a time."""
    source = Form("current", (HERE / "current.lua").read_text()).source(*config(peers.ALLOWED))
    real = c.script_load(source)
    subjects: Subjects = {}
    for index, (name, edits) in enumerate(ABLATIONS):
        keys = keys_for(f"ablation{index}")
        c.delete(*keys)
        for key in keys:
            c.execute_command("EVALSHA", real, 1, key)  # a bucket in every key
        sha = c.script_load(ablated(source, edits))
        subjects[name] = (cycling(c, sha, keys, per_batch), per_batch, TOP)
    return subjects


# --- whole scripts --------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """A whole script in the form one limiter sends (its configuration written in)."""

    name: str
    template: str  # bucket.lua or a variant, with the "-- config" line

    def source(self, capacity: int, unit: int, p: int) -> str:
        return own_form(self.template, capacity, unit, p)


CURRENT = "current bucket.lua"


def forms() -> list[Form]:
    found = [Form(CURRENT, (HERE / "current.lua").read_text())]
    for path in sorted((HERE / "variants").glob("*.lua")):
        found.append(Form(path.stem, path.read_text()))
    return found


def config(q: peers.Quota) -> tuple[int, int, int]:
    """(capacity, unit, p) of the script, as the limiter computes them."""
    capacity, per_micro, unit = _core.exact_units(q.capacity, q.rate, per=q.per)
    return capacity, unit, per_micro


WORKLOADS = [("allowed", peers.ALLOWED), ("refused", peers.REFUSED)]
LIMITS = "limits fixed window (its EVALSHA, raw)"
LIMITS_API = "limits fixed window through its API"
LIMITS_NEW_WINDOW = "limits fixed window, 1-s windows (mostly new: INCRBY + EXPIRE)"
LONG_WINDOW = peers.Quota(capacity=10**9, rate=1, per=3600)  # for limits only


def form_subjects(c: redis.Redis, port: int, per_batch: int) -> Subjects:
    """Every form allowed (1,000 keys, 10^9 tokens) and refused (one drained key of
    10 per hour), and limits' fixed window through its own API the same way."""
    subjects: Subjects = {}
    for workload, q in WORKLOADS:
        for form in forms():
            sha = c.script_load(form.source(*config(q)))
            keys = keys_for(f"{form.name}:{workload}")
            if workload == "refused":
                keys = keys[:1]
            c.delete(*keys)
            for key in keys:
                for _ in range(q.capacity + 1 if workload == "refused" else 1):
                    c.execute_command("EVALSHA", sha, 1, key)
            subjects[f"{form.name} | {workload}"] = (
                cycling(c, sha, keys, per_batch),
                per_batch,
                TOP,
            )
        # limits' fixed window: a window of `per` seconds. Its common case is a hit on
        # a live window (one INCRBY); a hit opening a new window adds an EXPIRE. The
        # mostly allowed quota's 1-second windows over 1,000 keys would open a new
        # window on almost every call here, so the reference row holds each key's
        # window open for an hour (10^9 per hour: never refused), and a second row
        # shows the 1-second windows as they come.
        variants = [(LIMITS_API, LONG_WINDOW if workload == "allowed" else q)]
        if workload == "allowed":
            variants.append((LIMITS_NEW_WINDOW, q))
        for label, quota in variants:
            limiter = peers.limits_fixed_redis(quota, port)
            keys = keys_for(f"{label}:{workload}")[: 1 if workload == "refused" else None]
            for key in keys:
                for _ in range(q.capacity + 1 if workload == "refused" else 1):
                    limiter.allow(key)
            position = [0]

            def run(
                allow: Callable[[str], object] = limiter.allow,
                keys: list[str] = keys,
                position: list[int] = position,
            ) -> None:
                n = position[0]
                for i in range(n, n + per_batch):
                    allow(keys[i % len(keys)])
                position[0] = n + per_batch

            subjects[f"{label} | {workload}"] = (run, per_batch, TOP)
        # The reference: limits' own script sent raw, like the variants (a client
        # that sends its next call sooner finds the server warmer: the same script
        # costs the server less when calls come back to back, see FINDINGS.md).
        from limits.storage import RedisStorage

        storage = RedisStorage(f"redis://127.0.0.1:{port}", single_connection_client=True)
        incr = storage.lua_incr_expire
        incr(keys=["LIMITS:warm"], args=[1, 1])  # loaded
        window = LONG_WINDOW.per if workload == "allowed" else q.per
        keys = [f"LIMITS:LIMITER/{k}/{q.capacity}/1/{workload}" for k in keys_for("raw")]
        keys = keys[: 1 if workload == "refused" else None]
        subjects[f"{LIMITS} | {workload}"] = (
            cycling(c, incr.sha, keys, per_batch, (window, 1)),
            per_batch,
            TOP,
        )
    # Bounds, not candidates (they answer nothing): what any script on the
    # server's clock that reads a bucket and writes it back with a TTL pays before
    # any arithmetic, and the call itself.
    for name, lua in BOUNDS.items():
        keys = keys_for(f"bound:{name}")
        sha = c.script_load(lua)
        subjects[f"{name} | allowed"] = (cycling(c, sha, keys, per_batch), per_batch, TOP)
    return subjects


BOUNDS = {
    "bound: TIME + GET + SET PX, a 3-integer reply, no arithmetic": (
        "local t = redis.call('TIME')\nlocal v = redis.call('GET', KEYS[1])\n"
        "redis.call('SET', KEYS[1], '999999999000000 1796124679955000', 'PX', '1000000')\n"
        "return {0, 999999999, 1000000}"
    ),
    "bound: TIME + GET, a 3-integer reply (a refusal's commands)": (
        "local t = redis.call('TIME')\nlocal v = redis.call('GET', KEYS[1])\nreturn {1, 0, 1000000}"
    ),
    "bound: trivial EVALSHA, 1 key (return 1)": "return 1",
}


# --- batches -----------------------------------------------------------------------

BATCH_SIZES = (1, 8, 64)


def batch_subjects(c: redis.Redis, per_batch: int) -> tuple[Subjects, dict[str, int]]:
    """batch.lua deciding 1, 8 and 64 allows per call (distinct keys of the mostly
    allowed quota), next to the current script's one."""
    template = (HERE / "batch.lua").read_text()
    source = own_form(template, *config(peers.ALLOWED))
    sha = c.script_load(source)
    execute = c.execute_command
    subjects: Subjects = {}
    decisions: dict[str, int] = {}
    for size in BATCH_SIZES:
        for with_costs in (False, True):
            if size == 1 and with_costs:
                continue
            keys = keys_for(f"batch{size}{'c' if with_costs else ''}")
            calls = max(1, per_batch // size) if size > 1 else per_batch
            position = [0]
            # (key, cost) pairs: the costs as ARGV, one per key ("1"), or none (all 1).
            costs = ["1"] * size if with_costs else []

            def run(
                size: int = size,
                keys: list[str] = keys,
                calls: int = calls,
                position: list[int] = position,
                costs: list[str] = costs,
            ) -> None:
                n = position[0]
                for _ in range(calls):
                    chunk = [keys[(n + j) % len(keys)] for j in range(size)]
                    execute("EVALSHA", sha, size, *chunk, *costs)
                    n += size
                position[0] = n

            run()  # buckets in every key
            name = f"batch.lua, {size} per call" + (", costs sent" if with_costs else "")
            subjects[name] = (run, calls, TOP)
            decisions[name] = size
    return subjects, decisions


def batch_study(c: redis.Redis, port: int, per_batch: int) -> tuple[Subjects, dict[str, int]]:
    """The batches next to the current script and limits' fixed window (allowed), in one
    sample: per-decision ratios to limits of the same moment."""
    subjects, decisions = batch_subjects(c, per_batch)
    for name, subject in form_subjects(c, port, per_batch).items():
        if name in (f"{CURRENT} | allowed", f"{LIMITS} | allowed"):
            subjects[name] = subject
            decisions[name] = 1
    return subjects, decisions


# --- parity: every variant answers as the current script --------------------------------

PARITY_CONFIGS = [
    (10, 1, 3600000000),  # 10 tokens, 1 per hour
    (5, 3, 1),  # 5 tokens of 3 units, 1 unit per µs
    (7, 1000000, 3),  # a fraction of a token per µs
    (1000000000, 1000000, 1),  # the mostly allowed quota
    (3, 1, 0),  # rate 0: a quota, no TTL
]
MIN_TTL = "local MIN_TTL_MS = 1\n"
MALFORMED = [
    "abc", "1e3 5", " 12 5", "12 5 ", "1.5 3", "-1 5", "12", "12 5 7", "+5 5", "0x10 5",
    "9007199254740992 5", "5 9007199254740992", "5 -9007199254740992", "", "5 -7",
]  # fmt: skip


def parity(c: redis.Redis, ops: int, seed: int = 13) -> dict[str, str]:
    """Each variant and the current script run the same random trace of allows,
    peeks, refunds and costs on an explicit clock (steps, standstills, steps back),
    each on its own keys: every reply and every key's TTL as written (within 50 ms:
    the two run a moment apart; then removed, so that no key expires on the real
    clock during the trace) compared; then both read the same malformed values
    (the replies, errors included, compared), and each allows once on the server's
    clock."""
    rng = random.Random(seed)
    current, *variants = forms()
    verdicts = {}
    for variant in variants:
        problems: list[str] = []
        compared = 0
        for capacity, unit, p in PARITY_CONFIGS:
            # As the parity tests do: a TTL of at least a minute, so that no key
            # expires on the real clock while the trace runs on its own.
            sources = [f.source(capacity, unit, p) for f in (current, variant)]
            if not all(MIN_TTL in x for x in sources):
                raise RuntimeError(f"{variant.name}: no {MIN_TTL!r} line to raise")
            shas = [
                c.script_load(x.replace(MIN_TTL, "local MIN_TTL_MS = 60000\n")) for x in sources
            ]
            now = 1_796_124_679_955_000
            keys = [f"parity:{variant.name}:{capacity}:{unit}:{p}:{i}" for i in range(3)]
            c.delete(*(prefix + k for prefix in ("cur:", "var:") for k in keys))
            for step in range(ops // len(PARITY_CONFIGS)):
                now += rng.choice([0, 0, 1, 7, 1000, 999_999, 10**7, 3600 * 10**6, -5])
                key = rng.choice(keys)
                mode = rng.choice(["a", "a", "a", "a", "p", "r"])
                args: list[Any] = [rng.randint(1, capacity), mode, now]
                replies = []
                for sha, prefix in zip(shas, ("cur:", "var:"), strict=True):
                    try:
                        replies.append(c.execute_command("EVALSHA", sha, 1, prefix + key, *args))
                    except redis.ResponseError as e:
                        replies.append(f"error {e}")
                # The TTLs just written, then none: the trace runs on its own clock,
                # and a key must not expire on the real one between two steps.
                ttls = [c.pttl("cur:" + key), c.pttl("var:" + key)]
                c.persist("cur:" + key)
                c.persist("var:" + key)
                compared += 1
                if replies[0] != replies[1]:
                    problems.append(f"{capacity},{unit},{p} step {step} {args}: {replies}")
                elif abs(ttls[0] - ttls[1]) > 50 or (ttls[0] < 0) != (ttls[1] < 0):
                    problems.append(f"{capacity},{unit},{p} step {step} {args}: pttl {ttls}")
        shas = [c.script_load(f.source(*PARITY_CONFIGS[0])) for f in (current, variant)]
        for value in MALFORMED:
            replies = []
            for sha in shas:
                c.set("malformed", value)
                try:
                    replies.append(c.execute_command("EVALSHA", sha, 1, "malformed", 1, "a", 5))
                except redis.ResponseError as e:
                    replies.append(f"error {e}")
            compared += 1
            if replies[0] != replies[1]:
                problems.append(f"value {value!r}: {replies}")
        # The general form (the template as written, allow_all's): one and two keys
        # of different configurations, the configuration in ARGV.
        templates = [
            c.script_load(f.template.replace(MIN_TTL, "local MIN_TTL_MS = 60000\n"))
            for f in (current, variant)
        ]
        now = 1_796_124_679_955_000
        for step in range(ops // 10):
            now += rng.choice([0, 1, 1000, 999_999, 10**7, -5])
            configs = rng.sample(PARITY_CONFIGS, rng.choice([1, 2]))
            cost = rng.randint(1, min(cfg[0] for cfg in configs))
            mode = rng.choice(["a", "a", "p", "r"] if len(configs) == 1 else ["a", "a", "p"])
            general: list[Any] = [cost, mode]
            for capacity, unit, p in configs:
                general += [now, capacity, unit, p]
            names = [f"general:{variant.name}:{cfg}" for cfg in configs]
            replies = []
            for sha, prefix in zip(templates, ("cur:", "var:"), strict=True):
                keys = [prefix + n for n in names]
                replies.append(c.execute_command("EVALSHA", sha, len(keys), *keys, *general))
                for key in keys:
                    c.persist(key)
            compared += 1
            if replies[0] != replies[1]:
                problems.append(f"general form step {step} {general}: {replies}")
        # The server's clock (no argument): both allowed with the same remaining.
        shas = [c.script_load(f.source(*config(peers.ALLOWED))) for f in (current, variant)]
        clocked = [f"srv:{variant.name}:{i}" for i in range(2)]
        c.delete(*clocked)
        replies = [
            c.execute_command("EVALSHA", sha, 1, k) for sha, k in zip(shas, clocked, strict=True)
        ]
        compared += 1
        if [r[:2] for r in replies] != [[0, 999_999_999]] * 2:
            problems.append(f"server clock: {replies}")
        verdicts[variant.name] = (
            f"identical on {compared} calls" if not problems else "; ".join(problems[:3])
        )
    return verdicts


# --- the study ------------------------------------------------------------------------


def row(name: str, r: Summary, base: float | None = None, per: int = 1) -> str:
    extra = f"  ({r.us / per - base:+6.2f})" if base is not None else ""
    inner = ", ".join(f"{k} {v / per:g}" for k, v in sorted(r.inner_per_call.items()))
    return (
        f"  {name:58} {r.us / per:6.2f} us [q25 {r.q25_us / per:5.2f}]{extra}"
        f"  cpu {r.cpu_us / per:6.2f}  {inner}"
    )


def as_dict(r: Summary, per: int = 1) -> dict[str, Any]:
    return {
        "us": r.us / per,
        "q25_us": r.q25_us / per,
        "min_us": r.min_us / per,
        "cpu_us": r.cpu_us / per,
        "inner_per_call": {k: v / per for k, v in r.inner_per_call.items()},
    }


def run_all(port: int, per_batch: int, batches: int, parity_ops: int) -> dict[str, Any]:
    c = client(port)
    out: dict[str, Any] = {}

    print(f"\n== study 1: the script's pieces alone (load {load()})", flush=True)
    pieces = sample(c, piece_subjects(c, per_batch), batches)
    base = pieces[BASE].us
    for name, r in pieces.items():
        print(row(name, r, base))
    out["pieces"] = {name: as_dict(r) for name, r in pieces.items()}

    print(f"\n== study 2: the current script with one piece taken out (load {load()})")
    ablations = sample(c, ablation_subjects(c, per_batch), batches)
    whole = ablations[ABLATIONS[0][0]].us
    for name, r in ablations.items():
        print(row(name, r) + f"   saves {whole - r.us:5.2f}")
    out["ablations"] = {name: as_dict(r) for name, r in ablations.items()}

    print(f"\n== study 3: whole scripts next to limits' fixed window (load {load()})")
    # The key comparison: three times the batches of the other studies.
    whole_forms = sample(c, form_subjects(c, port, per_batch), 3 * batches)
    for workload, _ in WORKLOADS:
        limits = whole_forms[f"{LIMITS} | {workload}"].us
        for name, r in whole_forms.items():
            if name.endswith(workload) and not name.startswith("bound"):
                print(row(name, r) + f"   {r.us / limits:4.2f}x limits")
    limits = whole_forms[f"{LIMITS} | allowed"].us
    for name, r in whole_forms.items():
        if name.startswith("bound"):
            print(row(name, r) + f"   {r.us / limits:4.2f}x limits (allowed)")
    out["forms"] = {name: as_dict(r) for name, r in whole_forms.items()}

    print(f"\n== study 4: one call deciding several allows (load {load()})")
    subjects, decisions = batch_study(c, port, per_batch)
    batched = sample(c, subjects, 2 * batches)
    limits = batched[f"{LIMITS} | allowed"].us
    for name, r in batched.items():
        ratio = r.us / decisions[name] / limits
        print(row(name, r, per=decisions[name]) + f"   per decision, {ratio:4.2f}x limits")
    out["batches"] = {name: as_dict(r, decisions[name]) for name, r in batched.items()}

    print(f"\n== study 5: parity with the current script (load {load()})")
    out["parity"] = parity(c, parity_ops)
    for name, verdict in out["parity"].items():
        print(f"  {name:30} {verdict}")
    out["load_after"] = load()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    per_batch, batches, ops = (100, 4, 500) if args.quick else (200, 15, 5000)
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bucketlimit-study-") as d:
        server = start_server(Path(d))
        try:
            print(f"load {load()}")
            results = run_all(server.port, per_batch, batches, ops)
        finally:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
