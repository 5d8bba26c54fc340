# Developer commands, used by the README and by .ci/run alike.
# Run them inside a virtual environment (see README, "Development").
.DEFAULT_GOAL := help
PY ?= python
# Extensions built in place before; one built per Python version (_core.cpython-311-….so)
# would shadow the abi3 one (_core.abi3.so) that the build writes now.
STALE_EXTENSIONS = $(wildcard python/bucketlimit/_core.*.so)
# Expands to nothing (and prints nothing) when there are none.
REMOVE_STALE_EXTENSIONS = $(if $(STALE_EXTENSIONS),rm -f $(STALE_EXTENSIONS))
# The Redis/Valkey module (module/), shipped in the package: bucketlimit.redis.module_path().
MODULE_FILE = python/bucketlimit/bucketlimit-redis.so
# The wheel's module links against glibc 2.17 (manylinux2014), as its extension does.
HOST_TARGET = $(shell rustc -vV | sed -n 's/^host: //p')
# bindgen (the module's build script) under cargo zigbuild finds no C headers by
# itself: the host's, and clang's own (stddef.h). Only redismodule.h's types are read.
ZIG_BINDGEN_ARGS = -I$(firstword $(wildcard /usr/lib/llvm-*/lib/clang/*/include)) -I/usr/include -I/usr/include/$(shell uname -m)-linux-gnu

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-13s %s\n", $$1, $$2}'

.PHONY: install
install: ## build the extension (release) and install the package with its dev tools
	$(PY) -m pip install -q --upgrade pip  # --group (PEP 735 dependency groups) needs pip >= 25.1
	$(REMOVE_STALE_EXTENSIONS)
	@echo "make install: building the Rust extension in release mode (half a minute or more the first time, silent while it compiles), then the dev tools"
	$(PY) -m pip install -q -e . --group dev
	$(MAKE) --no-print-directory module

.PHONY: build
build: ## rebuild the extension in place after a Rust change
	$(REMOVE_STALE_EXTENSIONS)
	maturin develop --release --quiet
	$(MAKE) --no-print-directory module

.PHONY: module
module: ## build the Redis/Valkey module into the package (bucketlimit.redis.module_path())
	@$(PY) scripts/ensure_servers.py --libclang
	cargo build --release --quiet -p bucketlimit-redis
	cp target/release/libbucketlimit_redis.so $(MODULE_FILE)

.PHONY: wheel
wheel: ## build dist/: the sdist and one stripped abi3 wheel for CPython 3.10+ on glibc 2.17+, with the Redis module
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --group wheel
	rm -f dist/bucketlimit-*
	@$(PY) scripts/ensure_servers.py --libclang
	BINDGEN_EXTRA_CLANG_ARGS="$(ZIG_BINDGEN_ARGS)" cargo zigbuild --release --quiet -p bucketlimit-redis --target $(HOST_TARGET).2.17
	cp target/$(HOST_TARGET)/release/libbucketlimit_redis.so $(MODULE_FILE)
	maturin build --release --zig --compatibility manylinux2014 --quiet --out dist
	maturin sdist --out dist
	@ls -l dist

.PHONY: format
format: ## fix what the linters can: ruff check --fix, ruff format, cargo fmt
	ruff check --fix .
	ruff format .
	cargo fmt

.PHONY: lint
lint: ## rustfmt, clippy, ruff, mypy --strict (package and tests) and stubtest
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	ruff check .
	ruff format --check .
	mypy --strict python/bucketlimit tests
	$(PY) -m mypy.stubtest bucketlimit._core --allowlist .mypy-stubtest-allowlist

.PHONY: test
test: ## Rust tests, then the Python suite (starts its own redis-server and Prometheus processes)
	$(PY) scripts/ensure_servers.py
	cargo test --quiet
	$(PY) -m pytest

.PHONY: check
check: lint test ## lint and test: what the README's test command and CI run

.PHONY: test-fast
test-fast: ## the inner loop between edits: Rust tests and the Python tests that start no server
	cargo test --quiet
	$(PY) -m pytest -q -m "not redis and not servers"

.PHONY: check-loaded
check-loaded: ## the Python suite 3 times in a row while a CPU-bound process holds one core
	$(PY) scripts/ensure_servers.py
	$(PY) scripts/under_load.py --runs 3 -- $(PY) -m pytest -q

.PHONY: bench
bench: ## side-by-side benchmarks against other limiters; writes docs/benchmarks.md
	$(PY) benches/run.py
	$(PY) -m benches.redis_scale --sections server,client,asyncio,processes --docs docs/benchmarks.md

.PHONY: bench-redis
bench-redis: ## Redis at scale: server time per decision, throughput, the script study (prints)
	$(PY) -m benches.redis_scale
