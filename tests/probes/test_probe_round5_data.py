"""Hostile inputs, round 5 (issue 43), data family: `workbench.data` datasets, loaders, encoders, samplers and
augmenters given bad types, NaN/inf, negative, zero or huge sizes, wrong shapes, strings for numbers and bools
for ints; each refused naming the argument and the value, before any work.

Found by this round and fixed here: `load('synthetic', num_classes=10**12)` asked torch for 64 TB (a raw
RuntimeError); `load(fallback='no')`, `make_loader(shuffle='no')`, `ShuffledBatchSampler(shuffle='no')`,
`PrefetchLoader(pin_memory='no')` and `FlipCrop(flip='no')` were taken as True; `set_epoch(-1)`, `('a')`, `(1.5)` were
kept; `normalize` of a list or to an integer or str dtype, `make_loader`/`ImageSet` given a list or a tensor, and
`ClassAugmenter` given a list of hooks, string keys or float labels ended in AttributeError, RuntimeError or a
comparison TypeError; a hook that cannot be called and `num_classes=2.5` were kept until the first batch;
`PrefetchLoader(scheme='int32')`, `transform=5` and a sampler's index past the data failed only in the producer
thread (IndexError); `capacity_study(max_per_element=0)` returned an empty table and `schemes='int64'` was read
letter by letter; `DecodeLayer(dtype=torch.int64)` was kept; `FlipCrop(padding=10**9)` padded by 10**9; the readers
said "not found ... download it" for a root that is a file, a pipe or a link loop, or holds a NUL byte.
"""

from __future__ import annotations

import os

import pytest
import torch
from probe_cases import refused

from workbench.data import ImageSet, load, load_cifar10, load_mnist, make_loader, synthetic_images
from workbench.data.datasets import load_digits, normalize
from workbench.data.encode import DecodeLayer, capacity_study, decode, encode
from workbench.data.prefetch import PrefetchLoader, ShuffledBatchSampler
from workbench.data.readers import load_cifar100
from workbench.data.sampling import (
    ClassAugmenter, ClassImageAugmenter, CutMix, FlipCrop, MixUp, SelectiveBatchSampler, beta_sample, class_counts,
)

NAN, INF = float("nan"), float("inf")
U8 = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)


@pytest.fixture(scope="module")
def images():
    return synthetic_images(8, (1, 8, 8))




# ------------------------------------------------------------------ load


@pytest.mark.parametrize("args, kw, needles", [
    (("imagenet", 10, 5), {}, ["dataset", "'imagenet'", "synthetic"]), ((None, 10, 5), {}, ["dataset", "None"]),
    (("digits", 0, 5), {}, ["n_train", "0"]), (("digits", -1, 5), {}, ["n_train", "-1"]),
    (("digits", 10, NAN), {}, ["n_test", "nan"]), (("digits", INF, 5), {}, ["n_train", "inf"]),
    (("digits", 10**9, 5), {}, ["1797", "1000000000"]),
    (("synthetic", 4, 2), {"shape": (8, 8)}, ["shape=(8, 8)", "(C, H, W)"]),
    (("synthetic", 4, 2), {"shape": "1x8x8"}, ["shape='1x8x8'"]),
    (("synthetic", 4, 2), {"shape": (1, 0, 8)}, ["shape=(1, 0, 8)"]),
    (("synthetic", 4, 2), {"shape": (1, -8, 8)}, ["shape=(1, -8, 8)"]),
    (("synthetic", 4, 2), {"shape": (1, 8.0, 8)}, ["shape=(1, 8.0, 8)"]),
    (("synthetic", 4, 2), {"shape": (True, 8, 8)}, ["shape=(True, 8, 8)"]),
    (("digits", 4, 2), {"shape": (2, 8, 8)}, ["shape=(2, 8, 8)", "1 or 3 channels"]),
    (("digits", 4, 2), {"shape": (1, 8, 16)}, ["shape=(1, 8, 16)", "H must equal W"]),
    (("synthetic", 4, 2), {"num_classes": 0}, ["num_classes", "0"]),
    (("synthetic", 4, 2), {"num_classes": 2.5}, ["num_classes", "2.5"]),
    (("synthetic", 4, 2), {"num_classes": 10**12}, ["num_classes=1000000000000", "MAX_SYNTHETIC_BYTES"]),
    (("synthetic", 4, 2), {"fallback": "no"}, ["fallback", "'no'"]),
    (("synthetic", 4, 2), {"seed": None}, ["seed", "None"]),
    (("synthetic", 4, 2), {"seed": -2**63 - 1}, ["seed", str(-2**63 - 1)]),
])
def test_load_refuses_naming_the_argument(args, kw, needles):
    refused(lambda: load(*args, **kw), needles)


