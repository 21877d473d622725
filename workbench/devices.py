"""Device choice, seeding and the environment record attached to every result.

The record names the CPU and the instruction sets torch's and oneDNN's CPU kernels pick by (`cpu_features`,
summed up by `isa_summary`): the same build measures differently on an AVX-512 BF16 machine (AMD Zen 4) and
on one with AMX-BF16 (Intel Sapphire Rapids), so two reports are compared like with like (issue 48).
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
from pathlib import Path

import numpy as np
import torch

__all__ = ["pick_device", "seed_everything", "environment", "repo_root", "cpu_features", "isa_summary", "ISA_FLAGS"]

# /proc/cpuinfo flags that decide which CPU kernels torch (ATen's vectorized code) and oneDNN run
ISA_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512f", "avx512_bf16", "avx512_fp16", "avx512vbmi",
             "avx512_vnni", "avx2", "fma", "f16c")


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


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except (OSError, UnicodeDecodeError):  # not Linux, or not readable here
        return None


def _cpu_model(cpuinfo: str | None = None) -> str:
    for line in (cpuinfo if cpuinfo is not None else _cpuinfo() or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _torch_capability() -> str | None:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # an older torch
        return None


def cpu_features(cpuinfo: str | None = None) -> dict:
    """The CPU this process runs on: `cpu_model`; `cpu_flags`, each of `ISA_FLAGS` -> present (None where
    /proc/cpuinfo is unreadable, not Linux, or lists no x86 `flags`); `cpu_capability`, the vector ISA torch's
    own kernels dispatch to (`torch.backends.cpu.get_cpu_capability()`, lowered by ATEN_CPU_CAPABILITY);
    `onednn_max_cpu_isa`, the ONEDNN_MAX_CPU_ISA cap on oneDNN's kernels when set; `cpu_isa`, the short text
    of `isa_summary`. `cpuinfo` parses that text instead of this machine's /proc/cpuinfo (tests)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    flags = None
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            flags = {flag: flag in present for flag in ISA_FLAGS}
            break
    features = {"cpu_model": _cpu_model(text), "cpu_flags": flags, "cpu_capability": _torch_capability(),
                "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or None}
    features["cpu_isa"] = isa_summary(features)
    return features


def isa_summary(features: dict) -> str:
    """A short text of what `cpu_features` found, e.g. "AVX-512 BF16" (AMD Zen 4) or "AVX-512 BF16 FP16,
    AMX-BF16" (Intel Sapphire Rapids), with a cap on the kernels when one is set ("oneDNN max AVX512_CORE_BF16",
    "torch AVX2"); "ISA unknown" where the flags could not be read."""
    flags, capability = features.get("cpu_flags"), str(features.get("cpu_capability") or "")
    if not isinstance(flags, dict):
        parts = ["ISA unknown"] + ([f"torch {capability}"] if capability else [])
    else:
        if flags.get("avx512f"):
            vector = " ".join(["AVX-512"] + [n for f, n in (("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"))
                                             if flags.get(f)])
        elif flags.get("avx2"):
            vector = "AVX2" + (" FMA" if flags.get("fma") else "")
        else:
            vector = "no AVX2"
        parts = [vector] + (["AMX-BF16"] if flags.get("amx_bf16") else [])
        if capability and capability != ("AVX512" if flags.get("avx512f") else "AVX2"):
            parts.append(f"torch {capability}")  # ATEN_CPU_CAPABILITY, or a torch that stops short
    if features.get("onednn_max_cpu_isa"):
        parts.append(f"oneDNN max {features['onednn_max_cpu_isa']}")
    return ", ".join(parts)


def _git_commit() -> str | None:
    # NOTE: a copy of the checkout on another machine (workbench.gpu's run.sh) names its commit here: git reads none
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
    """What a measurement ran on: torch version, device name, threads, the CPU and its instruction sets
    (`cpu_features`: cpu_model, cpu_flags, cpu_capability, onednn_max_cpu_isa, cpu_isa), git commit."""
    device = torch.device(device) if device is not None else pick_device()
    cpu = cpu_features()
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({cpu['cpu_model']})"
    return {
        "device": str(device),
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        **cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
