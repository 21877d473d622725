"""A network as the linear chain of stages the variable-batch-size planner works on.

Implements the network model of "Variable batch size across layers for efficient prediction on
CNNs" (Choudhury et al.), Section III: a *main path* of layers, where every group of parallel
branches between two main-path nodes is collapsed into one *special layer* ("Generalization to
branched models", Fig 5).

The stages are read from what the model's forward really does, not from its attribute names:
`workbench.vbs.tracing` records `model.forward` with `torch.fx`, and the main path is the chain
of *cut nodes* of that graph (values every later computation goes through). Between two cut
nodes lies either one operation, or a region:

- a plain stage is one *layer group*: an operation that is not element-wise (convolution,
  pooling, linear) bundled with the BatchNorm / ReLU / Dropout / Flatten operations right after
  it, as the paper bundles "the ReLU, BatchNorm and Scaling layer with the preceding convolution
  layer";
- a region whose paths from its input are separate chains ending in one concatenation along
  channels (`merge="cat"`, inception modules, Fire expand) or one sum of two (`merge="add"`,
  residual blocks) is a branch stage, the paper's special layer L_s: every branch is a chain of
  layer groups (an identity path is a branch with no layers), and the element-wise operations
  after the merge inside the same module (the ReLU after a residual sum) are its `post`;
- any other region (a gate, a sum of three, nested branches, `x.view(x.size(0), -1)`) is one
  plain stage that runs that part of the graph as it is.

A stage is named after the module that holds it ("conv1" for the group starting at "conv1.0",
"layer1_0" for a residual block, "fire2.expand"), else after its graph nodes ("add", "flatten",
"chunk..cat"); a name used twice (a module called twice) gets "@1", "@2", ...
A tuple a layer returns stays inside the stage that made it (its items are no tensors to queue).
A submodule that cannot be traced (data-dependent control flow) is one stage run by its own
forward, and a model whose forward cannot be traced is one stage: both with a `warnings.warn`
naming the module and why. The executor checks its result against `model(x)` on the first batch
(`workbench.vbs.executor`), so a decomposition that does not reproduce the forward is refused.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from .tracing import Trace, depends_on_input, subgraph, trace_forward

__all__ = ["Stage", "Decomposition", "decompose", "stages_of", "run_stages", "BUNDLED"]

# NOTE: operations folded into the preceding layer group; in eval mode they are element-wise (or
# views) and the paper measures them together with the convolution before them.
BUNDLED: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.ReLU, nn.ReLU6, nn.Dropout, nn.Dropout2d,
    nn.Flatten,
)
_BUNDLED_FUNCTIONS = {torch.relu, torch.relu_, F.relu, F.relu6, F.dropout, torch.flatten}
_BUNDLED_METHODS = {"relu", "relu_", "flatten"}
_ADDS = {operator.add, operator.iadd, torch.add}
MERGES = ("cat", "add")


@dataclass
class Stage:
    """One main-path layer: a plain layer group, or a branch group (a special layer).

    `node` names the traced graph node whose value the stage returns (empty for a model that
    could not be traced)."""

    name: str
    module: nn.Module | None = None
    branches: list[list[tuple[str, nn.Module]]] = field(default_factory=list)
    merge: str = "cat"
    post: nn.Module | None = None
    node: str = ""

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


@dataclass
class Decomposition:
    """The stages of a model, its trace (None where the forward could not be traced) and the
    modules kept whole (qualified name -> why)."""

    stages: list[Stage]
    traced: Trace | None
    opaque: dict[str, str]


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


class _Reader:
    """Reads the stages off one traced graph."""

    def __init__(self, model: nn.Module, t: Trace) -> None:
        self.model, self.t = model, t
        self.live = depends_on_input(t.graph)
        self.names: Counter[str] = Counter()

    # -- naming ------------------------------------------------------------------------------
    def _unique(self, name: str) -> str:
        self.names[name] += 1
        return name if self.names[name] == 1 else f"{name}@{self.names[name] - 1}"

    @staticmethod
    def _owners(n: fx.Node) -> list[str]:
        return [q for q, _ in n.meta.get("nn_module_stack", {}).values()]

    def _owner(self, nodes: list[fx.Node]) -> str:
        """The innermost module whose forward made all of `nodes` ("" for the model's own)."""
        stacks = [self._owners(n) for n in nodes]
        common = []
        for level in zip(*stacks, strict=False):
            if any(q != level[0] for q in level):
                break
            common.append(level[0])
        return common[-1] if common else ""

    @staticmethod
    def _layer_name(n: fx.Node) -> str:
        if n.op != "call_module":
            return n.name
        parts = str(n.target).split(".")
        return ".".join(parts[:-1]) if len(parts) > 1 and parts[-1] == "0" else str(n.target)

    # -- the graph ---------------------------------------------------------------------------
    def _inputs(self, n: fx.Node) -> list[fx.Node]:
        """The input-dependent nodes `n` reads (with repeats)."""
        found: list[fx.Node] = []
        fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(a) if a in self.live else None)
        return found

    def segments(self) -> tuple[fx.Node, list[tuple[fx.Node, list[fx.Node], fx.Node]]]:
        """(input node, [(segment input, segment nodes, segment output)]) between cut nodes."""
        graph = self.t.graph
        out = next(n for n in graph.nodes if n.op == "output").args[0]
        # NOTE: an unused item of a tuple (`y, _ = self.attn(x, x, x)`) is dropped; any other node
        # nothing reads may act by side effect (an in-place op) and stays, up to the end
        kept = set(self.live)
        while dead := {n for n in kept if _pure(n) and not any(u in kept or u.op == "output" for u in n.users)}:
            kept -= dead
        order = [n for n in graph.nodes if n in kept]
        if out not in kept:  # the result does not depend on the input: nothing to plan
            return order[0], []
        pos = {n: i for i, n in enumerate(order)}
        end = len(order)
        cover = [0] * (end + 2)

        def edge(a: int, b: int) -> None:
            if b > a + 1:
                cover[a + 1] += 1
                cover[b] -= 1

        for n in order:
            users = [u for u in n.users if u in pos]
            for u in users:
                edge(pos[n], pos[u])
            if n is out or not users:  # the result, or a node kept for its side effect
                edge(pos[n], end)
        running, cuts = 0, [0]
        for i in range(1, end):
            running += cover[i]
            if running == 0:
                cuts.append(i)
        cuts.append(end)
        segs = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            nodes = order[a + 1:b + 1] if b < end else order[a + 1:]
            result = order[b] if b < end else out
            if nodes:
                segs.append((order[a], nodes, result))
        return order[0], segs

    def _chains(self, inp: fx.Node, nodes: list[fx.Node], out: fx.Node) -> tuple[str, list[list[fx.Node]]] | None:
        """The branches of a region ending in a cat/add merge, or None if it is no such region."""
        if out is not nodes[-1]:
            return None
        if out.target is torch.cat and out.op == "call_function":
            parts = out.args[0] if out.args else out.kwargs.get("tensors")
            dim = out.args[1] if len(out.args) > 1 else out.kwargs.get("dim", 0)
            if dim != 1 or not isinstance(parts, (list, tuple)):
                return None
            merge = "cat"
        elif ((out.op == "call_function" and out.target in _ADDS) or
              (out.op == "call_method" and out.target in ("add", "add_"))) and not out.kwargs:
            parts, merge = out.args, "add"
            if len(parts) != 2:
                return None
        else:
            return None
        if not all(isinstance(p, fx.Node) and p in self.live for p in parts):
            return None
        inside, claimed, chains = set(nodes[:-1]), set(), []
        for p in parts:
            chain, cur = [], p
            while cur is not inp:
                reads = self._inputs(cur)
                if (cur not in inside or cur in claimed or len(reads) != 1 or len(cur.users) != 1
                        or self._reads_item(cur, reads[0])):  # a layer's input must be a tensor
                    return None
                claimed.add(cur)
                chain.insert(0, cur)
                cur = reads[0]
            chains.append(chain)
        return (merge, chains) if claimed == inside else None

    def _bundled(self, n: fx.Node) -> bool:
        if n.op == "call_module":
            return isinstance(self.model.get_submodule(str(n.target)), BUNDLED)
        if n.op == "call_function":
            return n.target in _BUNDLED_FUNCTIONS
        return n.op == "call_method" and n.target in _BUNDLED_METHODS

    def _module(self, inp: fx.Node, nodes: list[fx.Node], name: str) -> nn.Module:
        """The nodes as one module: the module itself, a Sequential of modules, or a subgraph."""
        prev, mods = inp, []
        for n in nodes:
            if n.op != "call_module" or n.args != (prev,) or n.kwargs:
                return subgraph(self.model, nodes, inp, nodes[-1], name)
            mods.append(self.model.get_submodule(str(n.target)))
            prev = n
        return mods[0] if len(mods) == 1 else nn.Sequential(*mods)

    def _groups(self, inp: fx.Node, chain: list[fx.Node]) -> list[tuple[str, nn.Module, fx.Node]]:
        """A chain of single-input nodes as layer groups (name, module, last node)."""
        groups: list[tuple[fx.Node, list[fx.Node]]] = []
        for n in chain:
            if groups and self._bundled(n):
                groups[-1][1].append(n)
            else:
                groups.append((inp if not groups else groups[-1][1][-1], [n]))
        return [(self._unique(self._layer_name(ns[0])), self._module(i, ns, ns[0].name), ns[-1]) for i, ns in groups]

    # -- the stages --------------------------------------------------------------------------
    def stages(self) -> list[Stage]:
        start, raw = self.segments()
        segs: list[tuple[fx.Node, list[fx.Node], fx.Node]] = []
        for inp, nodes, out in raw:
            if segs and any(self._reads_item(n, inp) for n in nodes):  # `inp` is a tuple: keep with its maker
                segs[-1] = (segs[-1][0], segs[-1][1] + nodes, out)
            else:
                segs.append((inp, nodes, out))
        stages: list[Stage] = []
        # a run of plain single-input nodes on the main path, bundled into layer groups at the end
        run: list[fx.Node] = []
        run_in = start

        def flush() -> None:
            nonlocal run_in
            if run:
                stages.extend(Stage(name, module=m, node=last.name) for name, m, last in self._groups(run_in, run))
                run_in = run[-1]
                run.clear()

        i = 0
        while i < len(segs):
            inp, nodes, out = segs[i]
            i += 1
            if len(nodes) == 1 and nodes[0] is out and self._inputs(out) == [inp]:
                if not run:
                    run_in = inp
                run.append(out)
                continue
            flush()
            shape = self._chains(inp, nodes, out)
            if shape is None:  # a region that is no branch group, or a multi-input op: run as it is
                owner = self._owner(nodes)
                name = self._unique(owner or (out.name if len(nodes) == 1 else f"{nodes[0].name}..{out.name}"))
                stages.append(Stage(name, module=subgraph(self.model, nodes, inp, out, name), node=out.name))
                run_in = out
                continue
            merge, chains = shape
            owner = self._owner(nodes)
            post = []
            while (i < len(segs) and len(segs[i][1]) == 1 and self._bundled(segs[i][2])
                   and self._inputs(segs[i][2]) == [segs[i][0]]
                   and (not owner or owner in self._owners(segs[i][2]))):
                post.append(segs[i][2])
                i += 1
            name = self._unique(owner or out.name)
            branches = [[(g, m) for g, m, _ in self._groups(inp, c)] for c in chains]
            stages.append(Stage(name, branches=branches, merge=merge, node=(post[-1] if post else out).name,
                                post=self._module(out, post, f"{name}.post") if post else None))
            run_in = post[-1] if post else out
        flush()
        return stages

    @staticmethod
    def _reads_item(n: fx.Node, inp: fx.Node) -> bool:
        """`n` takes an item of `inp` (a tuple or list, not a tensor: kept with the node that made it)."""
        return n.op == "call_function" and n.target is operator.getitem and n.args[0] is inp


