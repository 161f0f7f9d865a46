# Set-up, demo, tests and benchmark of mamba3_mimo.
# `make demo` / `make test` / `make bench` build .venv on first use. On a machine that already
# has torch and triton (the GPU box, no network) skip the venv: `make test PYTHON=python3`.

VENV   ?= .venv
PYTHON ?= $(VENV)/bin/python
PIP    ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

# The venv is only built when PYTHON is the venv's own interpreter.
ifeq ($(PYTHON),$(VENV)/bin/python)
VENV_STAMP := $(VENV)/.installed
endif

.PHONY: venv demo test bench

venv: $(VENV_STAMP)

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -e ".[clients]" pytest pytest-xdist "numpy<2.4" triton==3.6.0
	touch $@

demo: venv
	$(PYTHON) -m mamba3_mimo demo

# Without CUDA the Triton kernels run through the interpreter, one pytest process per core
# (pytest-xdist: the interpreter is not thread-safe, processes are independent); with CUDA in
# one process, so that the GPU tests do not share the device.
test: venv
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "CUDA found: running the kernels compiled"; \
		$(PYTHON) -m pytest -q tests; \
	else \
		echo "no CUDA: running the kernels through the Triton interpreter (TRITON_INTERPRET=1)"; \
		TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -n auto tests; \
	fi

bench: venv
	$(PYTHON) -m mamba3_mimo.bench
