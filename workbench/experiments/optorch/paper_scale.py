"""OpTorch's memory claims at the paper's own sizes, planned: Fig 10 (16 images 512x512x3 per pipeline per model)
and Fig 8 (one ResNet-18 iteration, B against its best checkpoint plan), on any machine.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited environments" (2021),
Figs 8 and 10. A CPU cannot run a ResNet-50 step on 16 images of 512x512 in a report's minutes, and at the sizes it
can run the claims change sign (mixed precision's weight copies outweigh 16x16 activations). So the very step the
notebook measures (``pipelines.step_region``: the batch crosses to the device, forward and loss, backward) is
planned by CalcGraph's model compiler (``workbench.calcgraph.CompiledGraph``: the program traced under fake
tensors, no memory allocated, sizes fitted affine in the batch) at the paper's model, input size and batch. The
plan counts tensors (the paper's plan, uncalibrated: kernel scratch is not in it); how far that is from the
allocator's own count is measured on the same model and pipelines at a size that runs here (`plan_check`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from tqdm.auto import tqdm

from workbench.calcgraph import CompiledGraph
from workbench.checkpoint import CheckpointPlan, plan_checkpoints, profile_layers, sc
from workbench.devices import seed_everything
from workbench.models import build

from .pipelines import PIPELINES, Pipeline, _batch, host_batch, metered_step, prepare, step_region

__all__ = ["PLANNER", "experiment_paper_scale", "experiment_planned_memory", "experiment_planned_sc", "plan_check",
           "planned_step_peak"]

PLANNER = "CalcGraph plan (fake tensors, uncalibrated: tensors only)"
_MARK = "measured region"


def _program(model: str, pipeline: Pipeline, *, image_size: int, width: float, stem: str,
             plan: CheckpointPlan | None, device: torch.device):
    """CalcGraph's training program of one Fig 10 step: `program(batch, tracker)`."""
    def program(size: int, tracker) -> None:
        # NOTE: built on the meta device outside the fake mode, then materialised as fake tensors: under fake
        # tensors torch refuses, at random, to swap a parameter the tracker watches (as calcgraph.program does)
        with unset_fake_temporarily(), torch.device("meta"):
            net = build(model, width=width, stem=stem)
        net = net.to_empty(device=device)
        if plan is None:
            m, _, _ = prepare(net, pipeline, device=device)
        else:
            m = sc(net, 1)
            m.plan = plan
        m.train()
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        images = torch.zeros(size, 3, image_size, image_size, dtype=torch.uint8, device=device)
        host, labels = host_batch(images, torch.zeros(size, dtype=torch.long), pipeline, device=device)
        tracker.mark(_MARK)
        step_region(m, host, labels, pipeline, device=device)
        tracker.mark("end")
    return program


