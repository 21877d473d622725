"""A peer beside our checkpoint planner: torch's own activation-memory budget under ``torch.compile``.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-B-2 (sequential checkpoints). Torch offers the same trade itself:
``torch._functorch.config.activation_memory_budget`` (a fraction in [0, 1] of the activation
memory the default partitioner saves) makes AOTAutograd's min-cut partitioner recompute
activations in the backward of a compiled training step. Here both run on one model at the same
fractions, side by side, each fraction spanning the method's own range (0: its most
memory-saving plan, 1: no recomputation): torch's compiled step under
``activation_memory_budget = fraction``; our ``optimal`` plan under the peak budget
``least + fraction x (baseline - least)``, least and baseline being the predicted peaks of our
minimum-peak plan and of no checkpoints.

# NOTE: ``fraction x`` the baseline's peak would leave our planner without plans below about 0.8
# on the autoencoder: its budget bounds the whole step (the backward's gradients and scratch
# included), torch's only the activations it saves, so equal raw numbers are not equal asks.

How memory is counted: ``workbench.measure.MemoryMeter`` is a dispatch mode and cannot see the
buffers a compiled graph allocates, so the figure compared is the bytes a step *retains* from
the forward for the backward (with the output and the loss), the term both methods trade
against recomputation. For a compiled step it is the distinct storages the compiled graph saves
for backward (seen by ``torch.autograd.graph.saved_tensors_hooks``, which a compiled graph's
saved tensors pass through) plus the output; for an eager step, MemoryMeter's live bytes right
after the loss (checkpointed segments keep their inputs outside the hooks' sight). Both methods
agree on the eager baseline, which every result table states. Our plans' whole-step peaks come
from MemoryMeter beside it; the compiled step's whole-step peak is not measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.checkpoint import evaluate_plan, plan_checkpoints, profile_layers, sc
from workbench.data import normalize
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models import build

from .pipelines import _batch, autoencoder

__all__ = ["experiment_peer", "hook_retained_bytes", "meter_retained_bytes", "peer_comparison"]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def hook_retained_bytes(step: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                        exclude: Sequence[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """(bytes of distinct storages saved for backward plus the output, the loss) of ``step()``,
    which runs a forward and returns (loss, output); storages of ``exclude`` (parameters, input)
    are not counted."""
    skip = {_key(t) for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _key(t) not in skip:
            kept[_key(t)] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, out = step()
    if _key(out) not in skip:
        kept[_key(out)] = out.untyped_storage().nbytes()
    return sum(kept.values()), loss


def meter_retained_bytes(step: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                         device: torch.device) -> tuple[int, int]:
    """(live bytes right after the forward and loss, peak bytes of the whole step), MemoryMeter."""
    with MemoryMeter(device) as meter:
        loss, out = step()
        retained = meter.current_bytes
        del out
        loss.backward()
        del loss
    return retained, meter.peak_bytes


def experiment_peer(
    *, model: str = "autoencoder", fractions: Sequence[float] = (1.0, 0.5, 0.25, 0.0),
    widths: Sequence[int] = (256, 128, 64, 8, 64, 128, 256, 256), batch: int = 2048,
    width: float = 0.25, image_size: int = 16, repeats: int = 3, seed: int = 0,
    device: torch.device | str = "cpu", backend: str = "inductor", progress: bool = True,
) -> pd.DataFrame:
    """Our planner and torch's activation-memory budget at the same fractions, side by side.

    One row per (method, fraction): retained_bytes (see the module docstring), peak_bytes
    (ours only; its budget is ``least + fraction x (baseline - least)`` predicted peak),
    step-time ratio against the eager baseline in paired interleaved rounds (min, median, and
    the spread over rounds), and for ours the plan's predicted peak. ``model`` is
    ``"autoencoder"`` (Fig 11's net, ``widths``, ``batch``) or a ResNet name (``width``, the channel
    multiplier of :func:`workbench.models.build`, ``image_size``, ``batch``); ``backend`` is
    torch.compile's.
    """
    for f in fractions:
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"fractions must lie in [0, 1], got {f}")
    device = torch.device(device)
    seed_everything(seed)
    if model == "autoencoder":
        net = autoencoder(widths).to(device)
        x = torch.randn(batch, widths[0], device=device)

        def loss_fn(out: torch.Tensor) -> torch.Tensor:
            return out.square().mean()
        scale = f"autoencoder {tuple(widths)}, batch {batch}"
    else:
        net = build(model, width=width).to(device)
        images, labels = _batch(batch, image_size, seed=seed)
        x, y = normalize(images).to(device), labels.to(device)

        def loss_fn(out: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out, y)
        scale = f"{model} width x{width:g}, {batch} images {image_size}x{image_size}"
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    exclude = [*net.parameters(), *net.buffers(), x]

    def forward(m: nn.Module) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            out = m(x)
            return loss_fn(out), out
        return run

    def train_step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            loss_fn(m(x)).backward()
        return run

    prof = profile_layers(net, x, loss_fn=loss_fn)
    base_predicted = evaluate_plan(prof, [(0, len(prof), False)])[0]
    lowest = plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes
    base_meter, base_peak = meter_retained_bytes(forward(net), device)
    base_hook, loss = hook_retained_bytes(forward(net), exclude)
    loss.backward()
    rows = []
    for f in tqdm(fractions, desc="budgets", disable=not progress, leave=False):
        budget = int(lowest + f * (base_predicted - lowest))
        row = {"method": "ours (optimal plan)", "fraction": f, "budget_bytes": budget}
        plan = plan_checkpoints(prof, memory_budget=budget, strategy="optimal")
        m = sc(net, 1)
        m.plan = plan
        retained, peak = meter_retained_bytes(forward(m), device)
        times = time_interleaved({"B": train_step(net), "x": train_step(m)}, repeats=repeats,
                                 device=device)
        rows.append({**row, "retained_bytes": retained, "peak_bytes": peak,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "segments": plan.num_segments,
                     **_ratios(times)})
        # NOTE: the budget is read when the graph is compiled, so each fraction compiles afresh.
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=float(f)):
            compiled = torch.compile(net, backend=backend)
            train_step(compiled)()  # compiles forward and backward under this budget
            retained, loss = hook_retained_bytes(forward(compiled), exclude)
            loss.backward()
            times = time_interleaved({"B": train_step(net), "x": train_step(compiled)}, repeats=repeats,
                                     device=device)
        rows.append({"method": f"torch.compile ({backend}) activation_memory_budget", "fraction": f,
                     "budget_bytes": None, "retained_bytes": retained, **_ratios(times)})
    torch._dynamo.reset()
    df = pd.DataFrame(rows)
    df["retained_ratio"] = df.retained_bytes / base_meter
    return df.assign(baseline_retained_bytes=base_meter, baseline_retained_bytes_hooks=base_hook,
                     baseline_peak_bytes=base_peak, scale=scale, device=str(device))


def _ratios(times: dict) -> dict[str, float]:
    rounds = [t / b for t, b in zip(times["x"], times["B"], strict=True)]
    return {"min_s": min(times["x"]), "time_ratio": min(times["x"]) / min(times["B"]),
            "time_ratio_median": statistics.median(times["x"]) / statistics.median(times["B"]),
            "time_ratio_lo": min(rounds), "time_ratio_hi": max(rounds)}


def peer_comparison(peer: pd.DataFrame) -> pd.DataFrame:
    """Ours against torch's at every fraction of :func:`experiment_peer` where both were measured.

    ``retained_ratio``: our retained bytes / torch's; ``time_ratio``: our step-time ratio against the
    eager baseline / torch's (each min over repeats), with ``time_ratio_lo``/``_hi`` the least and the
    most favourable pairing of the two methods' per-round spreads. Empty when the peer was not run.
    """
    columns = ["fraction", "retained_ratio", "time_ratio", "time_ratio_lo", "time_ratio_hi"]
    if peer is None or peer.empty:
        return pd.DataFrame(columns=columns)
    is_ours = peer.method.str.startswith("ours")
    ours, theirs = peer[is_ours].set_index("fraction"), peer[~is_ours].set_index("fraction")
    both = [f for f in ours.index if f in theirs.index and pd.notna(ours.retained_bytes[f])]
    return pd.DataFrame({
        "fraction": both,
        "retained_ratio": [ours.retained_bytes[f] / theirs.retained_bytes[f] for f in both],
        "time_ratio": [ours.time_ratio[f] / theirs.time_ratio[f] for f in both],
        "time_ratio_lo": [ours.time_ratio_lo[f] / theirs.time_ratio_hi[f] for f in both],
        "time_ratio_hi": [ours.time_ratio_hi[f] / theirs.time_ratio_lo[f] for f in both],
    }, columns=columns)
