"""Reading a model's real forward pass with `torch.fx`, for the stage decomposition of `graph`.

The variable-batch-size planner of Choudhury et al. ("Variable batch size across layers for
efficient prediction on CNNs", Section III) needs the network as a main path of layers and
branch groups. `trace_forward` records what `model.forward` actually does, as a `torch.fx` graph whose
leaves are the `torch.nn` modules (convolutions, BatchNorm, ReLU, pooling, ...) and the tensor
functions the forward calls; `workbench.vbs.graph` then reads the stages off that graph.

Tracing is symbolic, so a forward with data-dependent control flow (``if x.sum() > 0``) cannot be
traced. Such a submodule is kept whole: it becomes one leaf (run by its own forward, so its
results stay right) and `Trace.opaque` says which module and why; the rest of the model is still
traced. When the model's own forward cannot be traced, `trace_forward` returns None and the
reason. Extra forward arguments with defaults are fixed at their defaults (the executor feeds one
tensor); a forward that needs two inputs, or returns anything but one tensor, is not traced.

`subgraph` turns a run of graph nodes into a module of its own (a `GraphModule` sharing the
model's parameters), `node_values` runs the traced graph and keeps chosen intermediate values
(to tell which stage differs when an executed plan disagrees with the model).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import fx, nn

__all__ = ["Trace", "trace_forward", "subgraph", "node_values", "depends_on_input"]


class _Tracer(fx.Tracer):
    """`fx.Tracer` that drops `nn.Identity` and keeps an untraceable submodule whole."""

    def __init__(self) -> None:
        super().__init__()
        self.opaque: dict[str, str] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.opaque or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if isinstance(m, nn.Identity) and len(args) == 1 and not kwargs:
            return args[0]
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            return super().call_module(m, forward, args, kwargs)
        before, depth = set(self.graph.nodes), len(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:  # noqa: BLE001 - any failure inside keeps the module whole
            # NOTE: undo the failed attempt: its module-stack entries and the nodes it created
            while len(self.module_stack) > depth:
                self.module_stack.popitem(last=True)
            for node in reversed(list(self.graph.nodes)):
                if node not in before:
                    self.graph.erase_node(node)
            self.opaque[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return super().call_module(m, forward, args, kwargs)


@dataclass
class Trace:
    """A traced model: `module` (a GraphModule over the model's own submodules and parameters),
    `opaque` (qualified name -> why that submodule could not be traced and is kept whole)."""

    module: fx.GraphModule
    opaque: dict[str, str] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph


def _concrete_args(model: nn.Module) -> dict | None:
    """Extra forward arguments with defaults are fixed at their defaults; one tensor input stays."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    extra = {p.name: p.default for p in params[1:]
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty}
    return extra or None


def trace_forward(model: nn.Module) -> tuple[Trace | None, str]:
    """Trace `model.forward` (see the module docstring): (Trace, "") or (None, why it failed)."""
    tracer, fixed = _Tracer(), _concrete_args(model)
    try:
        graph = tracer.trace(model, concrete_args=fixed)
        graph.lint()
        gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    except Exception as err:  # noqa: BLE001 - any failure leaves the model whole
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1 + len(fixed or {}):
        return None, f"its forward takes {len(inputs) - len(fixed or {})} inputs (the executor feeds one tensor)"
    out = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(out.args[0], fx.Node):
        return None, "its forward does not return one tensor"
    return Trace(gm, dict(tracer.opaque)), ""


def depends_on_input(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from the input (the first placeholder; the others are fixed arguments)."""
    start = next(n for n in graph.nodes if n.op == "placeholder")
    seen, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if user.op != "output" and user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def subgraph(root: nn.Module, nodes: list[fx.Node], inp: fx.Node, out: fx.Node, name: str) -> fx.GraphModule:
    """`nodes` (in graph order) as a module of one input: `inp`'s value in, `out`'s value out.
    Nodes they read that do not depend on the input (parameters, constants) are copied in."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {inp: g.placeholder("x")}

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:  # a constant: copied with whatever it reads
            env[n] = g.node_copy(n, arg)
        return env[n]

    for n in nodes:
        env[n] = g.node_copy(n, arg)
    g.output(env[out])
    cls = "".join(c if c.isalnum() else "_" for c in name) or "stage"
    return fx.GraphModule(root, g, class_name=f"Stage_{cls}")


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(module)
        self.keep, self.values = keep, {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n.name in self.keep and isinstance(value, torch.Tensor):
            self.values[n.name] = value.clone()  # later in-place ops must not change it
        return value


@torch.no_grad()
def node_values(t: Trace, x: torch.Tensor, names: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the traced graph on `x`: its output and the values of the nodes named `names`."""
    rec = _Recorder(t.module, set(names))
    out = rec.run(x)
    return out, rec.values
