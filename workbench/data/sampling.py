"""Selective batch sampling (SBS) and per-class augmentation (flip/crop, MixUp, CutMix).

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-A-1 and Algorithm 2 (selective-batch-sampling: each batch holds
``W[c] * batch_size`` examples of class ``c``, pre-processed per class) with MixUp (Zhang et al.
2017) and CutMix (Yun et al. 2019) applied to chosen classes only.

:class:`SelectiveBatchSampler` is a ``torch.utils.data.Sampler`` of index lists, so it plugs
into ``DataLoader(batch_sampler=...)`` as well as the prefetching loader. ``W[c] * batch_size``
is rarely whole: the fractional part is carried from batch to batch, so over an epoch every
class gets its share to within one example (rounding each batch alike would give a class asked
for 0.30 of 16 only 5/16 = 0.31, or 4/16 = 0.25, in every batch).

The paper's pipeline augments per class before encoding and mixes after decoding, and both
halves are here: :class:`ClassImageAugmenter` applies uint8 -> uint8 hooks (:class:`FlipCrop`)
to the rows of chosen classes, so its output can still be encoded; :class:`ClassAugmenter`
(MixUp, CutMix) works on the decoded float batch, turns integer labels into soft targets and
mixes the rows of its class only; ``torch.nn.functional.cross_entropy`` accepts soft targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Integral, Real

import torch
from torch.utils.data import Sampler

from .datasets import seeded

__all__ = [
    "ClassAugmenter", "ClassImageAugmenter", "CutMix", "FlipCrop", "MixUp", "SelectiveBatchSampler",
    "beta_sample", "class_counts",
]

# hook(rows, row_targets, partners, partner_targets, generator) -> (rows, row_targets)
Hook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator],
                tuple[torch.Tensor, torch.Tensor]]


MAX_CLASSES = 2**20  # largest class index a sampler plans for (ImageNet-21k has 21,841 classes)


def _check_weights(class_weights: Sequence[float], batch_size: int) -> float:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(class_weights, (str, bytes)) or not all(
            isinstance(w, Real) and not isinstance(w, bool) for w in class_weights):
        raise ValueError(f"class_weights must be numbers, got {list(class_weights)!r}")
    total = float(sum(class_weights))
    if any(not math.isfinite(w) or w < 0 for w in class_weights) or not math.isfinite(total) or total <= 0:
        raise ValueError(f"class_weights must be finite, >= 0, with a positive sum, got {list(class_weights)}")
    return total


def class_counts(class_weights: Sequence[float], batch_size: int) -> list[int]:
    """Examples per class in one batch: ``weights * batch_size`` rounded by largest remainder
    so the counts sum to ``batch_size`` exactly (the sampler carries the remainders instead)."""
    total = _check_weights(class_weights, batch_size)
    exact = [w / total * batch_size for w in class_weights]
    counts = [int(e) for e in exact]
    order = sorted(range(len(exact)), key=lambda c: (-(exact[c] - counts[c]), c))
    for c in order[: batch_size - sum(counts)]:
        counts[c] += 1
    return counts


def _hooks(hooks, num_classes, who: str, *, none: bool) -> dict:
    """`hooks` as a dict of class index (or None, where `none`) -> callable; refused naming the value otherwise."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"{who}: num_classes must be an int >= 1, got {num_classes!r}")
    if not isinstance(hooks, Mapping):
        raise TypeError(f"{who}: hooks must be a mapping of class index -> hook, got {type(hooks).__name__}")
    bad = [c for c in hooks if not (c is None and none) and not (
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < num_classes)]
    if bad:
        raise ValueError(f"hook classes must be {'None or ' if none else ''}ints in [0, {num_classes}), got {bad}")
    uncallable = {c: h for c, h in hooks.items() if not callable(h)}
    if uncallable:
        raise TypeError(f"{who}: every hook must be callable, got {uncallable!r}")
    return dict(hooks)


