"""The advisor suite's models (issue 37): ResNet-50 and DenseNet-BC-100 from `workbench.models`, and two
transformers written here as a user would bring them, a ViT and a GPT-2-small-sized decoder, each at a
channel multiplier `width` (1.0: the published size) and an input resolution.

- ViT (Dosovitskiy et al., 2021, ViT-B/16 at width 1.0): a patch-embedding convolution, a class token and
  learned positions, 12 pre-norm blocks of `nn.MultiheadAttention` (12 heads) and a 4x GELU MLP, the head
  on the class token. Patches of 16 px from 64 px up; below, image_size // 4 (so that a toy image still has
  16 patches, not 1 or 4).
- GPT-2 small (Radford et al., 2019, 124M parameters at width 1.0): token and position embeddings, 12
  pre-norm causal blocks (`F.scaled_dot_product_attention`, as nanoGPT and transformers' sdpa path run it),
  dropout 0.1, the LM head tied to the token embedding. Its vocabulary scales with the width as well (50257
  at 1.0), so that at toy widths the blocks still hold most parameters, as they do in GPT-2 small; its
  inputs are token ids and its targets the next tokens (`lm_loss`).

The other suite models (a small encoder, an LSTM, an MLP) are the earlier suite's: quick to plan, kept for
the smoke profile and the widget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models import build
from workbench.models.densenet import densenet_bc

__all__ = ["GPT2_VOCAB", "SUITE", "GPTDecoder", "SuiteModel", "ViT", "lm_loss", "reduced", "suite_model"]

SUITE = ("resnet50", "densenet_bc_100", "vit", "gpt2", "transformer", "lstm", "mlp")
GPT2_VOCAB = 50257


class _ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A ViT-B/16-shaped classifier at `dim` (768 for ViT-B), `depth` blocks of `heads` heads."""

    def __init__(self, image_size: int, *, dim: int = 768, depth: int = 12, heads: int = 12,
                 num_classes: int = 10) -> None:
        super().__init__()
        patch = min(16, max(2, image_size // 4))
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image_size // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(_ViTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


class _CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class GPTDecoder(nn.Module):
    """A GPT-2-shaped causal language model (GPT-2 small: vocab 50257, context 1024, dim 768, 12 x 12 heads)."""

    def __init__(self, *, vocab: int = GPT2_VOCAB, context: int = 1024, dim: int = 768, depth: int = 12,
                 heads: int = 12, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_CausalBlock(dim, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position: logits [batch, tokens, vocab], targets [batch, tokens]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Encoder(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=2 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class _LSTM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(width, 2 * width, num_layers=2, batch_first=True)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@dataclass(frozen=True)
class SuiteModel:
    """A suite model: its factory, one example's input shape and dtype, its targets and its loss."""

    name: str
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    vocab: int = 0  # > 0: inputs are token ids below it, targets the next tokens (`lm_loss`)

    @property
    def loss_fn(self) -> Callable | None:
        return lm_loss if self.vocab else None

    def batch(self, size: int, *, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of `size`: random images or features with class targets, or token ids with the next tokens."""
        if self.vocab:
            ids = torch.randint(0, self.vocab, (size, self.shape[0] + 1), device=device)
            return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        return torch.randn(size, *self.shape, device=device), torch.randint(0, 10, (size,), device=device)

    @property
    def parameters(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())


def suite_model(name: str, *, width: float, image_size: int) -> SuiteModel:
    """The suite model `name` at `width` (channel multiplier, 1.0 the published size) and `image_size` px;
    sequence models take image_size // 2 tokens (at least 8)."""
    if not isinstance(width, (int, float)) or isinstance(width, bool) or not 0 < width <= 16:
        raise ValueError(f"width must be a channel multiplier in (0, 16], got {width!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or not 8 <= image_size <= 1024:
        raise ValueError(f"image_size must be a whole number of pixels in 8..1024, got {image_size!r}")
    tokens = max(8, image_size // 2)
    features = max(8, int(64 * width))
    dim = 12 * max(1, round(64 * width))  # 12 heads of round(64 x width) each: 768 at width 1.0
    if name == "resnet50":
        return SuiteModel(name, lambda: build("resnet50", width=width), (3, image_size, image_size))
    if name == "densenet_bc_100":
        growth = max(2, round(12 * width))
        return SuiteModel(name, lambda: densenet_bc(100, growth_rate=growth), (3, image_size, image_size))
    if name == "vit":
        return SuiteModel(name, lambda: ViT(image_size, dim=dim), (3, image_size, image_size))
    if name == "gpt2":
        vocab = max(256, round(GPT2_VOCAB * width))
        return SuiteModel(name, lambda: GPTDecoder(vocab=vocab, context=max(tokens, 1024), dim=dim), (tokens,),
                          vocab=vocab)
    if name == "transformer":
        return SuiteModel(name, lambda: _Encoder(features), (tokens, features))
    if name == "lstm":
        return SuiteModel(name, lambda: _LSTM(features), (tokens, features))
    if name == "mlp":
        return SuiteModel(name, lambda: nn.Sequential(
            nn.Flatten(), nn.Linear(features * 4, 4 * features), nn.ReLU(), nn.Linear(4 * features, 4 * features),
            nn.ReLU(), nn.Linear(4 * features, 10)), (features * 4,))
    raise ValueError(f"model must be one of {SUITE}, got {name!r}")


def reduced(width: float, image_size: int) -> str:
    """How the suite's models are smaller than published ("" at width 1.0 and 224 px or more): the toy-scale mark
    of the notebook's figures and tables."""
    parts = [f"width x{width:g}" if width < 1 else "", f"{image_size} px (sequences {max(8, image_size // 2)} tokens)"
             if image_size < 224 else ""]
    return ", ".join(p for p in parts if p)
