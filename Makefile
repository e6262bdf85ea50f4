# Two entry points from a fresh clone: `make demo` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvslim-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements/cpu.txt requirements/fla.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/fla -r requirements/fla.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvslim demo

# One pytest worker per core (pytest-xdist), a test file per worker at a time: the files'
# module fixtures (the interpreted kernels' child processes) then run once. TEST_JOBS=0 runs
# in this process.
TEST_JOBS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/formats.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
