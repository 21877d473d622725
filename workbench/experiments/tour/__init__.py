"""Experiments of the notebook ``tour``: the workbench's conventions (no paper), and MemoryMeter checked
against sizes computed by hand."""

from . import claims
from .memory import allocation_check, explore_step, training_step
from .plots import TOY_SCALE, plot_step_trace

__all__ = ["TOY_SCALE", "allocation_check", "claims", "explore_step", "plot_step_trace", "training_step"]
