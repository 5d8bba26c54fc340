"""The kernel of the Redis layer: what every operation is made of, knowing Redis
and no feature (docs/design.md §6).

A flow is a generator over a limiter's state: it yields each command it needs (a
:class:`Command`: a client method and its arguments), is sent the reply or has
the client's error thrown in at that ``yield``, and returns the operation's
answer (the shape of httpx's ``auth_flow``). A flow may also yield a
:class:`Wait` (a pause, through its handle) or a :class:`Local` (an answer from
in process). The drivers (``drivers``) are the only loops: blocking calls,
``await``, or many allows in one round trip (``batching``).

One sub-flow, :func:`ask`, sends every command and says what a failure means
(EVALSHA, EVAL once after ``NOSCRIPT``, once more after a redirection storm, the
error classified once); :func:`guarded` is :func:`ask` inside the breaker's
bracket. The operations live in the feature modules (``buckets``, ``leases``,
``permit_flows``, ``combined``) and only say what their answer is with the store
and without it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Final, NoReturn, Protocol, TypeVar

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis.errors import (
    CONFIG,
    CORRUPT,
    EXHAUSTED,
    FAULT,
    REDIRECTED,
    ClusterError,
    NoPermissionError,
    NoScriptError,
    ResponseError,
    StoreUnavailableError,
    check_version,
    classify,
    configuration_error,
    leased_bucket,
    read_only,
    store_error,
)
from bucketlimit._redis.resilience import (
    PROCESS_TTL,
    RAISE,
    SKIP,
    STORE,
    Breaker,
    Gate,
)
from bucketlimit._redis.script import (
    HEARTBEAT,
    LUA_EXACT,
    Script,
    lease_hash,
)
from bucketlimit._redis.state import LimiterState, Store

logger = logging.getLogger("bucketlimit")

T = TypeVar("T")


class Command:
    """A client call a flow waits on: ``getattr(client, name)(*argv)``; ``keys`` are
    the Redis keys it names (for the errors that say which)."""

    __slots__ = ("argv", "keys", "name")

    #: ``(cost, now)`` of a one-key allow that may share a round trip (batching).
    joins: tuple[int, Any] | None = None
    #: Sent whole (EVAL) rather than by EVALSHA.
    whole = False
    #: On a cluster, sent to its key's node only: a MOVED, ASK or TRYAGAIN comes
    #: back as the error, the client's own redirections not followed (a batch).
    direct = False

    def __init__(self, name: str, argv: tuple[Any, ...], keys: Sequence[bytes] = ()) -> None:
        self.name = name
        self.argv = argv
        self.keys = keys


class ScriptCommand(Command):
    """A script: by EVALSHA, or sent whole (EVAL) once the server said NOSCRIPT.
    ``joins`` is ``(cost, now)`` for a one-key allow of a limiter's own script, which
    a shared round trip may carry with others (``batching``)."""

    __slots__ = ("args", "joins", "script", "whole")

    def __init__(
        self,
        script: Script,
        keys: Sequence[bytes],
        args: Sequence[Any],
        *,
        joins: tuple[int, Any] | None = None,
        whole: bool = False,
    ) -> None:
        # Written out, not super().__init__: every allow makes one.
        self.name = "execute_command"
        self.keys = keys
        if whole:
            self.argv = ("EVAL", script.source, len(keys), *keys, *args)
        else:
            self.argv = ("EVALSHA", script.sha, len(keys), *keys, *args)
        self.script = script
        self.args = args
        self.joins = joins
        self.whole = whole

    def sent_whole(self) -> ScriptCommand:
        return type(self)(self.script, self.keys, self.args, joins=self.joins, whole=True)


class BatchCommand(ScriptCommand):
    """A shared round trip's script (``batching``): sent to its slot's node only, so
    that a slot being migrated answers it at once, and it is split."""

    __slots__ = ()
    direct = True


class Handle(Protocol):
    """What a :class:`Wait` waits on (a permit's waiter, ``wakeups.Waiting``): it
    answers what woke it, or ``None`` when the time ran out."""

    def wait(self, seconds: float) -> Any: ...
    async def wait_async(self, seconds: float) -> Any: ...


class Wait:
    """A pause of a flow: up to ``seconds``, or until ``handle`` is woken. The
    drivers send back what ``handle.wait`` (or ``wait_async``) answers."""

    __slots__ = ("handle", "seconds")

    def __init__(self, seconds: float, handle: Handle) -> None:
        self.seconds = seconds
        self.handle = handle


class Local:
    """An answer from in process instead of the store (a policy's that waits):
    ``call`` blocking, or ``call_async`` awaited; the drivers send back its answer."""

    __slots__ = ("call", "call_async")

    def __init__(self, call: Callable[[], Any], call_async: Callable[[], Any]) -> None:
        self.call = call
        self.call_async = call_async


#: What a flow yields: a command to send, a pause, or an answer from in process.
Step = Command | Wait | Local

#: What an operation yields and is sent: a command, then its reply (or a pause, or an
#: answer from in process, then what it brought).
Flow = Generator[Step, Any, T]


class Unanswered(Exception):
    """The store did not answer (``error``; ``None`` when the breaker skipped it): the
    failure policy answers. ``sent``: the commands sent meanwhile. ``outage``: the
    breaker knows (it opened on this fault, or it skips the store), and said so in
    the logs."""

    def __init__(self, error: BaseException | None, sent: int, *, outage: bool = True) -> None:
        super().__init__(error)
        self.error = error
        self.sent = sent
        self.outage = outage


class Corrupt(Exception):
    """A bucket's key holds something that is not a bucket (``error``, a
    ``CorruptBucketError``): never an allow. ``sent``: the commands sent."""

    def __init__(self, error: BaseException, sent: int) -> None:
        super().__init__(error)
        self.error = error
        self.sent = sent


class Skipped(Exception):
    """Thrown into a flow waiting for a shared round trip when its breaker opened
    meanwhile: nothing is sent for it (``batching``)."""


class Lost(Exception):
    """Thrown into the flows of a shared round trip whose reply another caller's
    interruption lost (a KeyboardInterrupt in the thread that sent it): the store
    may have run it; the policy answers, and the breaker stays as it was."""


def resent(
    state: Store, command: Command, error: BaseException, redirected: bool
) -> Command | None:
    """The command to send again after ``error``, or ``None``: the one rule of
    resending (docs/design.md §6). A script goes by EVALSHA; after ``NOSCRIPT``
    (the server lost its scripts: restart, failover, ``SCRIPT FLUSH``) it goes
    whole once, which is safe because it did not run; after a redirection storm
    (every node answered MOVED, ASK or TRYAGAIN: no attempt ran) the same command
    goes once more (``redirected``: it went once more already); a call on a bucket
    without its lease hash, which the script answers it does not read when the
    bucket has leases out, goes once more with it (scripts.md). Nothing else is
    resent: a command that timed out may have run, and again could charge twice."""
    if isinstance(error, NoScriptError) and isinstance(command, ScriptCommand):
        if not command.whole:
            state.counters.event("script_loads")
            return command.sent_whole()
        return None
    if isinstance(command, ScriptCommand) and len(command.keys) == 1 and leased_bucket(error):
        keys = (command.keys[0], lease_hash(command.keys[0]))
        return ScriptCommand(command.script, keys, command.args, whole=command.whole)
    if not redirected and isinstance(error, ClusterError) and classify(error) == REDIRECTED:
        return command
    return None


def ask(
    state: Store,
    breaker: Breaker,
    gate: Gate,
    command: Command,
    *,
    failed: BaseException | None = None,
) -> Flow[tuple[Any, int]]:
    """The store's reply to ``command``, and the commands sent for it (resent by
    :func:`resent`'s rule).

    A failure is classified once: the store down, slow or busy raises
    :class:`Unanswered` (a fault opens the breaker); a corrupt bucket raises
    :class:`Corrupt` (the store answered); what no retry will fix raises
    ``ConfigurationError`` whatever the policy; what is not the store's doing (a
    bug, a cancellation) goes on as it is. ``failed``: the first send already
    happened and raised this (the common allow of ``bucketlimit.redis``). After
    an answer, the process's heartbeat goes when one is due (docs/design.md §6,
    "How many processes").
    """
    sent = 0
    redirected = timed = False
    while True:
        sent += 1
        try:
            if failed is not None:
                error, failed = failed, None
                raise error
            reply = yield command
        except GeneratorExit:  # dropped before it was sent (batching)
            breaker.release(gate)
            raise
        except Skipped:  # its breaker opened while it waited for a shared round trip
            breaker.release(gate)
            raise Unanswered(None, sent - 1) from None
        except BaseException as raised:  # the call decides what a failure means
            if not timed and isinstance(command, ScriptCommand) and state.time.refused(raised):
                # TIME refused to scripts, read first: nothing ran. The same call
                # goes once more, with the time the drivers now send.
                timed = True
                if not state.time.supplied:
                    sent += yield from switched_time(state, raised)
                continue
            again = resent(state, command, raised, redirected)
            if again is None:
                raise failure(state, breaker, gate, raised, command, sent) from None
            redirected = redirected or again is command
            command = again
        else:
            break
    if state.processes.due():
        sent += yield from heartbeat(state)
    return reply, sent


def guarded(
    state: Store, breaker: Breaker, command: Command, *, wrote: bool | Callable[[Any], bool]
) -> Flow[tuple[Any, int]]:
    """:func:`ask` inside the breaker's bracket, the one way a call goes to the
    store: skipped while the breaker skips the store (:class:`Unanswered`, nothing
    sent); an answer to a probe closes it (``wrote``: whether the answer is a write,
    or how to tell from the reply, as :func:`spent`; after ``READONLY`` only a write
    closes it). The reply and the commands sent."""
    gate = breaker.admit()
    if gate is SKIP:
        raise Unanswered(None, 0)
    reply, sent = yield from ask(state, breaker, gate, command)
    if gate is not STORE or breaker.open:
        breaker.succeeded(gate, wrote=wrote(reply) if callable(wrote) else wrote)
    return reply, sent


def spent(reply: Any) -> bool:
    """Whether a decision's reply (``{retry_after_us, ...}``) spent: an allow."""
    return bool(reply[0] == 0)


