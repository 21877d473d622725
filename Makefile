# Both targets bootstrap the same virtual environment and are safe to re-run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= cpu
STAMP := $(VENV)/.installed

.PHONY: report test lint clean

# torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build (DESIGN.md, set-up facts).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,peers]'
	touch $(STAMP)

report: $(STAMP)
	$(VENV)/bin/workbench report --profile $(PROFILE)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check workbench tests

clean:
	rm -rf reports/*/ reports/index.html
