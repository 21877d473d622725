"""A held-out zoo of small networks on which CalcGraph's plan is judged against the allocator.

Support for Sections 3.2 and 4.3 of "CalcGraph: taming the high costs of deep learning using models
(2022)": memory known before execution. Each case is a tiny model (so that the whole zoo runs in seconds
on a CPU) exercising a different kind of kernel: attention, recurrent cells, BatchNorm, embeddings, dropout
and in-place ops, depthwise and grouped convolutions, upsampling, bfloat16 and three optimizers; and four
kinds of program users bring (issue 37): a checkpoint called inside forward, `nn.MultiheadAttention`
self-attention, a weight-tied causal decoder, a tagger that packs its sequences. `accuracy_table` plans
each (calibrated or not) and measures the same training program with `AllocatorMeter`, whose counting
shares nothing with the plan, at batches calibration never ran (`held_out`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from ..measure import AllocatorMeter
from .graph import CompiledGraph
from .plan import _user_rows, plan_training
from .tracker import Unplannable
from .program import training_program

__all__ = ["HELD_OUT_BATCHES", "ZOO", "ZooCase", "accuracy_table", "case_program", "measure_case", "plan_case"]

# NOTE: batch sizes that calibration never runs (it runs 1, 2, 4, 8, 32, checks 16 and 64, and doubles a
# check that misses), so that the table judges the calibrated plan where it predicts rather than where it
# was fitted
HELD_OUT_BATCHES = (3, 12, 40, 160)
ACCURACY_COLUMNS = ["model", "batch_size", "predicted", "allocator", "reserved", "error", "envelope",
                    "uncalibrated_predicted",
                    "uncalibrated_error", "margin", "held_out", "calibrated_at", "refused"]


@dataclass(frozen=True)
class ZooCase:
    """A model factory, its per-example input shape and how it trains: optimizer, input dtype, `loss`
    (cross-entropy on class indices by default) and `sample`, the user's own batch of integer inputs (whose
    rows make every batch: their values shape memory)."""

    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    optimizer: str = "adam"
    input_dtype: torch.dtype = torch.float32
    note: str = field(default="")
    loss: Callable | None = None
    sample: torch.Tensor | None = field(default=None, compare=False)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cell(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class _Attention(nn.Module):
    """Token embedding, one head of scaled dot-product attention, mean pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens):
        q, k, v = self.qkv(self.embed(tokens)).chunk(3, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(1))


class _InPlace(nn.Module):
    """Dropout and in-place activations and arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = F.relu(self.a(x), inplace=True)
        h = self.drop(h).mul_(0.5).add_(1.0)
        return self.b(F.relu_(h))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _cnn(*layers: nn.Module, channels: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), *layers, nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(channels, 10))


class _CheckpointInForward(nn.Module):
    """A convolutional block recomputed in backward (non-reentrant checkpoint with dropout inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.2),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(checkpoint(self.block, F.relu(self.stem(x)), use_reentrant=False).mean((2, 3)))


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 10)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        h = self.proj(x)
        return self.head((h + self.attn(h, h, h, need_weights=False)[0]).mean(1))


class _TiedDecoder(nn.Module):
    """Token and position embeddings, one causal pre-norm block, output projection tied to the embedding."""

    def __init__(self, vocab: int = 256, width: int = 32, context: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(context, width))
        self.ln1, self.ln2, self.ln = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.ln(x) @ self.tok.weight.t()


def _next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.repeat_interleave(logits.shape[1]))


class _PackedTagger(nn.Module):
    """Embedding, a bidirectional LSTM over the sequences packed to their lengths (token 0 pads), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens):
        packed = pack_padded_sequence(self.embed(tokens), (tokens != 0).sum(1).cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=tokens.shape[1])
        return self.head(out).mean(1)


def _padded_tokens(rows: int = 8, length: int = 20) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    return torch.randint(1, 100, (rows, length), generator=generator) * (torch.arange(length) < lengths[:, None])


ZOO: dict[str, ZooCase] = {
    "transformer encoder": ZooCase(_Encoder, (8, 16)),
    "lstm": ZooCase(lambda: _Recurrent(nn.LSTM), (12, 16)),
    "gru": ZooCase(lambda: _Recurrent(nn.GRU), (12, 16)),
    "batchnorm 1d": ZooCase(lambda: nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                                  nn.Linear(64, 10)), (32,)),
    "batchnorm 2d": ZooCase(lambda: _cnn(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                         nn.BatchNorm2d(8)), (3, 16, 16)),
    "embedding + sdpa": ZooCase(_Attention, (12,), input_dtype=torch.long),
    "dropout + in-place": ZooCase(_InPlace, (32,)),
    "depthwise conv": ZooCase(lambda: _cnn(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8)), (3, 16, 16)),
    "grouped conv": ZooCase(lambda: _cnn(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=4)), (3, 16, 16)),
    "upsampling": ZooCase(lambda: _cnn(nn.Upsample(scale_factor=2, mode="bilinear"), nn.ReLU(),
                                       nn.Upsample(scale_factor=2, mode="nearest")), (3, 8, 8)),
    "bf16 mlp": ZooCase(lambda: _mlp().to(torch.bfloat16), (32,), input_dtype=torch.bfloat16),
    "sgd momentum": ZooCase(_mlp, (32,), optimizer="sgd"),
    "adamw cnn": ZooCase(lambda: _cnn(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)), (3, 16, 16), optimizer="adamw"),
    "checkpoint in forward": ZooCase(_CheckpointInForward, (3, 16, 16)),
    "mha self-attention": ZooCase(_SelfAttention, (12, 16)),
    "tied decoder": ZooCase(_TiedDecoder, (16,), input_dtype=torch.long, loss=_next_token_loss),
    "packed bilstm": ZooCase(_PackedTagger, (20,), input_dtype=torch.long, sample=_padded_tokens(),
                             note="lengths from the batch: planned per batch size, calibrated at batch 1 alone"),
}


def plan_case(case: ZooCase, device: torch.device | str = "cpu") -> CompiledGraph:
    """`case` planned (not calibrated) on `device`: its own sample batch where it has one, its loss."""
    return plan_training(case.build, case.sample if case.sample is not None else case.shape, loss=case.loss,
                         optimizer=case.optimizer, input_dtype=case.input_dtype, calibrate=False, device=device)


def case_program(case: ZooCase, device: torch.device | str = "cpu") -> Callable[..., None]:
    """`case`'s training program on `device`, `program(batch_size, annotate=None)` (`training_program`; its own
    sample's rows where it has one)."""
    device = torch.device(device)
    batches = _user_rows(case.sample.to(device)) if case.sample is not None else None

    def program(batch_size: int, annotate=None) -> None:
        training_program(case.build, case.shape, batch_size, optimizer=case.optimizer, input_dtype=case.input_dtype,
                         loss=case.loss, make_batch=batches, device=device, annotate=annotate)
    return program


