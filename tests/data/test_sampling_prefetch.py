"""Selective batch sampling, per-class MixUp/CutMix, and the prefetching loader."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from workbench.data import ImageSet, make_loader
from workbench.data.encode import decode
from workbench.data.prefetch import PrefetchLoader, benchmark_loaders
from workbench.data.encode import DecodeLayer
from workbench.data.sampling import (
    ClassAugmenter,
    ClassImageAugmenter,
    CutMix,
    FlipCrop,
    MixUp,
    SelectiveBatchSampler,
    beta_sample,
    class_counts,
)


def imageset(n: int = 40, classes: int = 4, seed: int = 0) -> ImageSet:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=g)
    return ImageSet(images, torch.arange(n) % classes, classes, "tiny")


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0, 10), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
       batch=st.integers(1, 64))
def test_class_counts_sum_and_follow_weights(weights, batch) -> None:
    counts = class_counts(weights, batch)
    assert sum(counts) == batch and all(c >= 0 for c in counts)
    total = sum(weights)
    assert all(abs(c - w / total * batch) < 1 for c, w in zip(counts, weights, strict=True))


def test_sampler_batches_hold_requested_share() -> None:
    labels = torch.tensor([0] * 30 + [1] * 10 + [2] * 5)
    sampler = SelectiveBatchSampler(labels, {0: 0.25, 1: 0.5, 2: 0.25}, 8, seed=1, num_batches=6)
    seen = []
    for batch in sampler:
        assert Counter(labels[batch].tolist()) == {0: 2, 1: 4, 2: 2}
        seen += batch
    # class 2 has 5 examples but 12 are drawn: every one before any repeats
    twos = [i for i in seen if labels[i] == 2]
    assert set(twos[:5]) == set(range(40, 45))
    loader = DataLoader(torch.utils.data.TensorDataset(labels), batch_sampler=sampler)
    assert len(list(loader)) == 6


def test_sampler_carries_remainders_so_epoch_shares_follow_weights() -> None:
    labels = torch.arange(200) % 10
    weights = [0.05] * 10
    weights[3], weights[8] = 0.3, 0.3
    sampler = SelectiveBatchSampler(labels, weights, 16, num_batches=20, seed=0)
    counts = torch.zeros(10)
    for b, batch in enumerate(sampler, start=1):
        assert len(batch) == 16
        counts += torch.bincount(labels[batch], minlength=10)
        # every prefix of batches holds each class's share to within one example
        assert ((counts - torch.tensor(weights) * 16 * b).abs() < 1 + 1e-9).all()
    torch.testing.assert_close(counts / counts.sum(), torch.tensor(weights), rtol=0, atol=1e-6)
    assert [sum(c) for c in sampler.batch_counts()] == [16] * 20


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.floats(0, 10), min_size=1, max_size=8).filter(lambda w: sum(w) > 0.01),
       batch=st.integers(1, 32), batches=st.integers(1, 12))
# a class can fall more than one example behind (class 5 by 1.053 after 6 batches here): the bound is one way
@example(weights=[1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 0.25], batch=4, batches=6)
def test_sampler_prefix_never_a_full_example_ahead_of_its_share(weights, batch, batches) -> None:
    # the largest-deficit rule's guarantee (SelectiveBatchSampler.batch_counts): after every slot no class is
    # a full example ahead of its exact share, and since the deficits sum to zero none is n - 1 behind
    labels = torch.arange(len(weights)).repeat(4)
    sampler = SelectiveBatchSampler(labels, weights, batch, num_batches=batches)
    total = sum(weights)
    given = [0] * len(weights)
    for b, counts in enumerate(sampler.batch_counts(), start=1):
        assert sum(counts) == batch and min(counts) >= 0
        given = [g + c for g, c in zip(given, counts, strict=True)]
        ahead = [g - w / total * batch * b for g, w in zip(given, weights, strict=True)]
        assert max(ahead) < 1 + 1e-9
        assert min(ahead) > -(len(weights) - 1) - 1e-9


@pytest.mark.parametrize("alpha", [0.05, 0.4, 1.0, 16.0, 100.0, 1e4])
def test_beta_sample_any_alpha(alpha) -> None:
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([beta_sample(alpha, g) for _ in range(400)], dtype=torch.float64)
    assert ((draws >= 0) & (draws <= 1)).all()
    var = 1 / (4 * (2 * alpha + 1))
    assert abs(draws.mean().item() - 0.5) < 5 * (var / 400) ** 0.5 + 1e-9
    assert 0.6 * var < draws.var().item() < 1.5 * var
    mix = MixUp(alpha)  # used to hang for alpha >= 16
    out, _ = mix(torch.zeros(1, 1, 2, 2), torch.tensor([[1.0, 0.0]]), torch.ones(1, 1, 2, 2),
                 torch.tensor([[0.0, 1.0]]), torch.Generator().manual_seed(1))
    assert out.shape == (1, 1, 2, 2)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True])
def test_beta_and_mix_refuse_bad_alpha(bad) -> None:
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        MixUp(bad)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        beta_sample(bad, torch.Generator())


def test_sampler_is_deterministic_per_epoch() -> None:
    labels = torch.arange(50) % 5
    a = SelectiveBatchSampler(labels, [1] * 5, 10, seed=3)
    b = SelectiveBatchSampler(labels, [1] * 5, 10, seed=3)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first


@pytest.mark.parametrize("weights, match", [
    ([1, 1], "one weight per class"),
    ([-1, 1, 1], ">= 0"),
    ([float("nan"), 1, 1], "finite"),
    ({5: 1.0}, r"keys must be in \[0, 3\)"),
])
def test_sampler_refuses_bad_weights(weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        SelectiveBatchSampler(torch.tensor([0, 1, 2]), weights, 2)


def test_sampler_refuses_weight_on_empty_class() -> None:
    with pytest.raises(ValueError, match=r"classes \[1\]"):
        SelectiveBatchSampler(torch.tensor([0, 0, 2]), [1, 1, 1], 3)


@pytest.mark.parametrize("hook", [MixUp(0.4), CutMix(1.0)])
def test_augment_touches_only_chosen_class(hook) -> None:
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(16) % 4
    aug = ClassAugmenter({2: hook}, 4, seed=0)
    out, targets = aug(images, labels)
    other = labels != 2
    torch.testing.assert_close(out[other], images[other].float())
    torch.testing.assert_close(targets[other], torch.nn.functional.one_hot(labels[other], 4).float())
    torch.testing.assert_close(targets.sum(1), torch.ones(16))
    assert (targets[labels == 2, 2] > 0).all()
    out2, targets2 = ClassAugmenter({2: hook}, 4, seed=0)(images, labels)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(targets2, targets)


def test_cutmix_label_weight_is_pasted_area() -> None:
    x = torch.zeros(1, 1, 10, 10)
    px = torch.ones(1, 1, 10, 10)
    t, pt = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    for seed in range(5):
        out, tt = CutMix(1.0)(x, t, px, pt, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(tt[0, 1], out.mean())


def test_mixup_is_convex_combination() -> None:
    x, px = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    t, pt = torch.tensor([[1.0, 0.0]] * 2), torch.tensor([[0.0, 1.0]] * 2)
    out, tt = MixUp(0.4)(x, t, px, pt, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, (1 - tt[:, 0]).view(2, 1, 1, 1).expand_as(out))


def test_prefetch_matches_plain_batches_and_is_seeded() -> None:
    data = imageset()
    with PrefetchLoader(data, 8, shuffle=False) as loader:
        ours = [(x, y) for x, y in loader]
    plain = list(make_loader(data, 8, shuffle=False))
    assert len(ours) == len(plain) == 5
    for (x, y), (px, py) in zip(ours, plain, strict=True):
        torch.testing.assert_close(x, px)
        torch.testing.assert_close(y, py)
    with PrefetchLoader(data, 8, seed=4, scheme="int64") as a, \
            PrefetchLoader(data, 8, seed=4, scheme="int64") as b:
        epochs = []
        for _ in range(2):  # two epochs, read ahead by the thread
            ea, eb = list(a), list(b)
            assert [y.tolist() for _, y in ea] == [y.tolist() for _, y in eb]
            for (xa, _), (xb, _) in zip(ea, eb, strict=True):
                torch.testing.assert_close(xa.data, xb.data)
            epochs.append(torch.cat([y for _, y in ea]))
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled per epoch
    for e in epochs:
        torch.testing.assert_close(e.sort().values, data.labels.sort().values)


def test_prefetch_encoded_batches_decode_to_the_images() -> None:
    data = imageset()
    with PrefetchLoader(data, 8, shuffle=False, scheme="float64") as loader:
        for i, (enc, _) in enumerate(loader):
            torch.testing.assert_close(decode(enc), data.images[i * 8:(i + 1) * 8])


def test_prefetch_early_break_then_next_epoch_is_whole() -> None:
    data = imageset()
    loader = PrefetchLoader(data, 8, seed=0, max_prefetch=2)
    for _ in loader:
        break
    assert len(list(loader)) == 5
    loader.close()


def test_prefetch_raises_in_training_thread_and_stops() -> None:
    data = imageset()
    calls = []

    def broken(images, labels):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise ZeroDivisionError("bad batch 3")
        return images.float(), labels

    loader = PrefetchLoader(data, 8, transform=broken)
    got = []
    with pytest.raises(ZeroDivisionError, match="bad batch 3"):
        for batch in loader:
            got.append(batch)
    assert len(got) == 2 and calls[0] == "workbench-prefetch"
    assert loader._thread is None


def test_prefetch_close_joins_thread_with_full_queue() -> None:
    loader = PrefetchLoader(imageset(), 4, max_prefetch=1)
    it = iter(loader)
    next(it)
    thread = loader._thread
    loader.close()
    assert not thread.is_alive()
    loader.close()


def test_prefetch_with_selective_sampler() -> None:
    data = imageset()
    sampler = SelectiveBatchSampler(data.labels, [0.5, 0.5, 0, 0], 6, seed=0)
    with PrefetchLoader(data, 6, batch_sampler=sampler) as loader:
        for _, y in loader:
            assert set(y.tolist()) == {0, 1}
        assert len(loader) == len(sampler)


def test_prefetch_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        PrefetchLoader(imageset(), 0)
    loader = PrefetchLoader(imageset(), 4, scheme="int64", transform=lambda x, y: (x.float(), y))
    with pytest.raises(TypeError, match="uint8 images to encode"):
        next(iter(loader))
    loader.close()


def test_sbs_with_encoding_matches_unencoded() -> None:
    """The paper's pipeline: per-class uint8 augmentation, encode, decode, then MixUp/CutMix."""
    data = imageset(n=48)

    def run(scheme):
        sampler = SelectiveBatchSampler(data.labels, [0.5, 0.25, 0.125, 0.125], 8, seed=2)
        before = ClassImageAugmenter({1: FlipCrop(padding=1)}, 4, seed=3)
        after = ClassAugmenter({2: MixUp(0.4), 3: CutMix(1.0)}, 4, seed=4)
        out = []
        with PrefetchLoader(data, 8, batch_sampler=sampler, transform=before, scheme=scheme) as loader:
            for x, y in loader:
                out.append(after(DecodeLayer()(x), y))
        return out

    encoded, plain = run("int64"), run(None)
    assert len(encoded) == len(plain) == 6
    for (x, t), (px, pt) in zip(encoded, plain, strict=True):
        torch.testing.assert_close(x, px, rtol=0, atol=0)
        torch.testing.assert_close(t, pt, rtol=0, atol=0)