@pytest.mark.parametrize("args, kw, needles", [
    ((0, (1, 8, 8)), {}, ["n", "0"]), ((-1, (1, 8, 8)), {}, ["n", "-1"]), ((NAN, (1, 8, 8)), {}, ["n", "nan"]),
    ((4, None), {}, ["shape", "None"]), ((4, (1, 1, 8, 8)), {}, ["shape", "(1, 1, 8, 8)"]),
    ((4, (0, 8, 8)), {}, ["shape", "(0, 8, 8)"]), ((4, (1, 8, 8)), {"noise": -1.0}, ["noise", "-1.0"]),
    ((4, (1, 8, 8)), {"noise": INF}, ["noise", "inf"]), ((4, (1, 8, 8)), {"noise": "0.3"}, ["noise", "'0.3'"]),
    ((4, (1, 8, 8), 1), {}, ["num_classes", "1"]), ((4, (1, 8, 8), -3), {}, ["num_classes", "-3"]),
    ((4, (3, 64, 64), 10**9), {}, ["num_classes=1000000000", "MAX_SYNTHETIC_BYTES"]),
])
def test_synthetic_images_refuses_naming_the_argument(args, kw, needles):
    refused(lambda: synthetic_images(*args, **kw), needles)


@pytest.mark.parametrize("size, channels, needles", [
    (0, 1, ["size", "4..512", "0"]), (3, 1, ["size", "3"]), (513, 1, ["size", "513"]), (NAN, 1, ["size", "nan"]),
    (True, 1, ["size", "True"]), (8, 2, ["channels", "2"]), (8, 0, ["channels", "0"]), (8, "3", ["channels"]),
])
def test_load_digits_refuses_sizes_and_channels(size, channels, needles):
    refused(lambda: load_digits(size, channels), needles)


# ------------------------------------------------------------------ ImageSet, normalize, make_loader


@pytest.mark.parametrize("images_, labels, classes, name, needles", [
    (torch.zeros(2, 1, 4, 4), torch.tensor([0, 1]), 2, "x", ["uint8", "float32"]),
    (torch.zeros(2, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), 2, "x", ["[N, C, H, W]", "(2, 4, 4)"]),
    ([[0]], torch.tensor([0, 1]), 2, "x", ["images", "list"]),
    (U8, [0, 1], 2, "x", ["labels", "list"]),
    (U8, torch.tensor([0]), 2, "x", ["labels must be [2]", "(1,)"]),
    (U8, torch.tensor([[0], [1]]), 2, "x", ["labels must be [2]", "(2, 1)"]),
    (U8, torch.tensor([0, 0]), 0, "x", ["num_classes", "0"]),
    (U8, torch.tensor([0, 1]), "2", "x", ["num_classes", "'2'"]),
    (U8, torch.tensor([True, False]), 2, "x", ["labels", "torch.bool"]),
    (U8, torch.tensor([0, 1]), 2, 5, ["name", "5"]),
])
def test_imageset_refuses_what_is_not_a_set_of_images(images_, labels, classes, name, needles):
    refused(lambda: ImageSet(images_, labels, classes, name), needles)


@pytest.mark.parametrize("value, kw, needles", [
    ([1, 2], {}, ["normalize", "list"]), (torch.zeros(2), {}, ["uint8", "float32"]),
    (U8, {"dtype": torch.int32}, ["dtype", "torch.int32"]), (U8, {"dtype": "float32"}, ["dtype", "'float32'"]),
])
def test_normalize_refuses_what_it_cannot_scale(value, kw, needles):
    refused(lambda: normalize(value, **kw), needles, types=(TypeError,))


@pytest.mark.parametrize("arg, kw, needles", [
    ("imgs", {}, ["imageset", "str"]), (torch.zeros(4, 1, 8, 8), {}, ["imageset", "Tensor"]),
    (None, {"batch_size": 0}, ["batch_size", "0"]), (None, {"batch_size": -1}, ["batch_size", "-1"]),
    (None, {"batch_size": True}, ["batch_size", "True"]), (None, {"batch_size": NAN}, ["batch_size", "nan"]),
    (None, {"shuffle": "no"}, ["shuffle", "'no'"]), (None, {"normalize": "no"}, ["normalize", "'no'"]),
    (None, {"drop_last": "yes"}, ["drop_last", "'yes'"]), (None, {"seed": "a"}, ["seed", "'a'"]),
])
def test_make_loader_refuses_naming_the_argument(images, arg, kw, needles):
    args = {"batch_size": 2, **kw}
    refused(lambda: make_loader(images if arg is None else arg, **args), needles)