def measure_case(case: ZooCase, batch_size: int, device: torch.device | str = "cpu") -> AllocatorMeter:
    """One real run of `case`'s training program at `batch_size` under `AllocatorMeter` (read its peaks)."""
    gc.collect()  # garbage of an earlier run freed inside the meter would lower its count
    program = case_program(case, device)
    with AllocatorMeter(device) as meter:
        program(batch_size)
    return meter


def accuracy_table(
    cases: Mapping[str, ZooCase] | Iterable[str] | None = None, batch_sizes: Sequence[int] = HELD_OUT_BATCHES, *,
    calibrate: bool = True, device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Plan each case on `device` (calibrated against its allocator at small batches, or not) and judge its
    predicted peak against `AllocatorMeter` over a real run of the same training program there.

    Rows: model, batch_size, predicted, allocator (bytes), error = (predicted - allocator) / allocator,
    envelope (bytes of the prediction that cover alignments not run at this batch: `CompiledGraph.envelope_bytes`),
    uncalibrated_predicted and uncalibrated_error (the fake-tensor plan alone), margin (the default
    margin `max_batch_size` would use), held_out (calibration neither ran nor checked that batch: only
    there does the error judge a prediction) and calibrated_at (the batches it ran). A plan that is not
    affine in the batch size (packed sequences) is traced at each batch and calibrated at batch 1 alone. `cases`: names
    in `ZOO`, a mapping of `ZooCase`, or all of ZOO. A batch the real step refuses (BatchNorm1d at 1) has
    allocator and error NaN. On CUDA the allocator is `max_memory_allocated` relative to the step's start, and
    `reserved` the caching allocator's `max_memory_reserved` (absolute); NaN on CPU. A case the planner refuses
    for cuDNN's RNN kernels (`Unplannable`) has a row per batch with the reason (`refused`), then rows of the
    same case planned and run without cuDNN, named "<case> (cuDNN off)".
    """
    if cases is None:
        cases = ZOO
    elif not isinstance(cases, Mapping):
        unknown = [name for name in cases if name not in ZOO]
        if unknown:
            raise ValueError(f"unknown zoo cases {unknown}; known: {sorted(ZOO)}")
        cases = {name: ZOO[name] for name in cases}
    rows, device = [], torch.device(device)
    for name, case in cases.items():
        try:
            rows += _case_rows(name, case, batch_sizes, calibrate, device)
        except Unplannable as refused:  # cuDNN's RNN kernels: planned and run without them, as the refusal says
            rows += [{"model": name, "batch_size": int(b), "refused": str(refused)} for b in batch_sizes]
            with torch.backends.cudnn.flags(enabled=False):
                rows += _case_rows(f"{name} (cuDNN off)", case, batch_sizes, calibrate, device)
    return pd.DataFrame(rows, columns=ACCURACY_COLUMNS)


def _case_rows(name: str, case: ZooCase, batch_sizes: Sequence[int], calibrate: bool,
               device: torch.device) -> list[dict]:
    graph = plan_case(case, device)
    raw = {int(b): graph.required_bytes(int(b)) for b in batch_sizes}
    if calibrate:  # a plan not affine in the batch size: at batch 1 alone
        graph.calibrate()
    elif device.type == "cuda":  # cuBLAS's workspaces come with the first step and live on (as calibrating)
        measure_case(case, min(batch_sizes), device)
    seen, rows = graph.calibrated_batches, []
    for b, plain in raw.items():
        try:
            meter = measure_case(case, b, device)
            real, reserved = meter.peak_bytes, meter.reserved_peak_bytes
        except (RuntimeError, ValueError):  # e.g. BatchNorm1d cannot train on a batch of one
            real = reserved = float("nan")
        predicted = graph.required_bytes(b)
        rows.append({"model": name, "batch_size": b, "predicted": predicted, "allocator": real,
                     "reserved": float("nan") if reserved is None else reserved,
                     "error": (predicted - real) / real, "envelope": graph.envelope_bytes(b),
                     "uncalibrated_predicted": plain,
                     "uncalibrated_error": (plain - real) / real, "margin": graph.default_margin,
                     "held_out": b not in seen, "calibrated_at": ", ".join(map(str, seen))})
    return rows
