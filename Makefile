# Both targets bootstrap the same virtual environment and are safe to re-run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= cpu
# WORKERS=N runs the notebooks on a local Dask cluster of N processes (default: one after another)
WORKERS ?=
STAMP := $(VENV)/.installed

.PHONY: report test lint clean hooks wheels

# torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,peers]'
	touch $(STAMP)

# nbstripout as a git filter (README, "Notebooks and git"): notebooks saved from JupyterLab keep their
# outputs on disk, git sees them stripped. --keep-id leaves cell ids as committed. Besides outputs and counts
# (and nbstripout's own list: metadata.widgets, cell collapsed, scrolled, execution), it strips what
# JupyterLab writes on save: the kernel's language_info, widget state, hidden-input/output flags
# (cell.metadata.jupyter) and trusted. metadata.kernelspec stays: it names the kernel JupyterLab and the
# report runner start. Outside a git checkout there is nothing to guard.
# git trusts a changed file size without running the filter, so a saved notebook (larger than the stripped
# one checked out) would stay listed by `git status`: workbench.lab_setup installs, for the JupyterLab in
# $(VENV), a save hook that has git read each saved notebook through the filter, so `git status` stays clean
# (and two widget settings: state saved with the notebook, callbacks run on the kernel's main shell).
STRIP_KEYS := metadata.language_info metadata.widgets cell.metadata.jupyter cell.metadata.trusted \
  cell.metadata.execution cell.metadata.collapsed cell.metadata.scrolled
NBSTRIPOUT = "$(abspath $(PY))" -m nbstripout --keep-id --extra-keys "$(strip $(STRIP_KEYS))"

hooks: $(STAMP)
	@if git rev-parse --git-dir >/dev/null 2>&1; then \
	  git config filter.nbstripout.clean '$(NBSTRIPOUT)' && \
	  git config filter.nbstripout.smudge cat && \
	  git config diff.ipynb.textconv '$(NBSTRIPOUT) -t' \
	  || echo "warning: could not configure the nbstripout git filter"; \
	else echo "not a git checkout: the nbstripout filter is not installed"; fi
	@"$(abspath $(PY))" -m workbench.lab_setup install --prefix "$(abspath $(VENV))" >/dev/null
	@# the notebooks' kernel, for the JupyterLab in $(VENV): opened after `make`, they start on it (no "Select Kernel")
	@"$(abspath $(VENV))/bin/workbench" kernel install >/dev/null

report: $(STAMP) hooks
	$(VENV)/bin/workbench report --profile $(PROFILE) $(if $(WORKERS),--workers $(WORKERS))

# One test process per core (pytest-xdist), each at one torch thread (tests/conftest.py).
test: $(STAMP) hooks
	$(PY) -m pytest -q -n auto

# The Jupyter stack a bare CUDA PyTorch image lacks (papermill, nbclient, ipykernel, nbconvert and their
# dependencies, extras included), as Python 3.12 wheels at the versions installed here. `python -m workbench.gpu pack`
# downloads them itself; `pack --wheels-from wheels` reuses these (README, "Profiles").
WHEELS ?= wheels
wheels: $(STAMP)
	$(PY) -m workbench.gpu wheels --dest $(WHEELS)

lint: $(STAMP)
	$(VENV)/bin/ruff check workbench tests

clean:
	rm -rf reports/*/ reports/index.html
