"""OpTorch's data flow measured: encoding capacity, encoded batch sizes, selective batch sampling, loaders.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-A: Algorithm 1 (``A = sum_i X_i * 256**i``, "can only encode 16
images" in float64), Algorithm 4 (7-bit values plus odd/even offsets, "32 images in float-64"),
Algorithm 3 (the decode layer), Algorithm 2 (selective batch sampling, SBS) and the parallel
encoding thread (E-D, Sec. II-A-4), with its claim to "save memory and passage time up-to 16X".

# NOTE: a float64 holds integers exactly only up to 2**53, so Algorithm 1 round-trips at most 6
# uint8 images per element (Algorithm 4: 7); the capacity study packs beyond that
# (``allow_lossy=True``) to show where and how badly it breaks, and the exact int64 packing (8
# images per word, exactly the uint8 batch's bytes) stands beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from workbench.data import ImageSet, normalize, synthetic_images
from workbench.data.encode import DecodeLayer, EncodedBatch, capacity_study, encode
from workbench.data.prefetch import PrefetchLoader, benchmark_loaders
from workbench.data.sampling import (
    ClassAugmenter, ClassImageAugmenter, CutMix, FlipCrop, MixUp, SelectiveBatchSampler,
)

__all__ = [
    "ENCODED_FORMS",
    "capacity_at",
    "experiment_capacity",
    "experiment_encoded_bytes",
    "experiment_loaders",
    "experiment_sbs",
    "exact_capacity",
]

# The exact encoded forms the byte comparison measures (each at its exact capacity).
ENCODED_FORMS = ("float64", "float64-7bit", "int64")


def experiment_capacity(max_per_element: int = 32, *, image_size: int = 8, seed: int = 0) -> pd.DataFrame:
    """Round-trip error of every scheme packing 1..``max_per_element`` random uint8 images per element.

    The images are seeded random bytes (every bit pattern occurs) with the first image all 255, the
    largest value each image position can carry. One row per (scheme, images per element), from
    :func:`workbench.data.encode.capacity_study`: max/mean absolute pixel error, exact fraction,
    whether the round trip is exact, bytes per image and per pixel.
    """
    if max_per_element < 1:
        raise ValueError(f"max_per_element must be >= 1, got {max_per_element}")
    images = torch.randint(0, 256, (max_per_element, 3, image_size, image_size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    images[0] = 255
    return capacity_study(images, max_per_element=max_per_element)


def exact_capacity(capacity: pd.DataFrame) -> dict[str, int]:
    """The largest images per element that round-trip exactly, per scheme (0 where none does)."""
    exact = capacity[capacity.exact.astype(bool)]
    found = exact.groupby("scheme").per_element.max()
    return {s: int(found.get(s, 0)) for s in dict.fromkeys(capacity.scheme)}


def capacity_at(capacity: pd.DataFrame, per_element: Sequence[int] = (16, 32)) -> pd.DataFrame:
    """The capacity study's rows at the paper's counts (16 for Algorithm 1, 32 for Algorithm 4)."""
    rows = capacity[capacity.per_element.isin(list(per_element))]
    return rows[["scheme", "per_element", "max_abs_error", "mean_abs_error", "exact_fraction"]].reset_index(drop=True)


def experiment_encoded_bytes(count: int = 16, *, image_size: int = 32, seed: int = 0) -> pd.DataFrame:
    """Bytes of one batch of ``count`` uint8 images 3 x ``image_size``^2 in every form it can take.

    Rows: the normalised float32 batch B feeds the network, the uint8 batch, and each exact encoding
    (``ENCODED_FORMS`` at their exact capacity, offsets included), with ``saving_vs_float32`` (float32
    bytes / the form's bytes) and ``size_vs_uint8``.
    """
    batch = torch.randint(0, 256, (count, 3, image_size, image_size), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    rows = [{"form": "float32 normalised (B)", "bytes": normalize(batch).nbytes},
            {"form": "uint8", "bytes": batch.nbytes}]
    rows += [{"form": s, "bytes": encode(batch, scheme=s).nbytes} for s in ENCODED_FORMS]
    df = pd.DataFrame(rows)
    df["saving_vs_float32"] = df.bytes.iloc[0] / df.bytes
    df["size_vs_uint8"] = df.bytes / df.bytes.iloc[1]
    return df.assign(images=count, image_shape=f"3x{image_size}x{image_size}")


def experiment_sbs(
    data: ImageSet, class_weights: Sequence[float], *, batch_size: int = 16, num_batches: int = 8,
    flip_classes: Sequence[int] = (3,), mixup_class: int | None = 3, cutmix_class: int | None = 8,
    scheme: str = "int64", seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Selective batch sampling (Algorithm 2) through the encoded pipeline, as the paper runs it.

    A SelectiveBatchSampler picks each batch by class weights (cut to the data's classes); the
    PrefetchLoader's thread augments the uint8 images of ``flip_classes`` (random flip and crop)
    and encodes the batch; the consumer decodes it (``DecodeLayer``) and mixes rows of
    ``mixup_class`` (MixUp) and ``cutmix_class`` (CutMix) with soft targets. The same run without
    encoding gives the reference. Returns (batches, shares): per batch the class counts, the mixed
    rows and the largest difference from the unencoded run; per class the asked and the delivered
    share, and ``abs_error_examples`` (the difference in examples over all batches drawn).
    """
    k = data.num_classes
    weights = list(class_weights)[:k]
    hooks = {c: CutMix(1.0) for c in [cutmix_class] if c is not None and c < k}
    hooks |= {c: MixUp(0.4) for c in [mixup_class] if c is not None and c < k}

    def run(encoded: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        sampler = SelectiveBatchSampler(data.labels, weights, batch_size, seed=seed, num_batches=num_batches)
        before = ClassImageAugmenter({c: FlipCrop() for c in flip_classes if c < k}, k, seed=seed)
        after = ClassAugmenter(hooks, k, seed=seed)
        decode = DecodeLayer()
        out = []
        with PrefetchLoader(data, batch_size, batch_sampler=sampler, transform=before,
                            scheme=scheme if encoded else None) as loader:
            for inputs, labels in loader:
                if isinstance(inputs, EncodedBatch):
                    inputs = decode(inputs)
                images, targets = after(inputs, labels)
                out.append((images, targets, labels))
        return out

    encoded, plain = run(True), run(False)
    rows = []
    for i, ((x, t, y), (px, _, _)) in enumerate(zip(encoded, plain, strict=True)):
        counts = torch.bincount(y, minlength=k).tolist()
        rows.append({"batch": i, **{f"class {c}": n for c, n in enumerate(counts)},
                     "mixed_rows": int((t.max(1).values < 1).sum()),
                     "max_diff_vs_unencoded": float((x - px).abs().max())})
    batches = pd.DataFrame(rows)
    total = float(sum(weights))
    delivered = torch.bincount(torch.cat([y for _, _, y in encoded]), minlength=k).double()
    shares = pd.DataFrame({"class": range(k), "asked_share": [w / total for w in weights],
                           "epoch_share": (delivered / delivered.sum()).tolist()})
    shares["abs_error"] = (shares.epoch_share - shares.asked_share).abs()
    shares["abs_error_examples"] = shares.abs_error * float(delivered.sum())
    return batches, shares.assign(batch_size=batch_size, num_batches=num_batches, scheme=scheme)


def experiment_loaders(
    images: int = 2048, *, image_size: int = 32, batch_size: int = 16, epochs: int = 2,
    workers: Sequence[int] = (0, 2), seed: int = 0,
) -> pd.DataFrame:
    """Pure loading throughput (no training step) of the prefetching thread, plain and encoded
    (int64, float64), against torch's DataLoader with ``workers``, on one seeded synthetic set."""
    data = synthetic_images(images, shape=(3, image_size, image_size), seed=seed)
    df = benchmark_loaders(data, batch_size, epochs=epochs, seed=seed, workers=tuple(int(w) for w in workers),
                           schemes=(None, "int64", "float64"))
    return df.assign(images=images, image_size=image_size, batch_size=batch_size, epochs=epochs)
