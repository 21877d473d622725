"""OpTorch pipelines: switches ``encode``, ``mixed_precision`` and ``checkpoint`` on a baseline.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. III: pipelines B (baseline), E-D (parallel encoding-decoding,
Sec. II-A-4), M-P (mixed precision, Sec. II-B-1), S-C (sequential checkpoints, Sec. II-B-2) and
the combinations E-D+S-C, M-P+S-C and E-D+M-P+S-C; Fig 9 (time vs accuracy) and Fig 10 (memory
per pipeline per model). The checkpoint-planning experiments (Figs 8 and 11, the planner front,
the unit floor) live in ``planning``, the data-flow experiments (encoding capacity, selective
batch sampling, loaders) in ``dataflow``, torch's own activation-memory budget in ``peers``.

Networks come from :func:`workbench.models.build` (``width`` is its channel multiplier). Every
experiment function returns a pandas DataFrame measured in the same run as its baseline.
Memory is ``workbench.measure.MemoryMeter`` peak bytes of one training step (forward, loss,
backward) with parameter gradients preallocated before the region. The batch crosses to the
device inside the region for every pipeline (float32 for B, encoded for E-D), so the input is
counted alike: the figure is activations plus the input batch plus transient weight gradients.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.checkpoint import sc
from workbench.data import ImageSet, make_loader, normalize
from workbench.data.encode import DecodeLayer, encode
from workbench.data.prefetch import PrefetchLoader, ShuffledBatchSampler
from workbench.data.sampling import ClassImageAugmenter, FlipCrop
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter
from workbench.models import build
from workbench.train import train

__all__ = [
    "PIPELINES",
    "accuracy_over_seeds",
    "Pipeline",
    "autoencoder",
    "experiment_pipeline_memory",
    "experiment_time_accuracy",
    "host_batch",
    "measure_step",
    "metered_step",
    "prepare",
    "step_region",
    "time_accuracy_summary",
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
    Pipeline(encode=True, checkpoint=True), Pipeline(mixed_precision=True, checkpoint=True),
    Pipeline(True, True, True),
)}

def autoencoder(widths: Sequence[int] = (256, 128, 64, 8, 64, 128, 256, 256)) -> nn.Sequential:
    """Fig 11's 7-layer net: one child per layer (Linear + ReLU), a bottleneck in the middle."""
    if len(widths) < 3:
        raise ValueError(f"need at least 3 widths, got {list(widths)}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.ReLU())
                           for a, b in zip(widths[:-1], widths[1:], strict=True)])


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device` ("cuda" without an index: any CUDA device)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


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
    # NOTE: moved only where a tensor lives elsewhere: under fake tensors (the paper-scale plans, `paper_scale`)
    # torch refuses, at random, to swap a parameter the planner's tracker watches, and moving to where it is
    # changes nothing
    if any(not _on(t, device) for t in [*model.parameters(), *model.buffers()]):
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
    batch. The host prepares the batch before the region (float32 for B, as a DataLoader does;
    encoded for E-D, as the prefetch thread does); inside the region the batch crosses to the
    device and one step trains.

    # NOTE: the crossing is a real copy on every device (``copy=True``), so the batch the device
    # holds is counted for B and E-D alike. Without it a CPU run counted E-D's decoded float
    # batch but never B's, and E-D looked smaller by exactly one float batch.
    """
    meter = metered_step(model, images, labels, pipeline, device=device, trace=trace, scheme=scheme)
    return meter.peak_bytes, meter.trace


def metered_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, pipeline: Pipeline, *,
    device: torch.device | str, trace: bool = False, allocator: bool = False, scheme: str = "int64",
) -> MemoryMeter:
    """:func:`measure_step`'s meter (``allocator``: with the allocator's own peak beside the tensors')."""
    device = torch.device(device)
    host, labels = host_batch(images, labels, pipeline, device=device, scheme=scheme)
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    with MemoryMeter(device, trace=trace, allocator=allocator) as meter:
        step_region(model, host, labels, pipeline, device=device)
    return meter


def host_batch(images: torch.Tensor, labels: torch.Tensor, pipeline: Pipeline, *, device: torch.device,
               scheme: str = "int64") -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as the host hands it over (float32 for B, encoded for E-D) and the labels on the device."""
    return (encode(images, scheme=scheme) if pipeline.encode else normalize(images)), labels.to(device)


def step_region(model: nn.Module, host: torch.Tensor, labels: torch.Tensor, pipeline: Pipeline, *,
                device: torch.device) -> None:
    """The measured region of one step: the batch crosses to the device, forward and loss (under autocast for
    M-P), backward. The same code runs for real under a meter and under fake tensors in the paper-scale plans."""
    dtype = _autocast_dtype(device) if pipeline.mixed_precision else None
    x = host.to(device, copy=True)
    with _autocast(device, dtype):
        loss = nn.functional.cross_entropy(model(x), labels)
    del x
    loss.backward()
    del loss


def _batch(batch: int, image_size: int, *, channels: int = 3, classes: int = 10,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, channels, image_size, image_size), dtype=torch.uint8,
                           generator=g)
    return images, torch.randint(0, classes, (batch,), generator=g)


def experiment_pipeline_memory(
    models: Sequence[str] = ("resnet18", "resnet34", "resnet50"), *, batch: int = 16,
    image_size: int = 32, width: float = 1.0, device: torch.device | str = "cpu",
    pipelines: Sequence[str] = tuple(PIPELINES), seed: int = 0, progress: bool = True,
    stem: str = "cifar", allocator: bool = False,
) -> pd.DataFrame:
    """Fig 10: peak bytes of one training step per pipeline per model (ratio against B).

    ``width`` is the channel multiplier of :func:`workbench.models.build` (1.0: the published net).
    ``allocator`` adds ``allocator_peak_bytes``: the same step's peak by the allocator's own count
    (``AllocatorMeter``, kernel scratch included), the independent check of the paper-scale plans.
    """
    device = torch.device(device)
    images, labels = _batch(batch, image_size, seed=seed)
    rows = []
    for model in tqdm(models, desc="models", disable=not progress, leave=False):
        for name in pipelines:
            seed_everything(seed)
            net = build(model, width=width, stem=stem)
            m, _, _ = prepare(net, PIPELINES[name], device=device)
            m.train()
            meter = metered_step(m, images, labels, PIPELINES[name], device=device, allocator=allocator)
            rows.append({"model": model, "pipeline": name, "peak_bytes": meter.peak_bytes,
                         **({"allocator_peak_bytes": meter.allocator_peak_bytes} if allocator else {})})
    df = pd.DataFrame(rows)
    base = df[df.pipeline == "B"].set_index("model").peak_bytes
    df["ratio_vs_B"] = df.peak_bytes / df.model.map(base)
    return df.assign(batch=batch, image_size=image_size, width=width, stem=stem, device=str(device))


class _TrainingThreadBatches:
    """Batches prepared in the training thread, one at a time: index, augment (uint8), normalise.

    The baseline's loader: the same per-batch work E-D's thread does (there: augment, encode),
    done where torch's DataLoader with ``num_workers=0`` does it, between training steps.
    """

    def __init__(self, data: ImageSet, sampler: ShuffledBatchSampler,
                 transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
                 pin_memory: bool = False) -> None:
        self.data, self.sampler, self.transform, self.pin_memory = data, sampler, transform, pin_memory

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for idx in self.sampler:
            idx = torch.as_tensor(idx)
            images, labels = self.data.images[idx], self.data.labels[idx]
            if self.transform is not None:
                images, labels = self.transform(images, labels)
            x = normalize(images)
            yield (x.pin_memory(), labels.pin_memory()) if self.pin_memory else (x, labels)


def experiment_time_accuracy(
    train_set: ImageSet, test_set: ImageSet, *, model: str = "resnet18", width: float = 1.0,
    pipelines: Sequence[str] = tuple(PIPELINES), epochs: int = 2, batch_size: int = 16,
    lr: float = 0.05, seed: int = 0, device: torch.device | str = "cpu", scheme: str = "int64",
    augment: bool = True, progress: bool = True,
) -> pd.DataFrame:
    """Fig 9: train each pipeline on the same data, seed, batches and augmentation; one row per epoch.

    Every pipeline prepares each batch from the uint8 images: index, augment (random flip and
    crop, ``augment``), then normalise (B, M-P, S-C: in the training thread, between steps) or
    encode (E-D pipelines: in the PrefetchLoader's thread, ahead of training; decoded on the
    device). The augmentation draws the same numbers in the same order for every pipeline, so
    exact encoding and exact recomputation leave training unchanged. ``seconds``/``cum_seconds``
    are wall-clock epoch times; ``robust_cum_seconds`` is the median step time times the steps,
    which a shared machine's load spikes distort less (the notebook plots it and states which).
    """
    device = torch.device(device)
    c = train_set.images.shape[1]
    frames = []
    for name in tqdm(pipelines, desc="pipelines", disable=not progress, leave=False):
        if name not in PIPELINES:
            raise ValueError(f"pipeline must be one of {list(PIPELINES)}, got {name!r}")
        pipeline = PIPELINES[name]
        seed_everything(seed)
        net = build(model, width=width, num_classes=train_set.num_classes, in_channels=c)
        m, dtype, scaler = prepare(net, pipeline, device=device)
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        test_loader = make_loader(test_set, 256, shuffle=False)
        # every pipeline sees the same batches in the same order (a function of seed, epoch)
        sampler = ShuffledBatchSampler(len(train_set), batch_size, seed=seed)
        transform = (ClassImageAugmenter({None: FlipCrop()}, train_set.num_classes, seed=seed)
                     if augment else None)
        if pipeline.encode:
            loader = PrefetchLoader(train_set, batch_size, batch_sampler=sampler, scheme=scheme,
                                    transform=transform, pin_memory=device.type == "cuda")
            test_loader = PrefetchLoader(test_set, 256, shuffle=False, scheme=scheme)
        else:
            loader = _TrainingThreadBatches(train_set, sampler, transform, pin_memory=device.type == "cuda")
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
                                min_step_s=float(steps.min()),
                                robust_cum_seconds=median_step * per_epoch * df.epoch))
    out = pd.concat(frames, ignore_index=True)
    return out.assign(model=model, width=width, batch_size=batch_size, device=str(device),
                      dataset=train_set.name, image_shape="x".join(map(str, train_set.images.shape[1:])),
                      train_images=len(train_set), test_images=len(test_set), augment=augment,
                      threads=torch.get_num_threads(), cores=os.cpu_count())


def time_accuracy_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Fig 9's last epoch per pipeline, with its training time against B's.

    ``time_ratio_vs_B`` is the ratio of ``robust_cum_seconds`` (median step time x steps: the time
    the paper plots, training for the given epochs); ``min_step_ratio_vs_B`` the ratio of the
    fastest steps, a second estimator that load spikes on a shared machine distort least.
    """
    last = df.sort_values("epoch", kind="stable").groupby("pipeline", sort=False).tail(1).set_index("pipeline")
    last = last.loc[[p for p in dict.fromkeys(df.pipeline) if p in last.index]]
    last["time_ratio_vs_B"] = last.robust_cum_seconds / last.loc["B", "robust_cum_seconds"]
    last["min_step_ratio_vs_B"] = last.min_step_s / last.loc["B", "min_step_s"]
    return last.reset_index()


def accuracy_over_seeds(
    main: pd.DataFrame, train_set: ImageSet, test_set: ImageSet, seeds: Sequence[int], *,
    pipelines: Sequence[str] = ("B", "M-P"), **kwargs,
) -> pd.DataFrame:
    """Fig 9's repeat noise: the last epoch's test accuracy of ``pipelines`` trained again with each of ``seeds``
    (weights, batch order and augmentation drawn anew; the same data), beside ``main``'s (one seed's
    :func:`experiment_time_accuracy`). Rows: seed, pipeline, test_acc. ``kwargs`` are main's settings."""
    main_seed = int(kwargs.pop("seed", 0))
    if main_seed in seeds:
        raise ValueError(f"seeds must differ from the main run's seed {main_seed}, got {list(seeds)}")
    kwargs["progress"] = False
    runs = [main[main.pipeline.isin(pipelines)].assign(seed=main_seed)]
    runs += [experiment_time_accuracy(train_set, test_set, pipelines=tuple(pipelines), seed=int(s), **kwargs)
             .assign(seed=int(s)) for s in seeds]
    last = pd.concat(runs, ignore_index=True).sort_values("epoch", kind="stable")
    last = last.groupby(["seed", "pipeline"], sort=False).tail(1)
    return last[["seed", "pipeline", "test_acc", "epoch"]].reset_index(drop=True)
