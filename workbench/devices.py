"""Device choice, seeding and the environment record attached to every result."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from pathlib import Path

import numpy as np
import torch

__all__ = ["pick_device", "seed_everything", "environment", "repo_root"]


def repo_root() -> Path:
    """The checkout this package was installed from (editable installs) or the current folder."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def pick_device(name: str | None = None) -> torch.device:
    """CUDA when present, else CPU. `name` or the WORKBENCH_DEVICE variable overrides the choice."""
    name = name or os.environ.get("WORKBENCH_DEVICE") or None
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; allowed: 'cpu', 'cuda', 'cuda:N'")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    # NOTE: a copy of the checkout on another machine (gpu_run, run.sh) names its commit here: git reads none
    # there, or the commit of a repository the copy happens to sit in.
    if os.environ.get("WORKBENCH_COMMIT"):
        return os.environ["WORKBENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo_root(),
            capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: torch.device | str | None = None) -> dict:
    """What a measurement ran on: torch version, device name, threads, CPU model, git commit."""
    device = torch.device(device) if device is not None else pick_device()
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({_cpu_model()})"
    return {
        "device": str(device),
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
