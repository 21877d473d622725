"""The GPU run: reference reports built on a bare CUDA machine, carried there and back as files (issue 22).

One command, `python -m workbench.gpu` (`cli`), in three steps. Here, `pack` writes a folder holding the
committed checkout, the Jupyter stack as wheels (`wheels`) and `run.sh`. There, `run.sh PART OUTDIR` runs one
part per call (`parts`): the CUDA-only tests, the packed kernels' throughput table, the memory part (`memory`:
CalcGraph's zoo; the advisor suite through the advisor notebook's own entry point), or notebooks at their
`gpu` profile (`run`, through the ordinary report runner), each kept as a reference folder (`place`) and
written as one archive (`archive`). Here again, `unpack` brings the archives into `reports/reference/`, then
the listing and the index pages are rebuilt from what is on disk.

This package sits above `workbench.report` (it builds reports with its runner and writes reference folders in
the format `report.reference` reads) and below the notebooks' experiments, whose code it runs only as
processes, never imports (DESIGN.md, tests/test_layout.py).
"""
