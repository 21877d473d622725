"""What a notebook calls last: `save_results` writes its results, then a JupyterLab run is listed on the index.

The one-way flow of `report/` (DESIGN.md): `results.write_results` writes `results.json` and the figures and
renders nothing; the index pages are then built from what is on disk (`index.write_index`). A notebook run by
the report runner (`output_dir` given) writes only its results: the runner rewrites the index once the build
is in place. A notebook run in JupyterLab (`output_dir=""`) has no runner after it, so this module rewrites
the index itself, under the reports folder's lock, once the results are written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from .folders import locked
from .index import write_index
from .ledger import Ledger
from .results import UsageError, write_results

__all__ = ["save_results"]


def save_results(
    name: str, *, output_dir: str | Path, parameters: dict, records: dict[str, pd.DataFrame],
    ledger: Ledger, figures: dict | None = None, device=None,
) -> Path:
    """Write `results.json` (parameters, environment, records, claims) and figures as PNG.

    `output_dir` "" (a notebook run in JupyterLab) means `reports/interactive/<name>` in the repository
    the notebook is in; the run then replaces that notebook's previous one there and is listed, with its
    parameters and time, on `reports/index.html` (rewritten at once). Returns the results.json path.
    """
    path = write_results(name, output_dir=output_dir, parameters=parameters, records=records, ledger=ledger,
                         figures=figures, device=device)
    if not output_dir:
        _list_interactive_run(path.parent.parent.parent, path)  # reports/interactive/<name>/results.json
    return path


def _list_interactive_run(reports: Path, path: Path) -> None:
    """Rewrite the index pages so a JupyterLab run is listed at once; say where it went (the folder is
    usually outside JupyterLab's file browser). A page that cannot be written costs the run nothing."""
    try:
        with locked(reports):
            index = write_index(reports)
    except (OSError, UsageError) as exc:
        print(f"results saved to {path}; the index was not updated: {getattr(exc, 'strerror', None) or exc}",
              file=sys.stderr)
        return
    print(f"results saved to {path}; listed in {index}")