# ------------------------------------------------------------------ encode, decode


@pytest.mark.parametrize("value, kw, needles", [
    (U8, {"scheme": "int32"}, ["scheme", "'int32'"]), (U8, {"scheme": None}, ["scheme", "None"]),
    (U8, {"per_element": 0}, ["per_element=0"]), (U8, {"per_element": 9}, ["per_element=9"]),
    (U8, {"per_element": -1}, ["per_element=-1"]),
    (U8, {"scheme": "float32", "per_element": 65, "allow_lossy": True}, ["per_element", "65"]),
    (U8, {"per_element": 2.0}, ["per_element", "2.0"]), (U8, {"per_element": True}, ["per_element", "True"]),
    (U8, {"allow_lossy": "yes"}, ["allow_lossy", "'yes'"]), (torch.zeros(2, 1, 4, 4), {}, ["uint8", "float32"]),
    (torch.zeros(2, 4, 4, dtype=torch.uint8), {}, ["[B, C, H, W]", "(2, 4, 4)"]),
    (torch.zeros(0, 1, 4, 4, dtype=torch.uint8), {}, ["B >= 1", "(0, 1, 4, 4)"]), ([[1]], {}, ["images", "list"]),
    (torch.zeros(2, 1, 4, 4, dtype=torch.long), {}, ["uint8", "int64"]),
])
def test_encode_refuses_naming_the_argument(value, kw, needles):
    refused(lambda: encode(value, **kw), needles)


@pytest.mark.parametrize("value", [U8, None, "batch"])
def test_decode_refuses_what_encode_did_not_make(value):
    refused(lambda: decode(value), ["EncodedBatch", type(value).__name__], types=(TypeError,))


@pytest.mark.parametrize("dtype", [torch.int64, "float32", torch.bool, None])
def test_decode_layer_refuses_a_dtype_that_is_not_floating(dtype):
    refused(lambda: DecodeLayer(dtype=dtype), ["DecodeLayer", "dtype", repr(dtype)], types=(TypeError,))


@pytest.mark.parametrize("kw, needles", [
    ({"max_per_element": 0}, ["max_per_element", "0"]), ({"max_per_element": -1}, ["max_per_element", "-1"]),
    ({"max_per_element": 1.5}, ["max_per_element", "1.5"]), ({"max_per_element": 65}, ["max_per_element", "65"]),
    ({"schemes": ("nosuch",)}, ["schemes", "'nosuch'"]), ({"schemes": "int64"}, ["schemes", "'int64'"]),
    ({"schemes": ()}, ["schemes", "()"]),
])
def test_capacity_study_refuses_before_an_empty_or_misread_table(kw, needles):
    refused(lambda: capacity_study(U8, **kw), needles)


# ------------------------------------------------------------------ loaders and samplers


@pytest.mark.parametrize("kw, needles", [
    ({"batch_size": 0}, ["batch_size", "0"]), ({"batch_size": NAN}, ["batch_size", "nan"]),
    ({"batch_size": "2"}, ["batch_size", "'2'"]), ({"scheme": "int32"}, ["scheme", "'int32'"]),
    ({"batch_sampler": "all"}, ["batch_sampler", "str"]), ({"batch_sampler": 5}, ["batch_sampler", "int"]),
    ({"transform": 5}, ["transform", "5"]), ({"max_prefetch": 0}, ["max_prefetch", "0"]),
    ({"max_prefetch": -1}, ["max_prefetch", "-1"]), ({"pin_memory": "no"}, ["pin_memory", "'no'"]),
    ({"shuffle": "no"}, ["shuffle", "'no'"]), ({"drop_last": "no"}, ["drop_last", "'no'"]),
    ({"seed": 1.5}, ["seed", "1.5"]),
])
def test_prefetch_loader_refuses_before_its_thread_starts(images, kw, needles):
    args = {"batch_size": 2, **kw}
    refused(lambda: PrefetchLoader(images, **args), needles)


@pytest.mark.parametrize("batches, needles", [([[0, 99]], ["99", "8 examples"]), ([[0, -9]], ["-9"]),
                                              ([[0.5, 1.0]], ["int indices"])])
def test_prefetch_loader_names_a_sampler_index_past_the_data(images, batches, needles):
    def iterate():
        with PrefetchLoader(images, 2, batch_sampler=batches) as loader:
            list(loader)
    refused(iterate, needles, types=(ValueError,))


