"""The memory advisor: for a user's model, batch and memory budget, every combination of the techniques
this workbench implements (precision, packed extra bits, state dtype, step in backward, checkpointing)
predicted with CalcGraph's plan and a measured time model; the fastest that fits chosen, built and verified.

``configs``: the technique switches (`Config`, the default grid, the training setup of a config).
``advise``: `advise(model_fn, batch, memory_budget=...) -> Advice` (`table`, `best`, `build()`, `verify()`).
"""

from workbench.advisor.advise import CATEGORIES, Advice, advise
from workbench.advisor.configs import Config, default_grid

__all__ = ["CATEGORIES", "Advice", "Config", "advise", "default_grid"]
