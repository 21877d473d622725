"""Experiments of the notebook ``tour``: the workbench's conventions (no paper), and MemoryMeter checked
against sizes computed by hand."""

from . import claims
from .memory import allocation_check, training_step

__all__ = ["allocation_check", "claims", "training_step"]
