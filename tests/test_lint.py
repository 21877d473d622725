"""The library and tests stay ruff-clean (rules in pyproject.toml)."""

import subprocess
import sys

from workbench.devices import repo_root


def test_ruff_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "workbench", "tests"],
                          cwd=repo_root(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