@pytest.mark.parametrize("args, kw, needles", [
    ((0, 2), {}, ["n", "0"]), ((-1, 2), {}, ["n", "-1"]), ((4, 0), {}, ["batch_size", "0"]),
    ((4, NAN), {}, ["batch_size", "nan"]), ((4, 2), {"shuffle": "no"}, ["shuffle", "'no'"]),
    ((4, 2), {"drop_last": "no"}, ["drop_last", "'no'"]), ((4, 2), {"seed": NAN}, ["seed", "nan"]),
])
def test_shuffled_sampler_refuses_naming_the_argument(args, kw, needles):
    refused(lambda: ShuffledBatchSampler(*args, **kw), needles)


@pytest.mark.parametrize("epoch", [-1, 1.5, "a", None, True])
def test_set_epoch_refuses_what_is_not_an_epoch(epoch):
    sampler = ShuffledBatchSampler(4, 2)
    refused(lambda: sampler.set_epoch(epoch), ["epoch", repr(epoch)])
    assert sorted(i for b in sampler for i in b) == [0, 1, 2, 3]  # still a whole epoch


@pytest.mark.parametrize("labels, weights, batch, kw, needles", [
    ([0, 1], [1, 1], 0, {}, ["batch_size", "0"]), ([0, 1], [1, 1], -1, {}, ["batch_size", "-1"]),
    ([0, 1], [NAN, 1], 2, {}, ["class_weights", "nan"]), ([0, 1], [INF, 1], 2, {}, ["class_weights", "inf"]),
    ([0, 1], [-1, 1], 2, {}, ["class_weights", "-1"]), ([0, 1], [0, 0], 2, {}, ["class_weights", "[0, 0]"]),
    ([0, 1], [1], 2, {}, ["class_weights", "(2)", "1"]), ([0, 1], None, 2, {}, ["class_weights", "None"]),
    ([], [1], 2, {}, ["labels", "(0,)"]), ("01", [1, 1], 2, {}, ["labels", "'01'"]),
    ([[0, 1]], [1, 1], 2, {}, ["labels", "(1, 2)"]), ([0, 1], [1, 1], 2, {"num_batches": 0}, ["num_batches", "0"]),
    ([0, 1], [1, 1], 2, {"seed": "a"}, ["seed", "'a'"]), ([0, 1], {"a": 1.0}, 2, {}, ["class_weights", "'a'"]),
    ([0, 1], {0: NAN}, 2, {}, ["class_weights", "nan"]), ([0, 1], "11", 2, {}, ["class_weights", "'11'"]),
])
def test_selective_sampler_refuses_naming_the_argument(labels, weights, batch, kw, needles):
    refused(lambda: SelectiveBatchSampler(labels, weights, batch, **kw), needles)


@pytest.mark.parametrize("weights, batch, needles", [
    ([1, 1], 0, ["batch_size", "0"]), ([-1, 1], 4, ["class_weights", "-1"]), ([NAN, 1], 4, ["class_weights", "nan"]),
    ([], 4, ["class_weights", "[]"]), ("ab", 4, ["class_weights", "'a'"]),
])
def test_class_counts_refuses_naming_the_argument(weights, batch, needles):
    refused(lambda: class_counts(weights, batch), needles)


# ------------------------------------------------------------------ augmenters


@pytest.mark.parametrize("make, alpha", [(MixUp, 0), (MixUp, -1), (MixUp, NAN), (MixUp, INF), (MixUp, "1"),
                                         (MixUp, True), (CutMix, 0), (CutMix, NAN), (CutMix, "x")])
def test_mixers_refuse_an_alpha_outside_their_range(make, alpha):
    refused(lambda: make(alpha), ["alpha", "> 0", repr(alpha)])


@pytest.mark.parametrize("alpha, beta, needles", [(0, None, ["alpha", "0"]), (1.0, -1.0, ["beta", "-1.0"]),
                                                  (NAN, None, ["alpha", "nan"])])
def test_beta_sample_refuses_bad_parameters(alpha, beta, needles):
    refused(lambda: beta_sample(alpha, torch.Generator(), beta=beta), needles)


@pytest.mark.parametrize("hooks, classes, needles", [
    ([MixUp()], 4, ["hooks", "list"]), ({9: MixUp()}, 4, ["[0, 4)", "[9]"]), ({-1: MixUp()}, 4, ["[-1]"]),
    ({"a": MixUp()}, 4, ["['a']"]), ({0: 5}, 4, ["callable", "5"]), ({0: MixUp()}, 0, ["num_classes", "0"]),
    ({0: MixUp()}, 2.5, ["num_classes", "2.5"]), ({True: MixUp()}, 4, ["[True]"]),
])
def test_class_augmenter_refuses_bad_hooks_when_made(hooks, classes, needles):
    refused(lambda: ClassAugmenter(hooks, classes), needles)


