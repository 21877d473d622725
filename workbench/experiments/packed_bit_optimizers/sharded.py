"""Bytes per parameter one rank holds under FSDP2, by world size: measured and predicted (issue 20).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (a packed
optimizer keeps k extra bits plus the moments per parameter) and its closing note (distributed
training as the next step). Under FSDP2 (``fully_shard``) each rank keeps its shard of the
parameters, of the gradients and of the optimizer state. Three methods: torch's AdamW (fp32
parameters), torchao's AdamW8bit (fp32 parameters, 8-bit blockwise moments) and PackedAdamW bf16+8
(bf16 parameters, one byte plane of extra bits, fp32 moments; or bf16 moments, ``state_dtype``).

Measured: each world size runs in a fake process group (``workbench.calcgraph.sharded.fake_group``),
this process being rank ``rank``: its tensors are exactly the local shards a real rank holds (the
collectives move no data, but shapes and allocations are real). One forward, backward and step on a
random batch; then the bytes of the storages behind the rank's parameters, gradients and optimizer
state are counted (a storage once; a DTensor or a torchao quantised state flattened to the plain
tensors it is made of). ``torch.compile`` is forced eager (``torch.compiler.set_stance``): torchao
compiles its step otherwise (tens of seconds per shape on CPU), which changes no allocation.

Predicted, two ways that share no counting rule with the measure: ``formula`` from the sizes each
method documents, applied to the rows FSDP2 gives the rank (``torch.chunk`` of dim 0); ``plan``:
CalcGraph's per-rank plan under fake tensors (``plan_sharded_training``), its parameter, gradient and
optimizer-state zones (which leave out the few tensors an optimizer makes from Python numbers with
``torch.tensor``: torch's 4-byte ``step`` per parameter, torchao's 1 KiB code map per quantised moment).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn

from workbench.calcgraph.sharded import fake_group, local_tensors, plan_sharded_training, shard_model
from workbench.models import MLP
from workbench.optim import PackedAdamW

from .peer_import import import_peer

__all__ = ["SHARDED_METHODS", "formula_bytes", "local_bytes", "plot_sharded_bytes", "sharded_bytes_per_param"]

#: method -> dtype of the model's parameters
SHARDED_METHODS = {"torch AdamW": torch.float32, "torchao AdamW8bit": torch.float32,
                   "PackedAdamW bf16+8": torch.bfloat16, "PackedAdamW bf16+8 (bf16 states)": torch.bfloat16}

# NOTE: torchao quantises a state only where the rank's shard has >= 4096 values and a whole number of
# 256-value blocks (torchao/optim/adam.py, ``_new_buffer``, following bitsandbytes); others stay fp32.
_AO_MIN, _AO_BLOCK = 4096, 256


def _optimizer(method: str, params) -> torch.optim.Optimizer:
    if method == "torch AdamW":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    if method == "torchao AdamW8bit":
        return import_peer("torchao.optim").AdamW8bit(params, lr=1e-3, block_size=_AO_BLOCK)
    if method == "PackedAdamW bf16+8":
        return PackedAdamW(params, lr=1e-3, extra_bits=8)
    if method == "PackedAdamW bf16+8 (bf16 states)":
        return PackedAdamW(params, lr=1e-3, extra_bits=8, state_dtype=torch.bfloat16)
    raise ValueError(f"method={method!r}: allowed {list(SHARDED_METHODS)}")


def _model(widths: Sequence[int], method: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP(tuple(widths), "relu").to(SHARDED_METHODS[method])


def local_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (any pytree) on this rank: local shards, each storage once."""
    seen: dict[int, int] = {}
    for t in local_tensors(tensors):
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _local_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 rank ``rank`` holds: FSDP2 shards dim 0 as ``torch.chunk`` does (chunks of ceil)."""
    chunk = math.ceil(rows / world)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


def formula_bytes(method: str, shapes: Sequence[Sequence[int]], world: int, rank: int = 0) -> dict[str, int]:
    """Weight, gradient and state bytes rank ``rank`` holds for parameters of ``shapes``, from each method's
    documented sizes: torch AdamW 4 + 4 + 8 per value and a 4-byte fp32 ``step`` per tensor; torchao
    AdamW8bit 4 + 4 per value, per moment 1 byte per value + a 4-byte scale per 256-value block + its
    256-entry fp32 code map where the shard is quantised (else 4 bytes per value), and a 4-byte step;
    PackedAdamW bf16+8 2 + 2 per value, 8 bytes of fp32 moments (4 with bf16 states) and 1 byte of extra
    bits per value."""
    out = {"weight": 0, "grad": 0, "state": 0}
    for shape in shapes:
        n = _local_rows(shape[0], world, rank) * math.prod(shape[1:]) if len(shape) else 1
        if method == "torch AdamW":
            out["weight"] += 4 * n
            out["grad"] += 4 * n
            out["state"] += 8 * n + 4
        elif method == "torchao AdamW8bit":
            quantised = n >= _AO_MIN and n % _AO_BLOCK == 0
            moment = n + 4 * (n // _AO_BLOCK) + 4 * 256 if quantised else 4 * n
            out["weight"] += 4 * n
            out["grad"] += 4 * n
            out["state"] += 2 * moment + 4
        elif method.startswith("PackedAdamW bf16+8"):
            out["weight"] += 2 * n
            out["grad"] += 2 * n
            out["state"] += (5 if method.endswith("(bf16 states)") else 9) * n
        else:
            raise ValueError(f"method={method!r}: allowed {list(SHARDED_METHODS)}")
    return out


def _measured(method: str, widths: Sequence[int], world: int, rank: int, batch_size: int) -> dict[str, int]:
    with fake_group(world, rank) as mesh:
        model = shard_model(_model(widths, method), mesh)
        opt = _optimizer(method, model.parameters())
        dtype = SHARDED_METHODS[method]
        x = torch.randn(batch_size, widths[0], dtype=dtype)
        y = torch.randint(0, widths[-1], (batch_size,))
        nn.functional.cross_entropy(model(x).float(), y).backward()
        with torch.compiler.set_stance("force_eager"):  # the module docstring says why
            opt.step()
        params = list(model.parameters())
        return {"weight": local_bytes(params), "grad": local_bytes([p.grad for p in params]),
                "state": local_bytes([list(st.values()) for st in opt.state.values()]),
                "local_params": sum(t.numel() for t in local_tensors(params))}


def _planned(method: str, widths: Sequence[int], world: int, rank: int, batch_size: int) -> dict[str, int]:
    dtype = SHARDED_METHODS[method]
    with torch.compiler.set_stance("force_eager"):
        plan = plan_sharded_training(lambda: _model(widths, method), (widths[0],), world, rank=rank,
                                     optimizer=lambda params: _optimizer(method, params), input_dtype=dtype,
                                     trace_sizes=(batch_size, batch_size + 1), calibrate=False)
    zones = plan.zones(batch_size)
    by_kind = zones.groupby("kind")["bytes"].sum()
    return {k: int(by_kind.get(kind, 0)) for k, kind in (("weight", "parameter"), ("grad", "gradient"),
                                                          ("state", "state"))}


def sharded_bytes_per_param(world_sizes: Sequence[int] = (1, 2, 4), *, widths: Sequence[int] = (64, 256, 256, 10),
                            methods: Sequence[str] | None = None, batch_size: int = 4, rank: int = 0,
                            plan: bool = True) -> pd.DataFrame:
    """Per-rank bytes per parameter of an MLP of ``widths`` sharded by FSDP2 over each world size.

    One row per (method, world_size): ``params`` (the model's), ``local_params`` (rank ``rank``'s shard),
    measured ``weight_bytes``/``grad_bytes``/``state_bytes``, ``bytes_per_param`` (their sum over the
    model's parameters: falls about as 1 / world_size) and ``state_bytes_per_param``; the same two
    predicted by ``formula_*`` and, with ``plan``, by CalcGraph's plan (``plan_*``), and
    ``measured_over_formula``/``measured_over_plan``. ``methods`` defaults to :data:`SHARDED_METHODS`,
    less torchao's where it is not installed.
    """
    if methods is None:
        methods = [m for m in SHARDED_METHODS if m != "torchao AdamW8bit" or importlib.util.find_spec("torchao")]
    unknown = [m for m in methods if m not in SHARDED_METHODS]
    if unknown or not methods:
        raise ValueError(f"methods={list(methods)}: allowed a non-empty subset of {list(SHARDED_METHODS)}")
    bad = [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int) or w < 1 or rank >= w]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes={list(world_sizes)}: allowed a non-empty list of integers >= 1 and > "
                         f"rank={rank}")
    if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths={list(widths)}: allowed at least two integers >= 1")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: allowed integers >= 1")
    shapes = [tuple(p.shape) for p in MLP(tuple(widths), "relu").parameters()]
    params = sum(math.prod(s) for s in shapes)
    rows = []
    for method in methods:
        for world in world_sizes:
            row = {"method": method, "world_size": world, "rank": rank, "params": params}
            got = _measured(method, widths, world, rank, batch_size)
            row["local_params"] = got.pop("local_params")
            sources = [("", got), ("formula_", formula_bytes(method, shapes, world, rank))]
            if plan:
                sources.append(("plan_", _planned(method, widths, world, rank, batch_size)))
            for prefix, sizes in sources:
                if not prefix:
                    row.update({f"{k}_bytes": v for k, v in sizes.items()})
                row[f"{prefix}bytes_per_param"] = sum(sizes.values()) / params
                row[f"{prefix}state_bytes_per_param"] = sizes["state"] / params
            row["measured_over_formula"] = row["bytes_per_param"] / row["formula_bytes_per_param"]
            if plan:
                row["measured_over_plan"] = row["bytes_per_param"] / row["plan_bytes_per_param"]
            rows.append(row)
    return pd.DataFrame(rows)


def plot_sharded_bytes(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Per-rank bytes per parameter against world size, one colour per method: measured (line), predicted
    by the formula (open circles) and by CalcGraph's plan (crosses, where planned); the optimizer state alone
    on the right."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    panels = (("bytes_per_param", "parameters + gradients + optimizer state"),
              ("state_bytes_per_param", "optimizer state"))
    for ax, (column, title) in zip(axes, panels, strict=True):
        for i, (method, part) in enumerate(df.groupby("method", sort=False)):
            part = part.sort_values("world_size")
            colour = f"C{i}"
            ax.plot(part["world_size"], part[column], "-s", color=colour, label=f"{method}: measured")
            ax.plot(part["world_size"], part[f"formula_{column}"], "o", mfc="none", ms=10, color=colour,
                    label=f"{method}: formula")
            if f"plan_{column}" in part:
                ax.plot(part["world_size"], part[f"plan_{column}"], "x", ms=9, color=colour,
                        label=f"{method}: CalcGraph plan")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(df["world_size"].unique()), labels=[str(w) for w in sorted(df["world_size"].unique())])
        ax.set_xlabel("world size (FSDP2 ranks)")
        ax.set_ylabel("bytes per model parameter, on one rank")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Per-rank memory under FSDP2 (rank {int(df['rank'].iloc[0])}, "
                 f"{int(df['params'].iloc[0]):,} parameters)" + (f"\n{scale}" if scale else ""))
    if note:
        fig.suptitle(f"{fig.get_suptitle()} [{note}]", color="C3", fontsize=10)
    fig.tight_layout()
    return fig
