"""Reports: the claims ledger, `results.json`, the papermill runner and the index pages.

A notebook measures, turns its records into a `Ledger` with its experiments package's `claims.py`
(claims as data, verdicts computed by stated rules) and calls `save_results`. `build_reports`
executes notebooks headlessly with papermill under the `workbench` kernel at a named profile, one
folder per notebook under `reports/<profile>/`, and writes `reports/<profile>/index.html` from every
folder's `run.json` and `results.json`, plus `reports/index.html` linking the profiles. A notebook's
numeric parameters declare their allowed values beside their defaults (`# range: LO..HI`, see
`parameters`); the runner replaces only what it made (`folders`).
"""

from .index import write_index
from .ledger import (
    CHECK, DEVICE_CLASSES, SOURCES, VERDICTS, Claim, Ledger, Measured, Records, Rule, at_least, at_most, between,
    Table, device_class, finite, format_value, judge, ledger_html, record_frame, table, tally, within,
)
from .results import (
    KERNEL_NAME, PAPERS, PROFILES, RESERVED, Paper, UsageError, capture_parameters, notebook_repository,
    paper_citation,
)
from .save import save_results
from .parameters import Declared, notebook_parameters
from .runner import available_notebooks, build_reports, load_profile

__all__ = [
    "PROFILES", "KERNEL_NAME", "RESERVED", "VERDICTS", "CHECK", "SOURCES", "DEVICE_CLASSES", "Rule", "at_least",
    "at_most", "within", "between", "Ledger", "tally", "Claim", "Measured", "Records", "judge",
    "record_frame", "finite", "device_class", "Table", "table",
    "format_value", "ledger_html", "capture_parameters", "save_results", "UsageError", "available_notebooks",
    "load_profile", "notebook_parameters", "Declared",
    "build_reports", "write_index", "Paper", "PAPERS", "paper_citation", "notebook_repository",
]