def _pure(n: fx.Node) -> bool:
    """Reads a value without changing anything (an item, an attribute, a size)."""
    return ((n.op == "call_function" and n.target in (operator.getitem, getattr)) or
            (n.op == "call_method" and n.target in ("size", "dim")))


def decompose(model: nn.Module) -> Decomposition:
    """The stages of `model` (see the module docstring), with its trace and the modules kept whole."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    leaf = fx.Tracer().is_leaf_module(model, "") and not isinstance(model, nn.Sequential)
    if leaf:  # a single torch.nn layer
        return Decomposition([Stage(name, module=model)], None, {})
    t, why = trace_forward(model)
    if t is None:
        warnings.warn(f"workbench.vbs: the forward of {name} could not be traced by torch.fx ({why}); the "
                      f"whole model runs as one opaque stage (no per-layer batch sizes)", stacklevel=3)
        return Decomposition([Stage(name, module=model)], None, {name: why})
    for qual, reason in t.opaque.items():
        warnings.warn(f"workbench.vbs: module {qual!r} ({type(model.get_submodule(qual)).__name__}) of {name} "
                      f"could not be traced by torch.fx ({reason}); it runs as one opaque stage", stacklevel=3)
    stages = _Reader(model, t).stages()
    if not stages:
        raise ValueError(f"model {name} has no layers to plan")
    return Decomposition(stages, t, dict(t.opaque))


def stages_of(model: nn.Module) -> list[Stage]:
    """The main path of `model` as stages (layer groups and branch groups), in execution order."""
    return decompose(model).stages


@torch.no_grad()
def run_stages(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    """Apply the stages in order (equals the model's forward pass)."""
    for stage in stages:
        x = stage(x)
    return x
