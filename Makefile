# Two commands do all the set-up: `make run` (the main job on the bundled model) and `make test` (the suite).
# Each creates the virtual environment in $(VENV) first when it is missing or older than pyproject.toml.
# Managing your own environment instead: pip install torch, then pip install -e ".[dev]" (README "Install").
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup vllm

setup: $(VENV)/.installed

# torch first: a CPU build where there is no GPU (the project's torch range alone would pull a multi-GB CUDA build)
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet "torch>=2.4,<2.14"; \
	else $(PY) -m pip install --quiet --retries 0 --timeout 10 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
	  || $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# ARGS reaches Hydra as typed (treedec.cli.split_args: split at spaces outside quotes, quotes kept), so
# make run ARGS="prompt='def f(x):'" works as python -m treedec.generate "prompt='def f(x):'" does
run: setup
	$(PY) -c "import sys; from treedec.cli import run_module; run_module('treedec.generate', sys.argv[1])" \
	  '$(subst ','\'',$(ARGS))'

# the lint first (pyproject.toml [tool.ruff]); the tests on two workers (pytest-xdist: many tests wait on a
# subprocess, so two overlap on two cores); pytest's "no tests collected" (exit 5) is a failure, never a silent pass
test: setup
	$(VENV)/bin/ruff check --quiet .
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# vLLM in the same .venv: the engine tests (tests/engines) then run instead of skipping. Without a GPU, the vllm extra
# (vLLM's CPU build); with one, PyPI's vllm (its CUDA build).
# PyPI's torchvision, torchaudio and torchcodec, which it pulls, are CUDA builds that stop vLLM's engine beside a CPU
# torch ("operator torchvision::nms does not exist"), and text generation needs none of them: removed on a machine
# without a GPU
vllm: setup
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet -e ".[dev]" vllm; \
	else $(PY) -m pip install --quiet -e ".[dev,vllm]" && \
	  $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"
