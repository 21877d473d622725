"""What `run.sh PART OUTDIR` runs on the GPU machine (`pack` writes run.sh): one part per call.

Each part installs the carried wheels it needs (`wheels`; a later call on the same machine reuses them),
stops at its deadline (`--deadline`, PART_DEADLINE by default: under the 9 minutes a call may take) keeping
what it finished, writes at most 8 files to OUTDIR and streams its log there as it goes, so even a run killed
from outside leaves its log. `python -m workbench.gpu unpack` takes every archive a part writes. Expected
minutes on an H100 (from the 2026-11-26 run's logs where they say; `part.json` records each run's own seconds):

- `tests`, about 1.5: every CUDA-only test (`pytest -m cuda`, about 42 tests, most of them Triton kernel builds, on 8
  pytest-xdist workers; 84 s on 2026-11-27 beside the memory part). Files: tests.log, tests.xml (JUnit),
  tests-<device>.tar.gz.
- `kernels`, about 2 (121 s on 2026-11-27, in 64 tensors alone; 512 tensors added since, not yet timed): the packed
  throughput table at 1e8 parameters in 64 tensors and again in 512,
  eleven widths (byte planes, dense words with and without SR, fp16, bf16 moments), the peers and each
  format's compiled step (`kernels_command`; the notebook's Fig 3 cell timed 3 widths at this size, compiled
  too, in 17 s there). Files: kernels.log, kernels.csv, kernels.backward.csv, kernels-<device>.tar.gz.
- `memory`, 5 or more: `memory`, CalcGraph's zoo (uncalibrated: 35 s on 2026-11-27; calibrated: not yet
  run) and the advisor suite (its first model did not finish in the 2.5 minutes left that day) against
  max_memory_allocated and max_memory_reserved. Files: memory.log, memory-zoo.csv, memory-advisor.csv,
  memory-decisions.csv, memory-<device>.tar.gz.
- notebook names (one, or several joined by commas, at most NOTEBOOKS_PER_CALL): each notebook's gpu profile
  through `run.run`, the time left shared out as each one's deadline. There: tour 0.25 minutes,
  variable_batch_size 0.6, efficient_densenet 0.9, packed_bit_optimizers 5.2; optorch and calcgraph are sized
  for at most about 8 each (not yet run); advisor ran past a 6.3-minute deadline on 2026-11-27 at 48 candidates a
  model, all run (its gpu profile now plans 24 and runs 8 a model). Files: notebooks.log and one
  reference-<device>-<name>.tar.gz per notebook.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..devices import repo_root
from ..report.reference import PARTS
from ..report.results import PROFILES, UsageError
from .archive import bundle_part
from .place import device_slug
from .run import check_commit, check_device, environment_restored, run
from .wheels import install_wheels, prepend_path

__all__ = ["PART_DEADLINE", "NOTEBOOKS_PER_CALL", "kernels_command", "run_part", "add_part_parser"]

PART_DEADLINE = 480.0  # seconds: 8 minutes, inside a 10-minute call with the start, the install and the archive
NOTEBOOKS_PER_CALL = 6  # one archive each, beside the log: at most 8 files come back from a call
_GRACE = 30.0  # seconds between Ctrl-C (pytest writes its report, Python unwinds) and the kill


def kernels_command(device: str, csv: Path, *, smoke: bool = False) -> list[str]:
    """The kernel benchmark's command line (after `python`).

    # NOTE: the one place that names it: when the benchmark's command line changes, change it here only.
    """
    size, tensors = (65_536, ["4"]) if smoke else (100_000_000, ["64", "512"])
    command = ["-m", "workbench.experiments.packed_bit_optimizers.throughput", "--device", device, "--sizes", str(size),
               "--tensors", *tensors, "--csv", str(csv)]
    if smoke:
        return command + ["--threads", "1", "--repeats", "2", "--no-backward"]
    # Every kind of width the Triton step takes (byte planes 8/16, dense words with and without stochastic
    # rounding, fp16), bf16 moments for the 1.4x target, then the peers (FlashOptim among them) and each format's
    # compiled step; in 64 tensors, then in 512, where a step that launches once per parameter shows (issue 46).
    configs = ["bf16+8", "bf16+16", "bf16+8 bf16 states", "bf16+1", "bf16+4", "bf16+7 SR", "bf16+12",
               "bf16+13 SR", "bf16+15 SR", "fp16+8", "fp16+13 SR"]
    return command + ["--repeats", "15", "--configs", *configs, "--peers", "--compiled-too"]


def _say(log: Path, text: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {text}\n"
    with open(log, "a") as handle:
        handle.write(line)
    sys.stdout.write(line)
    sys.stdout.flush()


def _stream(command: list[str], log: Path, deadline_at: float) -> tuple[int, bool]:
    """Run `command` (in its own process group), its output appended to `log` line by line and echoed; at
    `deadline_at` (time.monotonic) Ctrl-C it, then kill it _GRACE seconds later. Returns (exit code, stopped)."""
    _say(log, "$ " + " ".join(command))
    process = subprocess.Popen(command, cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)

    def pump():
        with open(log, "ab") as handle:
            for line in process.stdout:
                handle.write(line)
                handle.flush()
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = False
    try:
        code = process.wait(timeout=max(1.0, deadline_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        stopped = True
        os.killpg(process.pid, signal.SIGINT)
        try:
            code = process.wait(timeout=_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
    reader.join(timeout=10)
    if stopped:
        _say(log, "stopped at the deadline; what it finished is kept")
    return code, stopped


def _environment(device: str) -> dict:
    import torch

    from ..devices import environment

    return environment(torch.device(device))


def _command(part: str, out: Path, device: str, profile: str, paths: list[str]) -> tuple[list[str], list[Path]]:
    """The part's command line and the files it leaves in `out` (besides its log)."""
    python = [sys.executable, "-u"]
    if part == "tests":
        # NOTE: the image has pytest-xdist: 8 workers compile the Triton kernels' many specializations in
        # parallel (each process keeps its own CUDA allocator statistics, so memory tests are not disturbed).
        workers = ["-n", "8"] if importlib.util.find_spec("xdist") and profile != "smoke" else []
        return ([*python, "-m", "pytest", "-m", "cuda", *workers, "-p", "no:cacheprovider", "-rA", "-v",
                 "--continue-on-collection-errors", f"--junitxml={out / 'tests.xml'}", *(paths or ["tests"])],
                [out / "tests.xml"])
    if part == "kernels":
        csv = out / "kernels.csv"
        return [*python, *kernels_command(device, csv, smoke=profile == "smoke")], [csv, out / "kernels.backward.csv"]
    return ([*python, "-m", "workbench.gpu.memory", str(out), "--device", device, "--profile", profile],
            [out / f"memory-{t}.csv" for t in ("zoo", "advisor", "decisions")])