def switched_time(state: Store, why: BaseException) -> Flow[int]:
    """The store refused TIME to a script (``why``): ``TIME`` is asked as a command,
    and the limiter's calls send the store's time from now on, or this host's when
    the store refuses that too (``timing.StoreTime.switch``). Answers the commands
    sent."""
    before = time.monotonic_ns()
    try:
        reply = yield Command("time", ())
    except Exception as error:
        if classify(error) != CONFIG:
            raise
        reply = None
    state.time.switch(state.name, why, reply, before, time.monotonic_ns())
    return 1


def failure(
    state: Store,
    breaker: Breaker,
    gate: Gate,
    raised: BaseException,
    command: Command,
    sent: int,
) -> Unanswered | Corrupt:
    """What ``raised`` (the client's error, being handled) means: the exception
    :func:`ask` raises for the operation to answer by its policy, or raised here
    (``ConfigurationError``; what is not the store's doing, as it came)."""
    error = raised
    if isinstance(error, ResponseError):
        error = store_error(error, list(command.keys))
        if error is not raised:
            error.__cause__ = raised
    kind = classify(error)
    if kind == FAULT:
        state.counters.event("store_errors")
        breaker.failed(gate, error, read_only=read_only(error))
        return Unanswered(error, sent)
    if kind in (EXHAUSTED, REDIRECTED) or isinstance(error, Lost):
        # This process has no free connection, lost its way among redirections, or
        # lost a shared reply: the store is not down; the breaker stays as it was.
        breaker.release(gate)
        return Unanswered(error, sent, outage=False)
    if kind == CORRUPT:
        # The store answered, so it works: no breaker; and never an allow.
        state.counters.event("store_errors")
        breaker.succeeded(gate, wrote=False)
        return Corrupt(error, sent)
    breaker.release(gate)
    state.counters.add(sent)  # what it sent still counts
    if kind == CONFIG:
        raise configuration_error(error) from error
    raise raised


