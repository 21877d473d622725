"""A network as the linear chain of stages the variable-batch-size planner works on.

Implements the network model of "Variable batch size across layers for efficient prediction on
CNNs" (Choudhury et al.), Section III: a *main path* of layers, where every group of parallel
branches between two main-path nodes is collapsed into one *special layer* ("Generalization to
branched models", Fig 5).

Here a model is read as a list of `Stage`s:

- a plain stage is one *layer group*: a module that is not in place (convolution, pooling,
  linear) bundled with the BatchNorm / ReLU / Dropout modules right after it, as the paper
  bundles "the ReLU, BatchNorm and Scaling layer with the preceding convolution layer";
- a branch stage is the paper's special layer L_s: its input is the activation at L_x, every
  branch is its own linear chain of layer groups, and the branch outputs are merged into the
  activation at L_y by concatenation along channels (`merge="cat"`, inception modules, Fire
  expand) or by a sum (`merge="add"`, residual blocks), then an optional in-place `post` module
  (the ReLU after a residual sum) runs on the merged tensor.

How a model declares this (no registration needed):

- an `nn.Sequential` is read child by child (nested `nn.Sequential`s are flattened);
- a module with a `branches` attribute (an `nn.ModuleList` of `nn.Sequential`s or modules) and a
  `merge` attribute ("cat" or "add"), optionally `post`, is a branch stage;
- a module with `body`, `shortcut` and `relu` attributes (the residual blocks of
  `workbench.models.resnet`) is a branch stage with `merge="add"` and `post=relu`;
- `nn.Identity` is dropped, so an identity shortcut is a branch with no layers.

Running the stages one after another equals the model's own forward pass (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Stage", "stages_of", "run_stages", "BUNDLED"]

# NOTE: modules folded into the preceding layer group; in eval mode they are element-wise (or
# views) and the paper measures them together with the convolution before them.
BUNDLED: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.ReLU, nn.ReLU6, nn.Dropout, nn.Dropout2d,
    nn.Flatten,
)
MERGES = ("cat", "add")


@dataclass
class Stage:
    """One main-path layer: a plain layer group, or a branch group (a special layer)."""

    name: str
    module: nn.Module | None = None
    branches: list[list[tuple[str, nn.Module]]] = field(default_factory=list)
    merge: str = "cat"
    post: nn.Module | None = None

    @property
    def is_branch(self) -> bool:
        return self.module is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            return self.module(x)
        outs = []
        for branch in self.branches:
            y = x
            for _, layer in branch:
                y = layer(y)
            outs.append(y)
        y = torch.cat(outs, dim=1) if self.merge == "cat" else _sum(outs)
        return self.post(y) if self.post is not None else y


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _leaves(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Children of nested Sequentials, in order, with dotted names; Identity dropped."""
    if isinstance(module, nn.Identity):
        return []
    if isinstance(module, nn.Sequential):
        out = []
        for name, child in module.named_children():
            out.extend(_leaves(child, f"{prefix}.{name}" if prefix else name))
        return out
    return [(prefix, module)]


def _is_branch(module: nn.Module) -> bool:
    if isinstance(getattr(module, "branches", None), nn.ModuleList):
        return True
    return all(hasattr(module, a) for a in ("body", "shortcut", "relu"))


def _bundle(leaves: list[tuple[str, nn.Module]], where: str) -> list[tuple[str, nn.Module]]:
    """Layer groups: each non-bundled module with the bundled modules that follow it."""
    groups: list[tuple[str, list[nn.Module]]] = []
    for name, mod in leaves:
        if _is_branch(mod):
            raise ValueError(f"{where}: nested branch group {name!r} inside a branch is not supported")
        if isinstance(mod, BUNDLED) and groups:
            groups[-1][1].append(mod)
        else:
            groups.append((name, [mod]))
    # a group that starts a named Sequential ("conv1.0") is named after it ("conv1")
    return [(name.removesuffix(".0"), mods[0] if len(mods) == 1 else nn.Sequential(*mods)) for name, mods in groups]


def _branch_stage(name: str, module: nn.Module) -> Stage:
    if isinstance(getattr(module, "branches", None), nn.ModuleList):
        merge = getattr(module, "merge", None)
        if merge not in MERGES:
            raise ValueError(f"branch group {name!r}: merge must be one of {MERGES}, got {merge!r}")
        parts = [(f"{name}.branches.{i}", b) for i, b in enumerate(module.branches)]
        post = getattr(module, "post", None)
    else:  # a residual block: relu(body(x) + shortcut(x))
        merge, post = "add", module.relu
        parts = [(f"{name}.body", module.body), (f"{name}.shortcut", module.shortcut)]
    branches = [_bundle(_leaves(b, bname), bname) for bname, b in parts]
    return Stage(name=name, branches=branches, merge=merge, post=post)


def stages_of(model: nn.Module) -> list[Stage]:
    """The main path of `model` as stages (layer groups and branch groups), in execution order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    leaves = _leaves(model, "") if isinstance(model, nn.Sequential) else [(type(model).__name__, model)]
    stages: list[Stage] = []
    run: list[tuple[str, nn.Module]] = []

    def flush() -> None:
        stages.extend(Stage(name=n, module=m) for n, m in _bundle(run, "main path"))
        run.clear()

    for name, mod in leaves:
        if _is_branch(mod):
            flush()
            stages.append(_branch_stage(name, mod))
        else:
            run.append((name, mod))
    flush()
    if not stages:
        raise ValueError(f"model {type(model).__name__} has no layers to plan")
    return stages


@torch.no_grad()
def run_stages(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    """Apply the stages in order (equals the model's forward pass)."""
    for stage in stages:
        x = stage(x)
    return x
