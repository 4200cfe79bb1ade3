# verlite — `make test` and `make run` do their own set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test lint fmt clean

setup: $(STAMP)

# torch first and pinned (docs/design.md, "Running here"): an unpinned torch follows verlite's range
# to the newest release, a multi-GB CUDA build here; 2.13.0 is the CPU build among this machine's wheels.
# The checkout's folder on the path as well (verlite-checkout.pth): the editable install's finder
# is asked only after every folder on the path, so Python started in the folder that holds the
# checkout (a notebook in ~ beside ~/verlite) took the checkout for an empty namespace package
# named verlite (tests/test_layout.py).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'verlite-checkout.pth').write_text(str(pathlib.Path.cwd()) + '\n')"
	touch $(STAMP)

# The main job: PPO with a critic on the tiny model and synthetic task, embedded local Ray.
# Each `make run` starts afresh: an earlier outputs/ppo_tiny is moved aside, not deleted.
run: setup
	$(VENV)/bin/verlite train --config configs/ppo_tiny.yaml trainer.overwrite=true trainer.resume=disable $(ARGS)

# Two test processes side by side (pytest-xdist), each taking whole files (a module's shared
# fixtures stay one): a whole run's workers start one after another on one core, and the
# suite alone left about a third of a 2-core machine idle (14 min 20 s one process, 9 min 5 s
# two, measured on it). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Ruff skips folders named dist/, build/ and the like by default; tests/test_layout.py checks
# that it lints every tracked Python file. Mypy checks the whole verlite package (strict,
# pyproject.toml).
lint: setup
	@echo "ruff lints $$($(VENV)/bin/ruff check --show-files . | grep -c '\.py$$') Python files"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy verlite

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# Tests that start a Ray of their own and break it, minutes of work: tests/jobs start a two-node
# cluster with token authentication (`ray start`), submit, follow, stop and read real jobs; kill
# a node, a driver; stop it again. tests/e2e/test_e2e_failures.py runs `verlite train` with its
# own embedded Ray and kills a worker, the node or the driver (SIGTERM). Also the slowest whole
# runs: every gpu-check part on CPU shapes, the whole-run invariance cases (the negative control
# stays in make test), the PPO case of the resume test and the resumes with changed settings or
# warm-up checkpoints, a tied-head split run under bf16-mixed, and the console's lines of whole
# runs: every test marked cluster, wherever it is. Two test processes, whole files each, as make
# test: the suite mostly waits (on Ray starting, on timeouts it tests), about 0.4 of one core
# busy alone; 25 min 0 s one process, 13 min 54 s two, alone on this 2-core machine. Each test
# starts its own cluster or Ray on free ports and stops only its own.
.PHONY: test-cluster
test-cluster: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m cluster tests

# Every benchmark in benchmarks/, each in a fresh process; figures in benchmarks/results.json.
.PHONY: bench
bench: setup
	$(PY) -m benchmarks.run_all

# CUDA, NCCL and bfloat16 (issue 35): check-invariance over every visible GPU, the main job on
# cuda, the 0.5B update and the 7B-shaped GRPO steps, as one table (held to 570 s, --budget-s); without
# a GPU it says so and exits 0. CI does not run it.
.PHONY: gpu-check
gpu-check: setup
	$(PY) -m benchmarks.gpu_check

# The decode engine's measures (issue 36), a device command of its own (8 minutes of limits):
# benchmarks/rollout.py --device cuda (cuda_graphs vs eager vs HF generate, the roofline's share,
# a profile of what bounds a decode step) and two 0.5B-shaped GRPO steps through verlite train
# with rollout.decode=eager and cuda_graphs (configs/grpo_0p5b_shape.yaml); in outputs/gpu_bench.
.PHONY: gpu-bench
gpu-bench: setup
	$(PY) -m benchmarks.gpu_check --parts rollout,grpo_step --output-dir outputs/gpu_bench

# docs/config.md from the config models' descriptions (a test fails when it is stale).
.PHONY: docs
docs: setup
	$(PY) -m verlite.config.reference > docs/config.md
