"""Importing a peer library (torchao, optimi, bitsandbytes) for the packed notebook's tables without the log lines
torch writes while it loads.

# NOTE: torchao 0.x registers an Enum with torch's pytree at import, which torch 2.13 logs as a deprecation
# (a red "register_constant() on Enum subclasses is deprecated" block in the notebook, issue 43), and on a CPU
# build it logs that its CUDA-only libraries (`_C_cutlass_90a`) do not load: nothing the reader can act on, so
# those loggers are held at ERROR while a peer imports.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

__all__ = ["import_peer"]


def import_peer(name: str) -> ModuleType:
    """`importlib.import_module(name)`, those loggers quiet meanwhile; ImportError as importlib raises it."""
    loggers = [logging.getLogger(n) for n in ("torch.utils._pytree", "torchao")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
