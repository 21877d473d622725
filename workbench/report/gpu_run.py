"""`python -m workbench.report.gpu_run`: the GPU run's command under its earlier name (../shared/GPU.md and packs
made before issue 42 name it), forwarded to `python -m workbench.gpu` as a program, not imported: the report
layer imports nothing of `workbench.gpu`, which sits above it (tests/test_layout.py)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("workbench.gpu", run_name="__main__", alter_sys=True)
