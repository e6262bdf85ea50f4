# Two entry points from a fresh clone: `make demo` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvslim-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvslim demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/formats.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
