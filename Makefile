# Set-up is part of every target: `make test` works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel lies on disk here; on GPU machines set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
# Not exported: each rank sets DeepSpeed's accelerator from its stage's device (pipeline/distributed.py);
# a DS_ACCELERATOR in the environment that names the other device is refused at the stage's start.
DS_BUILD_ACCELERATOR ?= cpu
export DS_BUILD_OPS ?= 0
export RAY_AUTH_MODE ?= token
export PYTHONUNBUFFERED := 1

.PHONY: setup demo demo-small test test-fast lint bench wheelhouse clean

setup: $(VENV)/.installed

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q --no-compile "$(TORCH_SPEC)"
	touch $@

# deepspeed ships only as source; its isolated build would download torch. No op is compiled
# (DS_BUILD_OPS=0), so the accelerator the build records serves nothing at run time.
$(VENV)/.deepspeed: $(VENV)/.torch
	DS_ACCELERATOR=$(DS_BUILD_ACCELERATOR) $(PIP) install -q --no-compile --no-build-isolation "$(DEEPSPEED_SPEC)"
	touch $@

# pip byte-compiles each package on one core as it installs it (about 50 s for this venv); compiling the
# whole venv once at the end uses every core. Files that do not compile (Python 2 leftovers in some
# packages) are skipped, as pip skips them.
$(VENV)/.installed: $(VENV)/.deepspeed pyproject.toml
	$(PIP) install -q --no-compile -e ".[dev]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

# The whole pipeline on embedded defaults: shards, a local Ray cluster, the demo experiment, the compare table.
demo: setup
	$(PY) -m cluster.demo

demo-small: setup
	$(PY) -m cluster.demo --size small

# Five xdist workers on two cores: most of the suite waits on Ray and torchrun start-up (see tests/scheduling.py).
TEST_WORKERS ?= 5
test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --durations=25

# Every module's unit tests, without Ray clusters, torchrun launches or the slow ones (the bench dry run,
# ZeRO-3 sweeps, compiling): two xdist workers, one per core (the tests are single-process, so a third only
# contends). Under 4 minutes.
test-fast: setup
	$(PY) -m pytest tests -n 2 --dist loadgroup -m "unit and not slow and not dist and not ray"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) bench/step_overhead.py --out bench/results/step_overhead.json
	$(PY) bench/zero_memory.py --out bench/results/zero_memory.json
	$(PY) bench/ema.py --out bench/results/ema.json
	$(PY) bench/tracking.py --out bench/results/tracking.json
	$(PY) bench/scale.py --out bench/results/scale.json
	$(PY) bench/loader.py --out bench/results/loader.json
	$(PY) bench/shard.py --out bench/results/shard.json
	$(PY) bench/shard.py --sections planning --out bench/results/shard_planning.json
	$(PY) bench/shard.py --sections fanout --out bench/results/shard_fanout.json
	$(PY) bench/index.py --out bench/results/index.json
	$(PY) bench/s3_read.py --out bench/results/s3_read.json
	$(PY) bench/multinode.py --out bench/results/multinode.json
	$(PY) bench/gpu.py --cpu-compile --out bench/results/compile-cpu.json
	$(PY) bench/demo.py --out bench/results/demo.json

# For a GPU node without network (docs/gpu.md): the wheels the project needs beside the node's own CUDA torch,
# for this machine's Python minor and platform. tools/wheelhouse.py --help builds for another target.
WHEELHOUSE ?= wheelhouse
wheelhouse: setup
	$(PY) tools/wheelhouse.py --out $(WHEELHOUSE) --deepspeed "$(DEEPSPEED_SPEC)"

clean:
	rm -rf $(VENV) runs build *.egg-info wheelhouse