def heartbeat(state: Store) -> Flow[int]:
    """This process says it is alive and learns how many are (once an interval,
    after a call the store answered); a failure only loses this count. Answers
    the commands it sent."""
    key = state.keys.processes()
    if state.cluster and state.breakers.of(state.client, key).open:
        return 0  # its node is being skipped: no timeout for a count
    command = ScriptCommand(HEARTBEAT, [key], (state.processes.member, round(PROCESS_TTL * 1000)))
    for sent in (1, 2):
        try:
            count = yield command
        except NoScriptError:
            command = command.sent_whole()
        except Exception as error:
            if classify(error) == CONFIG and not state.processes.refused:
                # An ACL without the heartbeat's commands: said once, as no retry helps.
                state.processes.refused = True
                logger.warning(
                    "%s: the store refused the heartbeat that counts the processes "
                    "sharing the limit (%s): without the store, on_store_error='local' "
                    "refuses, as no share can be told; pass processes=N, or let the user "
                    "run the heartbeat script (Lua, with ZADD, ZREMRANGEBYSCORE, ZCARD "
                    "and PEXPIRE on the prefix's keys) (%s)",
                    state.name,
                    error,
                    "docs/redis.md, 'How many processes'",
                )
            else:
                logger.debug("%s: the heartbeat failed: %r", state.name, error)
            return sent
        else:
            state.learned(int(count))
            return sent
    return 2


