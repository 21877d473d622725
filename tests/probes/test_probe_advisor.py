"""`workbench advise` on hostile user code (issue 35): a factory that calls sys.exit(0) while it builds the
model is the user's code ending the process, not advice; the command says so and fails (it printed nothing
and exited 0 on 012f1da)."""

from __future__ import annotations

import subprocess
import sys


def test_a_factory_that_exits_zero_is_not_reported_as_success(tmp_path):
    (tmp_path / "quitter.py").write_text("import sys\n\ndef build():\n    sys.exit(0)\n")
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "advise", "quitter:build", "--batch", "4x8",
                           "--budget", "1MB"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "quitter" in done.stderr or "build" in done.stderr, done.stderr
    assert "SystemExit" in done.stderr or "sys.exit" in done.stderr, done.stderr


def test_a_module_that_exits_at_import_is_not_reported_as_success(tmp_path):
    (tmp_path / "leaver.py").write_text("import sys\nsys.exit(0)\n")
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "advise", "leaver:build", "--batch", "4x8",
                           "--budget", "1MB"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "cannot import 'leaver'" in done.stderr, (done.stdout, done.stderr)