def _class_indices(labels) -> torch.Tensor:
    """`labels` as a non-empty 1-D int64 tensor of class indices in 0..MAX_CLASSES-1; refused naming the
    values otherwise (a float label is not truncated, a stray huge one does not size a table)."""
    if isinstance(labels, (str, bytes)):
        raise ValueError(f"labels must be a non-empty 1-D tensor of class indices, got {labels!r}")
    tensor = torch.as_tensor(labels)
    if tensor.ndim != 1 or tensor.numel() == 0:
        raise ValueError(f"labels must be a non-empty 1-D tensor of class indices, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {tensor.dtype}")
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high >= MAX_CLASSES:
        raise ValueError(f"labels must be class indices in 0..{MAX_CLASSES - 1}, found {low}..{high}")
    return tensor.to(torch.int64)


class SelectiveBatchSampler(Sampler[list[int]]):
    """Algorithm 2: every batch holds ``class_weights[c] * batch_size`` examples of class c.

    Where that is fractional the remainder is carried to the next batch (:meth:`batch_counts`),
    so every prefix of batches holds each class's share to within one example. Each class is
    drawn without replacement from its own shuffled pool, reshuffled when used up.
    ``num_batches`` defaults to ``len(labels) // batch_size``. Batches are deterministic in
    (seed, epoch); call ``set_epoch`` (the prefetching loader does) for a new order.
    """

    def __init__(
        self, labels: torch.Tensor | Sequence[int], class_weights: Sequence[float] | Mapping[int, float],
        batch_size: int, *, seed: int = 0, num_batches: int | None = None, shuffle_batch: bool = True,
    ) -> None:
        labels = _class_indices(labels)
        num_classes = int(labels.max()) + 1
        if not isinstance(class_weights, (Mapping, Sequence)) or isinstance(class_weights, (str, bytes)):
            raise TypeError(f"class_weights must be a sequence or a mapping of class index -> weight, "
                            f"got {class_weights!r}")
        if isinstance(class_weights, Mapping):
            bad = [c for c in class_weights
                   if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < num_classes]
            if bad:
                raise ValueError(f"class_weights keys must be in [0, {num_classes}), got {bad}")
            class_weights = [float(class_weights.get(c, 0.0)) for c in range(num_classes)]
        if len(class_weights) != num_classes:
            raise ValueError(
                f"class_weights needs one weight per class ({num_classes}), got {len(class_weights)}")
        total = _check_weights(class_weights, batch_size)
        self.shares = [w / total for w in class_weights]
        self.pools = [torch.nonzero(labels == c).flatten() for c in range(num_classes)]
        empty = [c for c, w in enumerate(self.shares) if w > 0 and len(self.pools[c]) == 0]
        if empty:
            raise ValueError(f"classes {empty} have a positive weight but no examples")
        self.batch_size = batch_size
        seeded(seed)  # refused now, naming it, rather than by torch at the first batch
        self.seed = seed
        self.epoch = 0
        self.shuffle_batch = shuffle_batch
        self.num_batches = num_batches if num_batches is not None else len(labels) // batch_size
        if isinstance(self.num_batches, bool) or not isinstance(self.num_batches, Integral) or self.num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {self.num_batches!r}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    @property
    def counts(self) -> list[int]:
        """Examples per class in the first batch."""
        return self.batch_counts()[0]

    def batch_counts(self) -> list[list[int]]:
        """Examples per class in each batch of an epoch (the same every epoch).

        # NOTE: slot by slot, each slot goes to the class furthest behind its exact share
        # ``share * slots so far`` (ties to the lower class). A class's deficit never reaches
        # -1, and the deficits sum to zero, so the epoch shares follow the weights instead of
        # repeating one batch's rounding ``num_batches`` times.
        """
        deficit = [0.0] * len(self.shares)
        out = []
        for _ in range(self.num_batches):
            counts = [0] * len(self.shares)
            for _ in range(self.batch_size):
                deficit = [d + w for d, w in zip(deficit, self.shares, strict=True)]
                c = max(range(len(deficit)), key=lambda i: (deficit[i], -i))
                deficit[c] -= 1.0
                counts[c] += 1
            out.append(counts)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        g = seeded((self.seed * 1_000_003 + self.epoch) % 2**64)
        queues: list[torch.Tensor] = [p[torch.randperm(len(p), generator=g)] for p in self.pools]
        cursor = [0] * len(self.pools)
        for counts in self.batch_counts():
            batch = []
            for c, n in enumerate(counts):
                taken: list[torch.Tensor] = []
                while n > 0:
                    if cursor[c] == len(queues[c]):  # pool used up: reshuffle
                        queues[c] = self.pools[c][torch.randperm(len(self.pools[c]), generator=g)]
                        cursor[c] = 0
                    step = min(n, len(queues[c]) - cursor[c])
                    taken.append(queues[c][cursor[c]: cursor[c] + step])
                    cursor[c] += step
                    n -= step
                if taken:
                    batch.append(torch.cat(taken))
            idx = torch.cat(batch)
            if self.shuffle_batch:
                idx = idx[torch.randperm(len(idx), generator=g)]
            yield idx.tolist()


