"""Selective batch sampling (SBS) and per-class augmentation hooks (MixUp, CutMix).

Paper: Ahmed & Naveed, "OpTorch" (arXiv 2105.00619), Sec. II-A-1 and Algorithm 2
(selective-batch-sampling: each batch holds ``W[c] * batch_size`` examples of class ``c``,
pre-processed per class) with MixUp (Zhang et al. 2017) and CutMix (Yun et al. 2019) applied to
chosen classes only.

:class:`SelectiveBatchSampler` is a ``torch.utils.data.Sampler`` of index lists, so it plugs
into ``DataLoader(batch_sampler=...)`` as well as the prefetching loader. :class:`ClassAugmenter`
turns integer labels into soft targets and applies a hook to the rows of its class only;
``torch.nn.functional.cross_entropy`` accepts the soft targets directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["ClassAugmenter", "CutMix", "MixUp", "SelectiveBatchSampler", "class_counts"]

# hook(rows, row_targets, partners, partner_targets, generator) -> (rows, row_targets)
Hook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator],
                tuple[torch.Tensor, torch.Tensor]]


def class_counts(class_weights: Sequence[float], batch_size: int) -> list[int]:
    """Examples per class in a batch: ``weights * batch_size`` rounded by largest remainder
    so the counts sum to ``batch_size`` exactly."""
    total = float(sum(class_weights))
    if any(w < 0 for w in class_weights) or total <= 0:
        raise ValueError(f"class_weights must be >= 0 with a positive sum, got {list(class_weights)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    exact = [w / total * batch_size for w in class_weights]
    counts = [int(e) for e in exact]
    order = sorted(range(len(exact)), key=lambda c: (-(exact[c] - counts[c]), c))
    for c in order[: batch_size - sum(counts)]:
        counts[c] += 1
    return counts


class SelectiveBatchSampler(Sampler[list[int]]):
    """Algorithm 2: every batch holds ``class_weights[c] * batch_size`` examples of class c.

    Each class is drawn without replacement from its own shuffled pool, reshuffled when used
    up. ``num_batches`` defaults to ``len(labels) // batch_size``. Batches are deterministic in
    (seed, epoch); call ``set_epoch`` (the prefetching loader does) for a new order.
    """

    def __init__(
        self, labels: torch.Tensor | Sequence[int], class_weights: Sequence[float] | Mapping[int, float],
        batch_size: int, *, seed: int = 0, num_batches: int | None = None, shuffle_batch: bool = True,
    ) -> None:
        labels = torch.as_tensor(labels, dtype=torch.int64)
        if labels.ndim != 1 or labels.numel() == 0:
            raise ValueError(f"labels must be a non-empty 1-D tensor, got shape {tuple(labels.shape)}")
        num_classes = int(labels.max()) + 1
        if isinstance(class_weights, Mapping):
            bad = [c for c in class_weights if not 0 <= c < num_classes]
            if bad:
                raise ValueError(f"class_weights keys must be in [0, {num_classes}), got {bad}")
            class_weights = [float(class_weights.get(c, 0.0)) for c in range(num_classes)]
        if len(class_weights) != num_classes:
            raise ValueError(
                f"class_weights needs one weight per class ({num_classes}), got {len(class_weights)}")
        self.counts = class_counts(class_weights, batch_size)
        self.pools = [torch.nonzero(labels == c).flatten() for c in range(num_classes)]
        empty = [c for c, n in enumerate(self.counts) if n and len(self.pools[c]) == 0]
        if empty:
            raise ValueError(f"classes {empty} have a positive weight but no examples")
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.shuffle_batch = shuffle_batch
        self.num_batches = num_batches if num_batches is not None else len(labels) // batch_size
        if self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {self.num_batches}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        queues: list[torch.Tensor] = [p[torch.randperm(len(p), generator=g)] for p in self.pools]
        cursor = [0] * len(self.pools)
        for _ in range(self.num_batches):
            batch = []
            for c, n in enumerate(self.counts):
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


def _beta(alpha: float, g: torch.Generator) -> float:
    # NOTE: torch.distributions.Beta has no generator argument; Beta(a, a) = X / (X + Y) with
    # X, Y ~ Gamma(a), and torch._standard_gamma follows the global RNG, so sample through
    # uniform draws from `g` with the inverse-free Johnk-style ratio of powered uniforms.
    while True:
        u, v = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        x, y = u ** (1.0 / alpha), v ** (1.0 / alpha)
        if 0 < x + y <= 1.0:
            return x / (x + y)


class MixUp:
    """MixUp: ``lam * x + (1 - lam) * partner``, targets mixed with the same ``lam``."""

    def __init__(self, alpha: float = 0.4) -> None:
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha = alpha

    def __call__(self, x: torch.Tensor, t: torch.Tensor, px: torch.Tensor, pt: torch.Tensor,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        lam = _beta(self.alpha, g)
        return lam * x + (1 - lam) * px, lam * t + (1 - lam) * pt


class CutMix:
    """CutMix: a box of the partner is pasted in; targets mixed by the pasted area."""

    def __init__(self, alpha: float = 1.0) -> None:
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha = alpha

    def __call__(self, x: torch.Tensor, t: torch.Tensor, px: torch.Tensor, pt: torch.Tensor,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = x.shape[-2:]
        lam = _beta(self.alpha, g)
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
        bad = [c for c in hooks if not 0 <= c < num_classes]
        if bad:
            raise ValueError(f"hook classes must be in [0, {num_classes}), got {bad}")
        self.hooks = dict(hooks)
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