def _notebooks(names: list[str], out: Path, *, profile: str, device: str | None, commit: str, deadline_at: float,
               wheels: Path | None, site: Path | None) -> int:
    log, failed = out / "notebooks.log", 0
    reference = Path(tempfile.mkdtemp(prefix="workbench-reference-"))
    for name in names:
        left = deadline_at - time.monotonic()
        if left < 30:
            _say(log, f"{name}: not started ({left:.0f} s left before the deadline)")
            failed += 1
            continue
        _say(log, f"{name}: {profile} profile, deadline {left:.0f} s")
        with environment_restored():
            (row,) = run([name], profile=profile, device=device, commit=commit, reference=reference,
                         bundle_dir=out, wheels=wheels, site=site, deadline=left)
        failed += row["status"] != "ok"
        _say(log, f"{name}: {row['status']} in {row['seconds']} s; archive {row['archive']}"
             + (f"; error: {row['error']}" if row["error"] else ""))
    return 1 if failed else 0


def run_part(part: str, out: Path, *, profile: str = "gpu", device: str | None = None,
             deadline: float = PART_DEADLINE, commit: str | None = None, wheels: Path | None = None,
             site: Path | None = None, paths: list[str] | None = None) -> int:
    """Run one part into `out` (see the module's docstring). Returns 0 when it finished and passed, 1 when it
    failed or was stopped; everything is checked before any work (UsageError)."""
    from ..report.runner import available_notebooks

    if profile not in ("gpu", "smoke"):
        raise UsageError(f"--profile {profile!r}: expected gpu (or smoke, the dry run)")
    if not 1 <= deadline <= 86400:
        raise UsageError(f"--deadline {deadline}: expected seconds in 1..86400")
    names = [] if part in PARTS else part.split(",")
    known = available_notebooks(repo_root() / "notebooks")
    if names and (not set(names) <= set(known) or len(names) > NOTEBOOKS_PER_CALL):
        raise UsageError(f"part {part!r}: expected one of {', '.join(PARTS)}, or up to {NOTEBOOKS_PER_CALL} of "
                         f"{', '.join(known)} joined by commas")
    if paths and part != "tests":
        raise UsageError(f"--only {paths}: test paths are for the tests part only")
    device = check_device(device) if device else (None if names else "cuda")
    if device is None and profile == "smoke":
        raise UsageError("--profile smoke needs --device cpu (the smoke sizes are a dry run)")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started, deadline_at = time.monotonic(), time.monotonic() + deadline
    with environment_restored():
        os.environ["WORKBENCH_COMMIT"] = commit = check_commit(commit)
        site = site or Path(tempfile.gettempdir()) / "workbench-gpu-site"
        install_wheels(wheels, site, log=lambda text: _say(out / f"{'notebooks' if names else part}.log", text))
        prepend_path("PYTHONPATH", repo_root())
        if names:
            return _notebooks(names, out, profile=profile, device=device, commit=commit, deadline_at=deadline_at,
                              wheels=wheels, site=site)
        log = out / f"{part}.log"
        command, files = _command(part, out, device, profile, paths or [])
        code, stopped = _stream(command, log, deadline_at)
        env = _environment(device)
        record = {"status": "stopped" if stopped else "ok" if code == 0 else "failed", "exit_code": code,
                  "seconds": round(time.monotonic() - started, 1), "made": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "commit": commit, "profile": profile, "deadline": deadline, "command": command[1:],
                  "environment": {**env, "git_commit": commit}}
        archive = bundle_part([log, *files], record, device_slug(env["device_name"]), part, out)
        _say(log, f"{part}: {record['status']} in {record['seconds']} s; archive {archive}")
    return 0 if record["status"] == "ok" else 1


