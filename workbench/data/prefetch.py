"""Parallel encoding (E-D): a background thread prepares the next batches while training runs.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-A-4 and Fig 1: "while training an epoch a thread will shuffle
images, encode batches and prepare input for the next epoch".

:class:`PrefetchLoader` iterates like a DataLoader (one ``for`` loop per epoch) over an
``ImageSet``. One producer thread shuffles (or asks a batch sampler), optionally augments
(uint8 -> uint8, e.g. ``ClassImageAugmenter``) and encodes each batch, and puts it in a
bounded queue; it runs ahead across the epoch boundary,
so the next epoch's batches are ready when the current one ends. The order depends only on
(seed, epoch), never on thread timing. An exception in the producer is re-raised in the
training thread; ``close()`` (or leaving a ``with`` block) stops and joins the thread.

# NOTE: a thread rather than DataLoader worker processes: batches are slices of one in-memory
# uint8 tensor, torch ops release the GIL, and a thread shares the tensor without copies or
# process start-up. :func:`benchmark_loaders` measures this choice against DataLoader.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from numbers import Integral
from typing import Any

import pandas as pd
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from .datasets import ImageSet, normalize, seeded
from .encode import SCHEMES, encode

__all__ = ["PrefetchLoader", "ShuffledBatchSampler", "benchmark_loaders"]

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ShuffledBatchSampler(Sampler[list[int]]):
    """Batches of a fresh permutation per epoch, a pure function of (seed, epoch).

    Each ``iter`` uses the current epoch and then advances it, so a plain DataLoader with
    ``batch_sampler=`` sees the same batches, epoch by epoch, as a PrefetchLoader with the
    same seed (which sets the epoch explicitly).
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        for what, value in (("n", n), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
        seeded(seed)  # refused now, naming it, rather than by torch at the first epoch
        for what, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"ShuffledBatchSampler: {what} must be True or False, got {flag!r}")
        self.n, self.batch_size, self.seed = int(n), int(batch_size), seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, Integral) or epoch < 0:
            raise ValueError(f"epoch must be a whole number >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self.shuffle:
            g = seeded((self.seed * 1_000_003 + epoch) % 2**64)  # any seed, any epoch: within torch's range
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        for i in range(len(self)):
            yield order[i * self.batch_size: (i + 1) * self.batch_size].tolist()


class _Producer:
    """The background thread's side: prepares batches from (seed, epoch) into a bounded queue.

    # NOTE: a separate object so the thread holds no reference to its PrefetchLoader: a loader dropped
    # without close() is then collected, and its finalizer stops the thread (a thread whose target is
    # a bound method of the loader kept the loader alive, and itself running, forever).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_sampler: Sampler[list[int]], *,
                 scheme: str | None, transform: Callable | None, pin_memory: bool, max_prefetch: int) -> None:
        self.images, self.labels, self.batch_sampler = images, labels, batch_sampler
        self.scheme, self.transform, self.pin_memory = scheme, transform, pin_memory
        self.queue: queue.Queue = queue.Queue(maxsize=max_prefetch)
        self.stop = threading.Event()

    def _batches(self, epoch: int) -> Iterator[list[int]]:
        sampler = self.batch_sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from sampler

    def _prepare(self, idx: list[int] | torch.Tensor) -> tuple[Any, torch.Tensor]:
        idx = torch.as_tensor(idx)
        if idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(f"batch_sampler gave {idx.tolist()!r}: a batch must be a list of int indices")
        n = len(self.labels)
        if len(idx) and not -n <= int(idx.min()) <= int(idx.max()) < n:
            bad = [i for i in idx.tolist() if not -n <= i < n]
            raise ValueError(f"batch_sampler gave indices {bad[:5]} outside the data's {n} examples (0..{n - 1})")
        images, labels = self.images[idx], self.labels[idx]
        if self.transform is not None:
            images, labels = self.transform(images, labels)
        if self.scheme is not None:
            if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8):
                raise TypeError(
                    "with a scheme the transform must return uint8 images to encode (augment "
                    "before encoding, mix after decoding), got "
                    f"{getattr(images, 'dtype', type(images).__name__)}")
            inputs = encode(images, scheme=self.scheme)
        elif images.dtype == torch.uint8:
            inputs = normalize(images)
        else:
            inputs = images
        if self.pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs, labels

    def _put(self, item: object) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run(self, first_epoch: int) -> None:
        epoch = first_epoch
        try:
            while not self.stop.is_set():
                for idx in self._batches(epoch):
                    if not self._put((epoch, self._prepare(idx))):
                        return
                if not self._put((epoch, _END)):
                    return
                epoch += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._put((epoch, _Failure(exc)))


class PrefetchLoader:
    """Batches of an ImageSet prepared by a background thread.

    Yields ``(inputs, labels)``: inputs are an ``EncodedBatch`` when ``scheme`` is given (decode
    on the device with ``DecodeLayer``), else normalised float images. ``transform(images,
    labels) -> (images, targets)`` runs in the thread on the uint8 batch: with a ``scheme`` it
    must return uint8 images (a ``ClassImageAugmenter``), which are then encoded; without one it
    may return uint8 (then normalised) or float images (a ``ClassAugmenter``, used as they are).
    MixUp/CutMix on an encoded pipeline belong after decoding, on the device.
    ``max_prefetch`` bounds the queue in batches (default: one epoch plus one, so a whole next
    epoch can be ready). A loader dropped without ``close()`` stops its thread when collected.
    """

    def __init__(
        self, data: ImageSet, batch_size: int, *, shuffle: bool = True, seed: int = 0,
        scheme: str | None = None, batch_sampler: Sampler[list[int]] | None = None,
        transform: Callable[[torch.Tensor, torch.Tensor], tuple[Any, torch.Tensor]] | None = None,
        drop_last: bool = False, max_prefetch: int | None = None, pin_memory: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(data, ImageSet):
            raise TypeError(f"data must be an ImageSet (workbench.data.load), got {type(data).__name__}")
        self.images, self.labels = data.images, data.labels
        if scheme is not None and scheme not in SCHEMES:
            raise ValueError(f"scheme must be None or one of {SCHEMES}, got {scheme!r}")
        if batch_sampler is not None and (isinstance(batch_sampler, (str, bytes)) or not (
                hasattr(batch_sampler, "__iter__") and hasattr(batch_sampler, "__len__"))):
            raise TypeError(f"batch_sampler must be None or a sized iterable of index lists (a torch batch Sampler), "
                            f"got {type(batch_sampler).__name__}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be None or a callable (images, labels), got {transform!r}")
        for what, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("pin_memory", pin_memory)):
            if not isinstance(flag, bool):
                raise TypeError(f"PrefetchLoader: {what} must be True or False, got {flag!r}")
        self.scheme, self.transform, self.pin_memory = scheme, transform, pin_memory
        self.batch_sampler = batch_sampler or ShuffledBatchSampler(
            len(self.labels), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
        self.max_prefetch = max_prefetch if max_prefetch is not None else len(self) + 1
        if isinstance(self.max_prefetch, bool) or not isinstance(self.max_prefetch, Integral) or self.max_prefetch < 1:
            raise ValueError(f"max_prefetch must be an int >= 1 (batches), got {self.max_prefetch!r}")
        self._producer: _Producer | None = None
        self._thread: threading.Thread | None = None
        self._epoch = 0  # next epoch the consumer reads

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def _start(self) -> None:
        self._producer = _Producer(self.images, self.labels, self.batch_sampler, scheme=self.scheme,
                                   transform=self.transform, pin_memory=self.pin_memory,
                                   max_prefetch=self.max_prefetch)
        self._thread = threading.Thread(target=self._producer.run, args=(self._epoch,),
                                        name="workbench-prefetch", daemon=True)
        weakref.finalize(self, self._producer.stop.set)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        if self._thread is None or not self._thread.is_alive():
            self._start()
        producer, thread = self._producer, self._thread
        epoch = self._epoch
        self._epoch += 1
        while True:
            try:
                item_epoch, item = producer.queue.get(timeout=0.1)
            except queue.Empty:
                if not thread.is_alive():
                    raise RuntimeError("prefetch thread stopped without finishing the epoch") from None
                continue
            if item_epoch < epoch:  # left over from an epoch the consumer broke out of
                continue
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
            if item is _END:
                return
            yield item

    def close(self) -> None:
        """Stop the producer thread and wait for it; safe to call twice."""
        producer, thread, self._thread = self._producer, self._thread, None
        if producer is not None:
            producer.stop.set()
        if thread is not None:
            thread.join(timeout=10)

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def benchmark_loaders(
    data: ImageSet, batch_size: int, *, epochs: int = 2, workers: tuple[int, ...] = (0, 2),
    schemes: tuple[str | None, ...] = (None, "int64"),
    step: Callable[[Any, torch.Tensor], None] | None = None, seed: int = 0,
) -> pd.DataFrame:
    """Images per second of the prefetching loader and torch's DataLoader on the same data.

    Every loader yields normalised float batches (or encoded ones for a scheme) of the same
    shuffled ImageSet; ``step(inputs, labels)`` simulates the training work that overlaps the
    loading (None: pure loading). DataLoader pins memory when CUDA is present.
    """
    pin = torch.cuda.is_available()
    dataset = TensorDataset(data.images, data.labels)

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([i for i, _ in items])
        return normalize(images), torch.stack([label for _, label in items])

    loaders: dict[str, Callable[[], Any]] = {}
    for w in workers:
        def make(w: int = w) -> DataLoader:
            return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=w,
                              collate_fn=collate, pin_memory=pin, persistent_workers=w > 0,
                              generator=torch.Generator().manual_seed(seed))
        loaders[f"DataLoader workers={w}"] = make
    for scheme in schemes:
        def make_prefetch(scheme: str | None = scheme) -> PrefetchLoader:
            return PrefetchLoader(data, batch_size, seed=seed, scheme=scheme, pin_memory=pin)
        loaders[f"PrefetchLoader {scheme or 'float32'}"] = make_prefetch

    rows = []
    for name, make in loaders.items():
        loader = make()
        start = time.perf_counter()  # start-up (worker processes, first batches) included
        images = 0
        for _ in range(epochs):
            for inputs, labels in loader:
                if step is not None:
                    step(inputs, labels)
                images += len(labels)
        seconds = time.perf_counter() - start
        if isinstance(loader, PrefetchLoader):
            loader.close()
        rows.append({"loader": name, "images": images, "seconds": seconds,
                     "images_per_s": images / seconds, "batch_size": batch_size,
                     "pin_memory": pin})
        del loader
    return pd.DataFrame(rows)