def planned_step_peak(
    model: str, pipeline: str, *, batch: int, image_size: int, width: float = 1.0, stem: str = "imagenet",
    plan: CheckpointPlan | None = None, like: CompiledGraph | None = None, device: torch.device | str = "cpu",
) -> tuple[int, CompiledGraph]:
    """The planned peak bytes of one step's measured region (as ``measure_step`` counts it: tensors made inside it,
    the input batch's crossing included) and the plan. ``plan``: a checkpoint plan run by ``sc`` instead of the
    pipeline's; ``like``: the plan of the same step without checkpoints, whose growth a checkpointed variant
    borrows (traced once instead of twice, see ``calcgraph.derive``)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {list(PIPELINES)}, got {pipeline!r}")
    device = torch.device(device)
    graph = CompiledGraph(_program(model, PIPELINES[pipeline], image_size=image_size, width=width, stem=stem,
                                   plan=plan, device=device),
                          device=device, trace_sizes=(2, 3), like=like,
                          description=f"{model} {pipeline} {image_size}x{image_size}")
    frame, timeline = graph.variables(batch), graph.timeline(batch)
    start = int(frame.loc[frame.phase == _MARK, "born"].min())
    before = int(timeline[start - 1]) if start else 0
    return int(timeline[start:].max()) - before, graph


def experiment_planned_memory(
    models: Sequence[str] = ("resnet50",), pipelines: Sequence[str] = ("B", "E-D", "M-P", "S-C", "E-D+S-C", "M-P+S-C"),
    *, batch: int = 16, image_size: int = 512, width: float = 1.0, stem: str = "imagenet",
    device: torch.device | str = "cpu", progress: bool = False,
) -> pd.DataFrame:
    """Fig 10 planned: the peak of one step per pipeline per model (``planned_peak_bytes``, ratio against B's plan).

    ``B`` is always planned (the ratios' baseline). Planned on ``device`` (CPU: M-P is bf16 autocast; the paper's
    fp16 on a GPU has the same element size)."""
    names = ["B", *[p for p in dict.fromkeys(pipelines) if p != "B"]]
    rows: list[dict] = []
    if not models:
        return pd.DataFrame()
    for model in tqdm(models, desc="planned models", disable=not progress, leave=False):
        plain: dict[tuple[bool, bool], CompiledGraph] = {}
        for name in names:
            pipe = PIPELINES[name]
            like = plain.get((pipe.encode, pipe.mixed_precision)) if pipe.checkpoint else None
            peak, graph = planned_step_peak(model, name, batch=batch, image_size=image_size, width=width, stem=stem,
                                            like=like, device=device)
            if not pipe.checkpoint:
                plain[(pipe.encode, pipe.mixed_precision)] = graph
            rows.append({"model": model, "pipeline": name, "planned_peak_bytes": peak, "affine": graph.affine})
    df = pd.DataFrame(rows)
    base = df[df.pipeline == "B"].set_index("model").planned_peak_bytes
    df["ratio_vs_B"] = df.planned_peak_bytes / df.model.map(base)
    return df.assign(batch=batch, image_size=image_size, width=width, stem=stem, device=str(device), planner=PLANNER)


def plan_check(measured: pd.DataFrame, planned: pd.DataFrame) -> pd.DataFrame:
    """Plans against real steps of the same model and pipeline at the same size: the allocator's peak
    (``allocator_peak_bytes``, the independent count) and the tensor meter's, and the ratios against B of each.
    ``ratio_error``: planned ratio / the allocator's ratio - 1 (what a verdict on a ratio reads)."""
    keys = ["model", "pipeline", "batch", "image_size", "width", "stem"]
    if planned.empty or "allocator_peak_bytes" not in measured:
        return pd.DataFrame()
    cols = ["peak_bytes", "allocator_peak_bytes", "ratio_vs_B"]
    both = planned.merge(measured[keys + cols], on=keys, suffixes=("", "_measured"))
    base = both[both.pipeline == "B"].set_index("model").allocator_peak_bytes
    both["allocator_ratio"] = both.allocator_peak_bytes / both.model.map(base)
    both["error_vs_allocator"] = both.planned_peak_bytes / both.allocator_peak_bytes - 1
    both["error_vs_meter"] = both.planned_peak_bytes / both.peak_bytes - 1
    both["ratio_error"] = both.ratio_vs_B / both.allocator_ratio - 1
    return both.rename(columns={"ratio_vs_B": "planned_ratio", "ratio_vs_B_measured": "meter_ratio"})[
        keys + ["planned_peak_bytes", "peak_bytes", "allocator_peak_bytes", "error_vs_meter", "error_vs_allocator",
                "planned_ratio", "meter_ratio", "allocator_ratio", "ratio_error"]]


def experiment_planned_sc(
    model: str = "resnet18", *, batch: int = 16, image_size: int = 512, here_batch: int = 16,
    here_image_size: int = 64, width: float = 1.0, stem: str = "imagenet", budgets: int = 0, seed: int = 0,
    device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Fig 8 planned: B against the best checkpoint plan (units inside blocks) at the paper's size, and the same
    two steps at a size that runs here, where they also run under the tensor meter and the allocator.

    The optimal planner needs a real per-unit profile (``profile_layers`` runs real steps), so its plans are made
    on a profile at the size that runs here: its least-peak plan and its plans under ``budgets`` budgets up to B's
    peak. Each is planned at the paper's size and the least planned peak is kept (an upper bound of the least peak
    any plan reaches there). Rows: ``size`` ("paper" or "here"), ``variant`` (B, S-C optimal), the planned peak and
    its ratio against B's; at "here" the meters' peaks and ratios and ``ratio_error`` (planned / allocator ratio
    - 1); ``candidates``: the plans tried."""
    device = torch.device(device)
    seed_everything(seed)
    net = build(model, width=width, stem=stem).to(device)
    images, labels = _batch(here_batch, here_image_size, seed=seed)
    sample, y = host_batch(images, labels, Pipeline(), device=device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)
    prof = profile_layers(net, sample, loss_fn=loss, repeats=1)
    least = plan_checkpoints(prof, strategy="optimal")
    top = plan_checkpoints(prof, segments=1).predicted_peak_bytes
    plans = {tuple(least.segments): least}
    for i in range(1, budgets + 1):
        budget = int(least.predicted_peak_bytes + (top - least.predicted_peak_bytes) * i / (budgets + 1))
        found = plan_checkpoints(prof, memory_budget=budget, strategy="optimal")
        plans.setdefault(tuple(found.segments), found)
    sizes = {"paper": (batch, image_size), "here": (here_batch, here_image_size)}
    base, plain = {}, {}
    for size, (b, px) in sizes.items():
        base[size], plain[size] = planned_step_peak(model, "B", batch=b, image_size=px, width=width, stem=stem,
                                                    device=device)
    tried = {key: planned_step_peak(model, "S-C", batch=batch, image_size=image_size, width=width, stem=stem,
                                    plan=p, like=plain["paper"], device=device)[0] for key, p in plans.items()}
    best = min(tried, key=tried.get)
    here, _ = planned_step_peak(model, "S-C", batch=here_batch, image_size=here_image_size, width=width, stem=stem,
                                plan=plans[best], like=plain["here"], device=device)
    measured = {}
    for variant, m in (("B", net), ("S-C optimal", sc(net, 1))):
        if variant != "B":
            m.plan = plans[best]
        meter = metered_step(m, images, labels, Pipeline(checkpoint=variant != "B"), device=device, allocator=True)
        measured[variant] = (meter.peak_bytes, meter.allocator_peak_bytes)
    rows = []
    for size, peaks in (("paper", (base["paper"], tried[best])), ("here", (base["here"], here))):
        for variant, peak in zip(("B", "S-C optimal"), peaks, strict=True):
            meter, allocator = measured[variant] if size == "here" else (None, None)
            rows.append({"size": size, "variant": variant, "batch": sizes[size][0], "image_size": sizes[size][1],
                         "planned_peak_bytes": peak, "planned_ratio": peak / peaks[0], "peak_bytes": meter,
                         "allocator_peak_bytes": allocator,
                         "allocator_ratio": None if allocator is None else allocator / measured["B"][1]})
    df = pd.DataFrame(rows)
    df["ratio_error"] = df.planned_ratio / df.allocator_ratio.astype(float) - 1
    return df.assign(model=model, width=width, stem=stem, device=str(device), planner=PLANNER,
                     plan=str([list(s) for s in best]), candidates=len(plans),
                     profiled_at=f"{here_batch} images {here_image_size}x{here_image_size}")


def experiment_paper_scale(
    measured: pd.DataFrame, models: Sequence[str], pipelines: Sequence[str], *, batch: int = 16,
    image_size: int = 512, fig8_model: str | None = "resnet18", here_batch: int = 16, here_image_size: int = 64,
    seed: int = 0, progress: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The notebook's paper-scale plans: (Fig 10 planned at ``batch`` x ``image_size`` with the ImageNet stem at
    width 1, the published nets; the same programs planned at the size of ``measured`` (the real Fig 10 run, with
    its allocator peaks) and checked against it (`plan_check`); Fig 8 planned, `experiment_planned_sc`, or an empty
    frame where ``fig8_model`` is None). Empty frames where ``models`` is empty."""
    planned = experiment_planned_memory(models, pipelines, batch=batch, image_size=image_size, progress=progress)
    check = pd.DataFrame()
    if models and len(measured):
        r = measured.iloc[0]
        here = experiment_planned_memory(
            [m for m in models if m in set(measured.model)], pipelines, batch=int(r.batch),
            image_size=int(r.image_size), width=float(r.width), stem=str(r.stem), progress=progress)
        check = plan_check(measured, here)
    fig8 = pd.DataFrame() if fig8_model is None else experiment_planned_sc(
        fig8_model, batch=batch, image_size=image_size, here_batch=here_batch, here_image_size=here_image_size,
        seed=seed)
    return planned, check, fig8