def add_part_parser(sub) -> None:
    part = sub.add_parser("part", help="run one part on the GPU machine (what run.sh calls)",
                          description=__doc__.split("\n\n")[0])
    part.add_argument("part", help=f"{' | '.join(PARTS)} | notebook[,notebook...]")
    part.add_argument("outdir", type=Path, help="where its files go ($OUT on the GPU machine)")
    part.add_argument("--profile", default="gpu", choices=[p for p in PROFILES if p in ("gpu", "smoke")])
    part.add_argument("--device", help="cuda (the default), cuda:N, or cpu with --profile smoke (a dry run)")
    part.add_argument("--deadline", type=float, default=PART_DEADLINE, help="seconds before the part is stopped")
    part.add_argument("--commit", help="the commit of this checkout (run.sh passes the one pack copied)")
    part.add_argument("--wheels", type=Path, help="the carried wheels (run.sh passes its wheels folder)")
    part.add_argument("--site", type=Path, help="where they are installed (default: <tmp>/workbench-gpu-site)")
    part.add_argument("--only", action="append", metavar="PATH", help="tests part: run the CUDA tests under PATH "
                                                                      "only (repeatable; default: all of tests/)")
    part.set_defaults(handler=lambda args: run_part(
        args.part, args.outdir, profile=args.profile, device=args.device, deadline=args.deadline,
        commit=args.commit, wheels=args.wheels, site=args.site, paths=args.only))