def _gamma(alpha: float, g: torch.Generator) -> float:
    """One Gamma(alpha, 1) draw from ``g`` (Marsaglia & Tsang 2000; for alpha < 1 the boost
    Gamma(alpha + 1) * U**(1/alpha)). Accepts with probability > 0.95 for every alpha."""
    boost = 1.0
    if alpha < 1.0:
        boost = float(torch.rand((), generator=g, dtype=torch.float64)) ** (1.0 / alpha)
        alpha += 1.0
    d = alpha - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = float(torch.randn((), generator=g, dtype=torch.float64))
        v = (1.0 + c * x) ** 3
        if v <= 0:
            continue
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        if u > 0 and math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
            return d * v * boost


def beta_sample(alpha: float, g: torch.Generator, *, beta: float | None = None) -> float:
    """One Beta(alpha, beta) draw (beta defaults to alpha) from the generator ``g``.

    # NOTE: torch.distributions.Beta takes no generator, so draws would follow the global RNG
    # and a seeded augmenter would not be reproducible. X / (X + Y) with X ~ Gamma(alpha),
    # Y ~ Gamma(beta) works for any shape; the ratio-of-powered-uniforms method used before
    # accepts with a probability that vanishes as alpha grows (it never returned at 16).
    """
    b = alpha if beta is None else beta
    for name, v in (("alpha", alpha), ("beta", b)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    x, y = _gamma(float(alpha), g), _gamma(float(b), g)
    if x + y == 0.0:  # both underflowed (tiny shapes): the limit is a fair coin
        return float(torch.rand((), generator=g) < 0.5)
    return x / (x + y)


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    return float(alpha)


class MixUp:
    """MixUp: ``lam * x + (1 - lam) * partner``, targets mixed with the same ``lam``."""

    def __init__(self, alpha: float = 0.4) -> None:
        self.alpha = _check_alpha(alpha)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, px: torch.Tensor, pt: torch.Tensor,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        lam = beta_sample(self.alpha, g)
        return lam * x + (1 - lam) * px, lam * t + (1 - lam) * pt


class CutMix:
    """CutMix: a box of the partner is pasted in; targets mixed by the pasted area."""

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = _check_alpha(alpha)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, px: torch.Tensor, pt: torch.Tensor,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = x.shape[-2:]
        lam = beta_sample(self.alpha, g)
        ch, cw = round(h * (1 - lam) ** 0.5), round(w * (1 - lam) ** 0.5)
        top = int(torch.randint(0, h - ch + 1, (1,), generator=g))
        left = int(torch.randint(0, w - cw + 1, (1,), generator=g))
        x = x.clone()
        x[..., top: top + ch, left: left + cw] = px[..., top: top + ch, left: left + cw]
        area = ch * cw / (h * w)
        return x, (1 - area) * t + area * pt


class ClassAugmenter:
    """Apply ``hooks[c]`` to the rows of class c only; partners are drawn from the whole batch.

    Returns float images and soft targets ``[B, num_classes]`` (rows without a hook stay one-hot
    and unchanged). Deterministic given the seed and the call order.
    """

    def __init__(self, hooks: Mapping[int, Hook], num_classes: int, *, seed: int = 0) -> None:
        self.hooks = _hooks(hooks, num_classes, "ClassAugmenter", none=False)
        self.num_classes = num_classes
        self.generator = seeded(seed)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(images, torch.Tensor) or images.dim() < 1:
            raise TypeError(f"ClassAugmenter: images must be a tensor [N, ...], got {type(images).__name__}")
        if (not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.is_floating_point()
                or labels.is_complex() or labels.dtype == torch.bool):
            raise ValueError(f"ClassAugmenter: labels must be a 1-D integer tensor of class indices, got "
                             f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__}")
        if len(labels) != len(images):
            raise ValueError(f"ClassAugmenter: {len(images)} images but {len(labels)} labels")
        labels = labels.to(torch.int64)
        if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < self.num_classes:
            raise ValueError(f"labels must be in 0..{self.num_classes - 1} (num_classes={self.num_classes}), "
                             f"found {int(labels.min())}..{int(labels.max())}")
        source = images if images.is_floating_point() else images.float()
        source_targets = torch.nn.functional.one_hot(labels, self.num_classes).float()
        images, targets = source.clone(), source_targets.clone()
        for c, hook in sorted(self.hooks.items()):
            rows = torch.nonzero(labels == c).flatten()
            if len(rows) == 0:
                continue
            partners = torch.randint(0, len(labels), (len(rows),), generator=self.generator)
            images[rows], targets[rows] = hook(source[rows], source_targets[rows],
                                               source[partners], source_targets[partners],
                                               self.generator)
        return images, targets


# image_hook(rows uint8 [n, C, H, W], generator) -> rows uint8 of the same shape
ImageHook = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


class FlipCrop:
    """Random horizontal flip and random crop with zero padding, on uint8 images, per row.

    The usual CIFAR augmentation; it keeps dtype and shape, so its output can be encoded.
    """

    def __init__(self, *, padding: int = 2, flip: bool = True) -> None:
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding must be an int >= 0, got {padding!r}")
        if not isinstance(flip, bool):
            raise TypeError(f"FlipCrop: flip must be True or False, got {flip!r}")
        self.padding, self.flip = padding, flip

    def __call__(self, rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 4:
            raise TypeError(f"FlipCrop works on image rows [n, C, H, W], got {getattr(rows, 'shape', type(rows))}")
        n, _, h, w = rows.shape
        p = self.padding
        if p > max(h, w):
            raise ValueError(f"FlipCrop: padding={p} is more than the images' size {h} x {w} (at most {max(h, w)})")
        out = rows.clone()
        if self.flip:
            flips = torch.rand(n, generator=g) < 0.5
            out[flips] = out[flips].flip(-1)
        if p:
            padded = torch.nn.functional.pad(out, (p, p, p, p))
            tops = torch.randint(0, 2 * p + 1, (n,), generator=g).tolist()
            lefts = torch.randint(0, 2 * p + 1, (n,), generator=g).tolist()
            for i, (t, left) in enumerate(zip(tops, lefts, strict=True)):
                out[i] = padded[i, :, t: t + h, left: left + w]
        return out


class ClassImageAugmenter:
    """Apply ``hooks[c]`` (uint8 -> uint8) to the images of class c only, before encoding.

    Returns ``(images, labels)`` with the images still uint8, so a prefetching loader can encode
    them afterwards; ``hooks`` may hold the key ``None`` for a hook applied to every class
    (after the per-class ones). Deterministic given the seed and the call order.
    """

    def __init__(self, hooks: Mapping[int | None, ImageHook], num_classes: int, *, seed: int = 0) -> None:
        self.hooks = _hooks(hooks, num_classes, "ClassImageAugmenter", none=True)
        self.num_classes = num_classes
        self.generator = seeded(seed)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if images.dtype != torch.uint8:
            raise TypeError(f"ClassImageAugmenter works on uint8 images (before encoding), got {images.dtype}")
        out = images.clone()
        for c, hook in sorted(((c, h) for c, h in self.hooks.items() if c is not None), key=lambda kv: kv[0]):
            rows = torch.nonzero(labels == c).flatten()
            if len(rows):
                out[rows] = hook(out[rows], self.generator)
        if None in self.hooks:
            out = self.hooks[None](out, self.generator)
        return out, labels
