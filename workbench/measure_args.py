"""Argument checks shared by the measuring functions (`workbench.measure`) and the techniques that take a
device: each error names the function, the argument and the value."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["check_device", "check_flag"]


def check_device(device, who: str = "device") -> torch.device:
    """`device` (None: CPU) as a torch.device of type cpu or cuda that exists here; errors name `who` and
    the value.

    # NOTE: checked before torch sees the value: torch's message for an unknown name lists every backend,
    # and CUDA calls in a build without CUDA fail with an assertion or abort the interpreter (C++ frames).
    """
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{who} device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, "
                        f"got {device!r} ({type(device).__name__})")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{who} device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{who} supports 'cpu' and 'cuda' devices, got {dev}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{who} device {str(device)!r}: CUDA is not available here; use 'cpu'")
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(f"{who} device {str(device)!r}: CUDA device index must be in 0..{count - 1}")
    return dev


_device = check_device


def _callable(fn, what: str) -> Callable:
    if not callable(fn):
        raise TypeError(f"{what} must be a callable taking no arguments, got {fn!r} ({type(fn).__name__})")
    return fn


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {least}, got {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def _seconds(value, name: str) -> float:
    """A positive, finite number of seconds (NaN and inf compare false everywhere and would pass a `<= 0` check)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds > 0, got {value!r} ({type(value).__name__})")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
    return float(value)


def check_flag(name: str, value: Any) -> None:
    """TypeError unless ``value`` is True or False (or 1 or 0): a string such as 'False' or 'no' is truthy, and
    taking it as True would silently run another optimizer than the one asked for."""
    if not (isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1))):
        raise TypeError(f"{name}={value!r} must be True or False, got {type(value).__name__}")
