"""Table 2 at the paper's architecture: the optimizer step fused into backward while fine-tuning flan-T5.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4 and Table 2: a
large flan-T5 fine-tuned on GLUE (MNLI, QNLI, MRPC; batch 16, 128 tokens, AdamW, lr 2e-5) with and
without the step fused into backward: peak memory 11% lower (29,930 -> 26,818 MB on MNLI, about the
3.1 GB of fp32 gradients of its 783M parameters), time 3-4% longer.

The model is transformers' ``T5ForSequenceClassification`` (what the Hugging Face text-classification
example builds for a T5 checkpoint: encoder and decoder over the same 128 tokens, a head on the last
<eos>), built from a configuration written here (`flan_t5_config`) with random weights: nothing is
downloaded. At ``d_model=1024, layers=24`` it has flan-T5 large's shape (16 heads of 64, gated-GELU
feed-forward of 2816, vocabulary 32128). Smaller settings scale it proportionally: heads ``d_model/64``,
feed-forward ``2.75 d_model``, vocabulary ``32128 * d_model/1024 * layers/24``, so that with the batch
scaled like ``d_model`` (16 at 1024) every ratio of activations to parameters is the paper's. transformers
is an optional dependency (the ``peers`` extra): without it `fused_backward` refuses with the install line.

A saving has a ceiling: the step in backward frees gradients, so it can lower the peak by at most the
gradient bytes live at the ordinary run's peak (``ceiling`` = those bytes / the peak). On CUDA each run
also records the device's used memory (`device_memory.used_memory`), the unit a GPU reports.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
from collections.abc import Iterable

import pandas as pd
import torch
from torch import nn

from workbench.measure import time_interleaved
from workbench.timing import kernel_seconds

from .device_memory import used_memory
from .peak_memory import measure_peak, parse_format
from .peer_import import import_peer
from .peers import FLASH, PeerUnavailable, peer_label, peer_peak, peer_step
from .step_times import _training_step, paired_ratio

__all__ = ["T5Classifier", "flan_t5_config", "fused_backward", "t5_available"]

_FLAN_T5_LARGE = {"d_model": 1024, "layers": 24, "vocab": 32128, "d_ff_per_d_model": 2.75}
_EOS, _PAD = 1, 0  # T5's token ids: </s> and <pad> (also the decoder's start token)


def t5_available() -> bool:
    """True when transformers (the model library Table 2's T5 comes from) is installed."""
    return importlib.util.find_spec("transformers") is not None


def flan_t5_config(d_model: int = 1024, layers: int = 24, *, classes: int = 2, dropout: float = 0.1):
    """A ``transformers.T5Config`` with flan-T5 large's shape at ``d_model=1024, layers=24`` (encoder and
    decoder layers each), scaled proportionally otherwise (see the module docstring)."""
    if not t5_available():
        raise ImportError("Table 2's T5 needs transformers: pip install transformers "
                          "(or the package's extra: pip install -e '.[peers]')")
    if d_model < 64 or d_model % 64:
        raise ValueError(f"d_model must be a multiple of 64 (heads of 64, as flan-T5's), got {d_model}")
    if layers < 1 or classes < 2:
        raise ValueError(f"need layers >= 1 and classes >= 2, got layers={layers}, classes={classes}")
    from transformers import T5Config

    scale = d_model / _FLAN_T5_LARGE["d_model"] * layers / _FLAN_T5_LARGE["layers"]
    return T5Config(
        vocab_size=max(16, round(_FLAN_T5_LARGE["vocab"] * scale)), d_model=d_model, d_kv=64,
        d_ff=round(_FLAN_T5_LARGE["d_ff_per_d_model"] * d_model), num_layers=layers, num_decoder_layers=layers,
        num_heads=d_model // 64, feed_forward_proj="gated-gelu", dropout_rate=dropout, num_labels=classes,
        tie_word_embeddings=False, use_cache=False, pad_token_id=_PAD, eos_token_id=_EOS,
        decoder_start_token_id=_PAD)


class T5Classifier(nn.Module):
    """``T5ForSequenceClassification`` of a config, called on token ids alone and returning the logits."""

    def __init__(self, config) -> None:
        super().__init__()
        # its module imported with torch's and torchao's import-time log lines held back (`import_peer`): transformers
        # imports torchao with it, which logs a deprecation in red in the notebook (issue 43)
        self.t5 = import_peer("transformers.models.t5.modeling_t5").T5ForSequenceClassification(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=tokens).logits


def _token_batches(vocab: int, batch: int, seq: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids (never <pad> or </s>) ending in one </s> per sequence, as the classifier's head needs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(2, vocab, (batch, seq), generator=gen)
        tokens[:, -1] = _EOS
        out.append((tokens, torch.randint(2, (batch,), generator=gen)))
    return out


def fused_backward(
    *, d_model: int = 1024, layers: int = 24, batch: int = 16, seq: int = 128, steps: int = 2, repeats: int = 3,
    optimizer: str = "adamw", lr: float = 2e-5, formats: Iterable[str] = ("fp32",), peers: Iterable[str] = (FLASH,),
    device: torch.device | str = "cpu", seed: int = 0, progress: bool = True,
) -> pd.DataFrame:
    """Table 2: peak memory and step time of T5 fine-tuning with and without the step in backward.

    Memory: ``steps`` metered steps each (fresh optimizer, state included), with the phase where the peak
    falls, the gradient bytes live there and, on CUDA, the device's used memory. ``ceiling``: the ordinary
    run's gradient bytes at its peak over its peak. Time: the two configurations' training steps
    interleaved round by round; ``time_ratio`` = median in-backward / median ordinary, ``time_ratio_lo``/
    ``_hi`` the paired per-round extremes; ``kernel_s``/``kernel_share`` the device time of one more step
    under the profiler and its share of ``step_s``.

    ``peers`` (`peers.PEER_METHODS`, default FlashOptim in its own format): each one's rows beside the formats', its
    weights in its own format and the step in backward its own way (FlashOptim's gradient release), its ratios
    against its own ordinary run; one that cannot run here (FlashOptim's format: CUDA only) is a pair of rows with
    ``available`` False and the reason in ``note``.
    """
    if batch < 1 or seq < 2 or steps < 1 or repeats < 1:
        raise ValueError(f"need batch >= 1, seq >= 2, steps >= 1, repeats >= 1, got {batch}, {seq}, {steps}, "
                         f"{repeats}")
    config = flan_t5_config(d_model, layers)
    device = torch.device(device)
    batches = _token_batches(config.vocab_size, batch, seq, steps, seed)

    def model_fn() -> nn.Module:
        torch.manual_seed(seed)
        return T5Classifier(config)

    peers = list(peers)
    runs = [(name, sib) for name in [*formats, *peers] for sib in (False, True)]

    def peak(name: str, sib: bool) -> dict:
        if name in peers:
            return peer_peak(name, model_fn, batches, in_backward=sib, optimizer=optimizer, lr=lr, device=device)
        return measure_peak(model_fn, parse_format(name), batches, in_backward=sib, optimizer=optimizer, lr=lr,
                            device=device)

    def step(name: str, sib: bool) -> tuple:
        if name in peers:
            return peer_step(name, model_fn, batches[0], in_backward=sib, optimizer=optimizer, lr=lr, device=device)
        return _training_step(model_fn, parse_format(name), batches[0], in_backward=sib, optimizer=optimizer, lr=lr,
                              device=device)

    label = {name: peer_label(name, optimizer) if name in peers else name for name, _ in runs}  # its rows' format
    rows, unavailable = [], {}
    for name, sib in runs:  # every memory run before the timed models exist: the device reading is absolute
        with used_memory(device) as reading:
            try:
                row = peak(name, sib)
            except PeerUnavailable as exc:  # a peer that cannot run here: its rows say why
                unavailable[name], row = str(exc), {"format": label[name], "step_in_backward": sib}
        rows.append({**row, **reading, "available": name not in unavailable, "note": unavailable.get(name, "")})
    fns, handles = {}, []
    for name, sib in runs:
        if name not in unavailable:
            fns[(label[name], sib)], handle = step(name, sib)
            handles.append(handle)
    times = time_interleaved(fns, warmup=1, repeats=repeats, device=device, progress=progress,
                             desc="fused backward")
    kernel = {key: kernel_seconds(fn, calls=1, warmup=0, device=device) for key, fn in fns.items()}
    for h in handles:
        if h is not None:
            h.remove()
    df = pd.DataFrame(rows)
    keys = list(zip(df["format"], df["step_in_backward"], strict=True))
    df["step_s"] = [statistics.median(times[k]) if k in times else math.nan for k in keys]
    df["kernel_s"] = [kernel.get(k, math.nan) for k in keys]
    df["kernel_share"] = df["kernel_s"] / df["step_s"]
    df["tokens"] = batch * seq
    df["device"] = device.type
    df["model"] = (f"T5 d_model {d_model}, {layers}+{layers} layers, {config.num_heads} heads, d_ff {config.d_ff}, "
                   f"vocabulary {config.vocab_size}")
    first = df.groupby("format")
    df["peak_ratio"] = df["peak_bytes"] / first["peak_bytes"].transform("first")
    df["ceiling"] = (first["peak_gradients"].transform("first") / first["peak_bytes"].transform("first"))
    # arguments swapped on purpose: paired_ratio(times, a, b) is b / a, here in-backward / ordinary
    ratios = [paired_ratio(times, (f, False), (f, s)) if (f, s) in times else (math.nan,) * 3 for f, s in keys]
    df["time_ratio"], df["time_ratio_lo"], df["time_ratio_hi"] = zip(*ratios, strict=True)
    return df