def test_class_image_augmenter_touches_only_its_class_and_keeps_uint8() -> None:
    images = torch.randint(0, 256, (12, 3, 6, 6), dtype=torch.uint8)
    labels = torch.arange(12) % 3
    out, same = ClassImageAugmenter({1: FlipCrop(padding=2)}, 3, seed=0)(images, labels)
    assert out.dtype == torch.uint8 and same is labels
    torch.testing.assert_close(out[labels != 1], images[labels != 1], rtol=0, atol=0)
    with pytest.raises(TypeError, match="uint8"):
        ClassImageAugmenter({1: FlipCrop()}, 3)(images.float(), labels)
    with pytest.raises(ValueError, match="padding"):
        FlipCrop(padding=-1)


def test_benchmark_loaders_rows() -> None:
    df = benchmark_loaders(imageset(), 8, epochs=1, workers=(0,), schemes=(None,))
    assert list(df.loader) == ["DataLoader workers=0", "PrefetchLoader float32"]
    assert (df.images == 40).all() and (df.images_per_s > 0).all()


def test_prefetch_prepares_next_epoch_while_current_is_consumed() -> None:
    import time

    with PrefetchLoader(imageset(), 8) as loader:
        list(loader)  # epoch 0 consumed; the thread goes on with epoch 1
        deadline = time.monotonic() + 10
        while loader._producer.queue.qsize() < len(loader) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader._producer.queue.qsize() == len(loader) + 1  # all of epoch 1 and its end marker
        assert len(list(loader)) == len(loader)