@pytest.mark.parametrize("images_, labels, needles", [
    (torch.zeros(2, 1, 4, 4), torch.tensor([0.0, 1.0]), ["labels", "integer"]),
    (torch.zeros(2, 1, 4, 4), torch.tensor([0, 1, 2]), ["2 images", "3 labels"]),
    ([1, 2], torch.tensor([0, 1]), ["images", "list"]),
    (torch.zeros(2, 1, 4, 4), [0, 1], ["labels", "list"]),
    (torch.zeros(2, 1, 4, 4), torch.tensor([0, 7]), ["0..3", "0..7"]),
])
def test_class_augmenter_names_a_bad_batch(images_, labels, needles):
    refused(lambda: ClassAugmenter({0: MixUp()}, 4)(images_, labels), needles)


@pytest.mark.parametrize("kw, needles", [({"padding": -1}, ["padding", "-1"]), ({"padding": 1.5}, ["padding", "1.5"]),
                                         ({"padding": "2"}, ["padding", "'2'"]), ({"flip": "no"}, ["flip", "'no'"])])
def test_flip_crop_refuses_naming_the_argument(kw, needles):
    refused(lambda: FlipCrop(**kw), needles)


def test_flip_crop_refuses_padding_past_the_image_before_allocating():
    refused(lambda: FlipCrop(padding=10**9)(U8, torch.Generator()), ["padding=1000000000", "4 x 4"])
    assert FlipCrop(padding=4)(U8, torch.Generator()).shape == U8.shape  # up to the image's size


@pytest.mark.parametrize("hooks, classes, needles", [({9: FlipCrop()}, 4, ["[9]"]), ({0: 5}, 4, ["callable", "5"]),
                                                     ({0: FlipCrop()}, -1, ["num_classes", "-1"]),
                                                     ("flip", 4, ["hooks", "str"])])
def test_class_image_augmenter_refuses_bad_hooks_when_made(hooks, classes, needles):
    refused(lambda: ClassImageAugmenter(hooks, classes), needles)


def test_the_good_calls_still_answer(images):
    assert len(list(make_loader(images, 4, shuffle=False))) == 2
    with PrefetchLoader(images, 4, batch_sampler=[[0, 1], [2, 3]]) as loader:
        assert [len(labels) for _, labels in loader] == [2, 2]
    assert ClassImageAugmenter({None: FlipCrop()}, 10)(images.images, images.labels)[0].shape == images.images.shape
    mixed, targets = ClassAugmenter({0: MixUp()}, 10)(images.images.float(), images.labels)
    assert mixed.shape == images.images.shape and targets.shape == (8, 10)
    assert len(capacity_study(U8, schemes=("int64",), max_per_element=2)) == 2


# ------------------------------------------------------------------ the readers' root folder


ROOTS = {
    "a regular file": (lambda t: (t / "F").write_text("mine"), "F", ValueError, ["is not a folder"]),
    "a named pipe": (lambda t: os.mkfifo(t / "Q"), "Q", ValueError, ["is not a folder"]),
    "a link loop": (lambda t: (t / "L").symlink_to(t / "L"), "L", ValueError, ["Too many levels of symbolic links"]),
    "a NUL byte": (None, "a\0b", ValueError, ["NUL byte"]),
    "a name too long": (None, "x" * 300, ValueError, ["File name too long"]),
    "a number": (None, 5, TypeError, ["root", "5"]),
    "a file where the set's folder goes": (lambda t: (t / "R").mkdir(), "R/SUB", ValueError, ["is not a folder"]),
}


@pytest.mark.parametrize("reader, sub", [(load_cifar10, "cifar-10-batches-py"), (load_cifar100, "cifar-100-python"),
                                         (load_mnist, "mnist")])
@pytest.mark.parametrize("case", sorted(ROOTS))
def test_a_root_that_cannot_hold_the_data_is_named_not_reported_missing(tmp_path, reader, sub, case):
    """Each was "... not found at <root>/...: Download it yourself and place it there" (a NUL byte shown as a
    space), or a raw OSError (a name too long) or TypeError ("expected str, bytes or os.PathLike object")."""
    setup, root, kind, needles = ROOTS[case]
    if setup is not None:
        setup(tmp_path)
    if root == "R/SUB":
        (tmp_path / "R" / sub).write_text("mine")
        root = "R"
    given = str(tmp_path / root) if isinstance(root, str) else root
    before = sorted(p.name for p in tmp_path.rglob("*"))
    message = refused(lambda: reader(given), needles, types=(kind,))
    assert "Download it yourself" not in message and "root" in message, message
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