def answered(breaker: Breaker, gate: Gate, *, wrote: bool) -> None:
    """The store answered: a probe closes the breaker (after ``READONLY`` only a
    write does). Nothing to do in the common case, the breaker closed."""
    if gate is not STORE or breaker.open:
        breaker.succeeded(gate, wrote=wrote)


def reraise(error: BaseException) -> NoReturn:
    """Raises the client's ``error`` as it came: with its own context, not the
    package's internal exception being handled where this is called."""
    context, suppress = error.__context__, error.__suppress_context__
    try:
        raise error
    finally:
        error.__context__, error.__suppress_context__ = context, suppress


def refuse(failure: Unanswered | Corrupt, breaker: Breaker) -> NoReturn:
    """``on_store_error="raise"``: the client's error goes on, and while the breaker
    skips the store (no error), :class:`StoreUnavailableError`."""
    if failure.error is None:
        raise StoreUnavailableError(breaker.describe()) from None
    reraise(failure.error)


def unanswered(
    state: Store, failure: Unanswered, breaker: Breaker, *, raises: bool | None = None
) -> None:
    """Under ``on_store_error="raise"`` (``raises``: for a call over several limiters,
    whether one of them raises) the call counts what it sent and the client's error
    goes on (:func:`refuse`); otherwise the answer to come is a degraded one."""
    if state.policy == RAISE if raises is None else raises:
        state.counters.add(failure.sent)
        refuse(failure, breaker)
    state.degraded(failure.error, logged=failure.outage)


def corrupt(
    state: LimiterState, failure: Corrupt, breaker: Breaker, *, raises: bool | None = None
) -> Decision:
    """A corrupt bucket's answer: raised under ``"raise"`` (as :func:`unanswered`),
    else refused, degraded."""
    if state.policy == RAISE if raises is None else raises:
        state.counters.add(failure.sent)
        refuse(failure, breaker)
    state.degraded(failure.error, logged=False, refused=True)
    return state.fallback.refusal()


