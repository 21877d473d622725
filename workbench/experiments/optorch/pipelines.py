"""OpTorch pipelines: switches ``encode``, ``mixed_precision`` and ``checkpoint`` on a baseline.

Paper: Ahmed & Naveed, "OpTorch" (arXiv 2105.00619), Sec. III: pipelines B (baseline), E-D
(parallel encoding-decoding, Sec. II-A-4), M-P (mixed precision, Sec. II-B-1), S-C (sequential
checkpoints, Sec. II-B-2) and the combinations E-D+S-C and E-D+M-P+S-C; Fig 8 (memory over one
ResNet-18 iteration), Fig 9 (time vs accuracy), Fig 10 (memory per pipeline per model),
Fig 11 (best checkpoint at the smallest layer). Plots live in ``workbench.experiments.optorch``.

Every experiment function returns a pandas DataFrame measured in the same run as its baseline.
Memory is ``workbench.measure.MemoryMeter`` peak bytes of one training step (forward, loss,
backward) with parameter gradients preallocated before the region, so the figure is the
activation peak (plus the input batch and transient per-layer weight gradients).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from workbench.checkpoint import CheckpointPlan, evaluate_plan, plan_checkpoints, profile_layers, sc
from workbench.data import ImageSet, make_loader, normalize
from workbench.data.encode import DecodeLayer, encode
from workbench.data.prefetch import PrefetchLoader, ShuffledBatchSampler
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models.resnet import RESNETS, ResNet
from workbench.train import train

__all__ = [
    "PIPELINES",
    "Pipeline",
    "autoencoder",
    "build_model",
    "experiment_checkpoint_position",
    "experiment_pipeline_memory",
    "experiment_planner_pareto",
    "experiment_sc_resnet",
    "experiment_time_accuracy",
    "measure_step",
    "prepare",
]


@dataclass(frozen=True)
class Pipeline:
    """The three OpTorch switches; ``name`` is the paper's label."""

    encode: bool = False
    mixed_precision: bool = False
    checkpoint: bool = False

    @property
    def name(self) -> str:
        parts = [p for p, on in (("E-D", self.encode), ("M-P", self.mixed_precision),
                                 ("S-C", self.checkpoint)) if on]
        return "+".join(parts) or "B"


PIPELINES = {p.name: p for p in (
    Pipeline(), Pipeline(encode=True), Pipeline(mixed_precision=True), Pipeline(checkpoint=True),
    Pipeline(encode=True, checkpoint=True), Pipeline(True, True, True),
)}

def build_model(name: str, *, num_classes: int = 10, in_channels: int = 3, width: int = 64,
                stem: str = "cifar") -> ResNet:
    """A ResNet from ``workbench.models``; ``width`` < 64 gives a narrow copy for CPU runs."""
    if name not in RESNETS:
        raise ValueError(f"model must be one of {sorted(RESNETS)}, got {name!r}")
    return RESNETS[name](num_classes, stem=stem, in_channels=in_channels, width=width)


def autoencoder(widths: Sequence[int] = (256, 128, 64, 8, 64, 128, 256, 256)) -> nn.Sequential:
    """Fig 11's 7-layer net: one child per layer (Linear + ReLU), a bottleneck in the middle."""
    if len(widths) < 3:
        raise ValueError(f"need at least 3 widths, got {list(widths)}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.ReLU())
                           for a, b in zip(widths[:-1], widths[1:], strict=True)])


def _autocast_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def prepare(
    model: nn.Module, pipeline: Pipeline, *, device: torch.device | str, segments: int | None = None,
    strategy: str = "uniform", sample: torch.Tensor | None = None,
) -> tuple[nn.Module, torch.dtype | None, torch.amp.GradScaler | None]:
    """Apply a pipeline's switches: (model to train, autocast dtype, grad scaler).

    S-C wraps the model with :func:`workbench.checkpoint.sc`; E-D puts a
    :class:`~workbench.data.encode.DecodeLayer` in front (inputs arrive encoded); M-P is
    ``torch.autocast`` (bf16 on CPU, fp16 with a GradScaler on CUDA).
    """
    device = torch.device(device)
    model = model.to(device)
    if pipeline.checkpoint:
        model = sc(model, segments, strategy=strategy, sample=sample)
    if pipeline.encode:
        model = nn.Sequential(DecodeLayer(), model)
    dtype = _autocast_dtype(device) if pipeline.mixed_precision else None
    scaler = (torch.amp.GradScaler("cuda") if pipeline.mixed_precision and device.type == "cuda"
              else None)
    return model, dtype, scaler


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def measure_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, pipeline: Pipeline, *,
    device: torch.device | str, trace: bool = False, scheme: str = "int64",
) -> tuple[int, pd.DataFrame | None]:
    """Peak bytes of one training step of an already prepared model, from the host uint8
    batch: inside the region the batch crosses to the device (float32 for B, encoded for
    E-D, encoded on the host beforehand as the prefetch thread does) and trains one step."""
    device = torch.device(device)
    dtype = _autocast_dtype(device) if pipeline.mixed_precision else None
    host = encode(images, scheme=scheme) if pipeline.encode else normalize(images)
    labels = labels.to(device)
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    with MemoryMeter(device, trace=trace) as meter:
        with _autocast(device, dtype):
            loss = nn.functional.cross_entropy(model(host.to(device)), labels)
        loss.backward()
        del loss
    return meter.peak_bytes, meter.trace


def _batch(batch: int, image_size: int, *, channels: int = 3, classes: int = 10,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, channels, image_size, image_size), dtype=torch.uint8,
                           generator=g)
    return images, torch.randint(0, classes, (batch,), generator=g)