def not_given_back(
    state: Store, failure: Unanswered | Corrupt, breaker: Breaker, *, raises: bool
) -> None:
    """A give-back or a reset that did not reach the store: counted; raised under
    ``"raise"``. Nothing is answered without the store (no decision, not degraded)."""
    state.counters.add(failure.sent)
    if raises:
        refuse(failure, breaker)


# -- how the drivers drive a flow ---------------------------------------------------


#: How a flow ended: its answer, or the error it raises.
Outcome = tuple[Any, BaseException | None]
NO_OUTCOME: Final[Outcome] = (None, None)


class Flowing:
    """A flow as the drivers and the shared round trips drive it, without an
    exception per step: ``command`` is what it waits on, ``None`` once it has its
    ``outcome``; ``feed`` hands it the reply, or the client's error (``thrown``)."""

    __slots__ = ("_flow", "command", "outcome")

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow: Flow[Any] | None = flow
        self.outcome = NO_OUTCOME
        self.command: Any = None  # the step it waits on: a Command (or a Wait, a Local)
        self.feed(None, thrown=False)  # runs it to its first command

    def feed(self, value: Any, *, thrown: bool) -> None:
        flow = self._flow
        assert flow is not None
        try:
            command = flow.throw(value) if thrown else flow.send(value)
        except StopIteration as done:
            self.command, self.outcome = None, (done.value, None)
        except BaseException as error:  # the flow raised: its outcome
            self.command, self.outcome = None, (None, error)
        else:
            self.command = command

    def close(self) -> None:
        """Given up before its command was sent: the flow is closed, nothing sent."""
        if self._flow is not None:
            self._flow.close()


def check_wait(value: object, name: str) -> int | None:
    """A ``max_wait`` / ``timeout`` in whole µs by the clock's rounding, as the core
    reads it: ``None`` (or ``inf``, or beyond the clock's range) for no limit, else
    seconds >= 0 as an int or float."""
    if value is None:
        return None
    if isinstance(value, float):
        if math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
        if math.isinf(value):
            return None
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, float or None, got bool")
    else:
        try:
            whole = value.__index__()  # type: ignore[attr-defined]
        except AttributeError:
            raise TypeError(
                f"{name} must be an int, float or None, got {type(value).__name__}"
            ) from None
        if whole < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
        value = whole
    try:
        micros = _core.clock_to_micros(value)
    except (ValueError, OverflowError):
        return None  # beyond the clock's range: as good as no limit
    return micros if micros < LUA_EXACT else None


def check_store(state: Store, probe: ScriptCommand, *more: Command) -> Flow[None]:
    """What every limiter's ``check()`` does: ``probe`` (its script on a key nothing
    holds, writing nothing), then ``INFO server``, refusing a server older than 5.0
    (an ACL forbidding INFO is ignored: the script ran, which is what counts), then
    ``more`` (what else the limiter will need: a concurrency limiter's PUBLISH);
    then the process's first heartbeat, so that a limiter checked at start-up has
    its processes counted from then on."""
    commands = [probe, Command("info", ("server",)), *more]
    sent = 0
    timed = False
    try:
        while commands:
            command = commands.pop(0)
            sent += 1
            try:
                reply = yield command
            except NoScriptError:
                if not isinstance(command, ScriptCommand) or command.whole:
                    raise
                state.counters.event("script_loads")
                commands.insert(0, command.sent_whole())
            except NoPermissionError:
                if command.name != "info":
                    raise
            except ResponseError as error:
                if timed or not isinstance(command, ScriptCommand) or not state.time.refused(error):
                    raise
                timed = True
                if not state.time.supplied:
                    sent += yield from switched_time(state, error)
                commands.insert(0, command)  # again, with the time sent
            else:
                if command.name == "info":
                    check_version(reply)
        if state.processes.due():
            sent += yield from heartbeat(state)
    except BaseException as error:
        if classify(error) == CONFIG:
            raise configuration_error(error) from error
        raise
    finally:
        state.counters.add(sent)