def experiment_sc_resnet(
    *, model: str = "resnet18", batch: int = 16, image_size: int = 32, width: int = 64,
    device: torch.device | str = "cpu", repeats: int = 3, seed: int = 0,
    strategies: Sequence[str] = ("uniform", "optimal"), stem: str = "cifar",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fig 8 and the S-C targets: baseline vs ``sc`` on one ResNet iteration.

    Returns (summary, trace): summary has one row per variant (B, then S-C per strategy with
    its default plan: uniform = round(sqrt(n)) segments, optimal = smallest peak) with
    peak_bytes, median_s, peak_ratio and time_ratio against B measured in the same run; trace
    is memory over time (columns variant, event, op, bytes, progress in [0, 1]).
    """
    device = torch.device(device)
    seed_everything(seed)
    net = build_model(model, width=width, stem=stem).to(device)
    images, labels = _batch(batch, image_size, seed=seed)
    sample = normalize(images).to(device)
    variants: dict[str, tuple[nn.Module, CheckpointPlan | None]] = {"B": (net, None)}
    for strategy in strategies:
        wrapped = sc(net, strategy=strategy, sample=sample)
        variants[f"S-C {strategy}"] = (wrapped, wrapped.plan)
    rows, traces = [], []
    for name, (m, plan) in variants.items():
        pipeline = Pipeline(checkpoint=plan is not None)
        peak, trace = measure_step(m, images, labels, pipeline, device=device, trace=True)
        traces.append(trace.assign(variant=name, progress=trace.event / max(len(trace) - 1, 1)))
        rows.append({"variant": name, "peak_bytes": peak,
                     "segments": None if plan is None else plan.num_segments,
                     "kept": None if plan is None else plan.kept,
                     "predicted_peak_bytes": None if plan is None else plan.predicted_peak_bytes})

    def step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(m(sample), labels.to(device)).backward()
        return run
    times = time_interleaved({k: step(m) for k, (m, _) in variants.items()}, repeats=repeats,
                               device=device)
    df = pd.DataFrame(rows)
    df["median_s"] = [statistics.median(times[v]) for v in df.variant]
    df["min_s"] = [min(times[v]) for v in df.variant]
    df["peak_ratio"] = df.peak_bytes / df.peak_bytes.iloc[0]
    # NOTE: the ratio uses the minimum of interleaved repeats, the figure least disturbed by
    # other processes on a shared machine; the median ratio is reported beside it.
    df["time_ratio"] = df.min_s / df.min_s.iloc[0]
    df["time_ratio_median"] = df.median_s / df.median_s.iloc[0]
    df = df.assign(model=model, batch=batch, image_size=image_size, width=width, stem=stem,
                   device=str(device))
    return df, pd.concat(traces, ignore_index=True)


def experiment_pipeline_memory(
    models: Sequence[str] = ("resnet18", "resnet34", "resnet50"), *, batch: int = 16,
    image_size: int = 32, width: int = 64, device: torch.device | str = "cpu",
    pipelines: Sequence[str] = tuple(PIPELINES), seed: int = 0, progress: bool = True,
    stem: str = "cifar",
) -> pd.DataFrame:
    """Fig 10: peak bytes of one training step per pipeline per model (ratio against B)."""
    device = torch.device(device)
    images, labels = _batch(batch, image_size, seed=seed)
    rows = []
    for model in tqdm(models, desc="models", disable=not progress, leave=False):
        for name in pipelines:
            seed_everything(seed)
            net = build_model(model, width=width, stem=stem)
            m, _, _ = prepare(net, PIPELINES[name], device=device)
            m.train()
            peak, _ = measure_step(m, images, labels, PIPELINES[name], device=device)
            rows.append({"model": model, "pipeline": name, "peak_bytes": peak})
    df = pd.DataFrame(rows)
    base = df[df.pipeline == "B"].set_index("model").peak_bytes
    df["ratio_vs_B"] = df.peak_bytes / df.model.map(base)
    return df.assign(batch=batch, image_size=image_size, width=width, device=str(device))


def experiment_time_accuracy(
    train_set: ImageSet, test_set: ImageSet, *, model: str = "resnet18", width: int = 64,
    pipelines: Sequence[str] = tuple(PIPELINES), epochs: int = 2, batch_size: int = 16,
    lr: float = 0.05, seed: int = 0, device: torch.device | str = "cpu", scheme: str = "int64",
    progress: bool = True,
) -> pd.DataFrame:
    """Fig 9: train each pipeline on the same data, seed and epochs; one row per epoch.

    B, M-P and S-C read a torch DataLoader of float batches; E-D pipelines read the
    PrefetchLoader, whose thread shuffles and encodes the next batches while training runs.
    Both draw the same batches. ``seconds``/``cum_seconds`` are wall-clock epoch times;
    ``robust_cum_seconds`` is the median step time times the steps, which a shared machine's
    load spikes distort less (the notebook plots it and states which it uses).
    """
    device = torch.device(device)
    c = train_set.images.shape[1]
    frames = []
    for name in tqdm(pipelines, desc="pipelines", disable=not progress, leave=False):
        pipeline = PIPELINES[name]
        seed_everything(seed)
        net = build_model(model, num_classes=train_set.num_classes, in_channels=c, width=width)
        m, dtype, scaler = prepare(net, pipeline, device=device)
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        test_loader = make_loader(test_set, 256, shuffle=False)
        # every pipeline sees the same batches in the same order (a function of seed, epoch)
        sampler = ShuffledBatchSampler(len(train_set), batch_size, seed=seed)
        if pipeline.encode:
            loader = PrefetchLoader(train_set, batch_size, batch_sampler=sampler, scheme=scheme,
                                    pin_memory=device.type == "cuda")
            test_loader = PrefetchLoader(test_set, 256, shuffle=False, scheme=scheme)
        else:
            loader = DataLoader(TensorDataset(normalize(train_set.images), train_set.labels),
                                batch_sampler=sampler, pin_memory=device.type == "cuda")
        stamps: list[float] = []

        def stamp(step: int, loss: float, stamps: list[float] = stamps) -> None:
            stamps.append(time.perf_counter())
        with contextlib.ExitStack() as stack:
            for ld in (loader, test_loader):
                if isinstance(ld, PrefetchLoader):
                    stack.callback(ld.close)
            start = time.perf_counter()
            df = train(m, loader, epochs=epochs, optimizer=opt, device=device,
                       test_loader=test_loader, autocast_dtype=dtype, grad_scaler=scaler,
                       progress=False, step_callback=stamp)
        steps = torch.diff(torch.tensor([start, *stamps], dtype=torch.float64))
        per_epoch = len(loader)
        median_step = float(steps.median())
        frames.append(df.assign(pipeline=name, cum_seconds=df.seconds.cumsum(),
                                median_step_s=median_step,
                                robust_cum_seconds=median_step * per_epoch * df.epoch))
    out = pd.concat(frames, ignore_index=True)
    return out.assign(model=model, width=width, batch_size=batch_size, device=str(device),
                      train_images=len(train_set))


def _measured_peak(model: nn.Module, plan: CheckpointPlan | None, x: torch.Tensor,
                   target: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> int:
    m = sc(model, 1)  # one plain segment: the baseline
    if plan is not None:
        m.plan = plan
    for p in m.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    with MemoryMeter(device) as meter:
        target(m(x)).backward()
    return meter.peak_bytes


def experiment_checkpoint_position(
    *, widths: Sequence[int] = (256, 128, 64, 8, 64, 128, 256, 256), batch: int = 2048,
    device: torch.device | str = "cpu", seed: int = 0,
) -> pd.DataFrame:
    """Fig 11: one checkpoint after each layer of the 7-layer autoencoder, measured.

    Rows: boundary (checkpoint after layer ``boundary - 1``; 0 = no checkpoint), the output
    bytes stored there, the measured and predicted peak, ``is_smallest`` for the bottleneck.
    """
    device = torch.device(device)
    seed_everything(seed)
    net = autoencoder(widths).to(device)
    x = torch.randn(batch, widths[0], device=device)
    prof = profile_layers(net, x)
    n = len(prof)
    smallest = min(range(n - 1), key=lambda i: prof.out_bytes[i]) + 1
    rows = []
    for e in range(0, n):
        segs = [(0, n, False)] if e == 0 else [(0, e, True), (e, n, False)]
        peak, rec = evaluate_plan(prof, segs)
        plan = CheckpointPlan("manual", segs, peak, rec)
        rows.append({"boundary": e, "stored_bytes": prof.out_bytes[e - 1] if e else 0,
                     "stored_width": widths[e] if e else None,
                     "measured_peak_bytes": _measured_peak(net, plan, x, lambda y: y.square().mean(),
                                                           device),
                     "predicted_peak_bytes": peak, "is_smallest": e == smallest})
    return pd.DataFrame(rows).assign(batch=batch, device=str(device))


def experiment_planner_pareto(
    *, model: str = "resnet18", batch: int = 16, image_size: int = 32, width: int = 64,
    budgets: int = 6, device: torch.device | str = "cpu", repeats: int = 3, seed: int = 0,
    progress: bool = True, stem: str = "cifar",
) -> pd.DataFrame:
    """Memory-time front of the three planning strategies on one ResNet at shared budgets.

    Budgets are spaced between the minimum achievable and the baseline predicted peak; each
    strategy plans under each budget (NaN where it has no plan), then every distinct plan is
    measured: peak (MemoryMeter) and step time (interleaved medians).
    """
    device = torch.device(device)
    seed_everything(seed)
    net = build_model(model, width=width, stem=stem).to(device)
    images, labels = _batch(batch, image_size, seed=seed)
    x, y = normalize(images).to(device), labels.to(device)
    prof = profile_layers(net, x)
    n = len(prof)
    lo = plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes
    hi = evaluate_plan(prof, [(0, n, False)])[0]
    grid = [int(lo + (hi - lo) * i / max(budgets - 1, 1)) for i in range(budgets)]
    rows, plans = [], {}
    for budget in grid:
        for strategy in ("uniform", "smallest", "optimal"):
            try:
                plan = plan_checkpoints(prof, memory_budget=budget, strategy=strategy)
            except ValueError:
                rows.append({"budget_bytes": budget, "strategy": strategy, "plan": None})
                continue
            key = tuple(plan.segments)
            plans[key] = plan
            rows.append({"budget_bytes": budget, "strategy": strategy, "plan": key,
                         "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "predicted_recompute_s": plan.predicted_recompute_s,
                         "segments": plan.num_segments})
    measured: dict[tuple, dict] = {}

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    for key, plan in tqdm(plans.items(), desc="plans", disable=not progress, leave=False):
        measured[key] = {"measured_peak_bytes": _measured_peak(net, plan, x, loss, device)}
    wrapped = {}
    for key, plan in plans.items():
        w = sc(net, 1)
        w.plan = plan
        wrapped[key] = w

    def step(m: nn.Module) -> Callable[[], None]:
        return lambda: loss(m(x)).backward()
    times = time_interleaved({str(k): step(w) for k, w in wrapped.items()}, repeats=repeats,
                               device=device)
    for key in plans:
        measured[key]["median_s"] = statistics.median(times[str(key)])
        measured[key]["min_s"] = min(times[str(key)])
    df = pd.DataFrame(rows)
    for col in ("measured_peak_bytes", "median_s", "min_s"):
        df[col] = [measured[k][col] if k is not None else math.nan for k in df.plan]
    df["plan"] = df.plan.map(lambda k: None if k is None else [list(s) for s in k])
    return df.assign(model=model, batch=batch, image_size=image_size, width=width,
                     device=str(device))
