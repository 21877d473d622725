"""Exploration probes, family `library`: the importable API at smoke sizes (see explore.py). A bad argument must
raise ValueError or TypeError naming the argument's value before torch fails inside; a good one must work.
Probes of `optim`, `calcgraph` and `advisor` are at the end (other helpers' modules: reported, not fixed here)."""

from __future__ import annotations

import math

import torch
from torch import nn

from explore import cases, probe, refusal, works

NAN, INF = math.nan, math.inf


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))


X = (2, 3, 8, 8)

# ------------------------------------------------------------------ checkpoint
SC_BAD = {  # keyword arguments of sc(net(), ...) -> the text the refusal names
    "segments 0": ({"segments": 0}, "0"), "segments -1": ({"segments": -1}, "-1"),
    "segments 2.5": ({"segments": 2.5}, "2.5"), "segments '2'": ({"segments": "2"}, "'2'"),
    "segments True": ({"segments": True}, "True"), "segments past the units": ({"segments": 99}, "99"),
    "segments 10**30": ({"segments": 10**30}, "1000000000000000000000000000000"),
    "budget 0": ({"memory_budget": 0}, "0"), "budget -1": ({"memory_budget": -1}, "-1"),
    "budget nan": ({"memory_budget": NAN}, "nan"), "budget inf": ({"memory_budget": INF}, "inf"),
    "budget '1GB'": ({"memory_budget": "1GB"}, "'1GB'"), "budget True": ({"memory_budget": True}, "True"),
    "budget and segments": ({"memory_budget": 10**6, "segments": 2}, "not both"),
    "strategy unknown": ({"strategy": "best"}, "'best'"), "strategy None": ({"strategy": None}, "None"),
    "strategy upper case": ({"strategy": "UNIFORM"}, "'UNIFORM'"),
    "sample of another shape": ({"strategy": "optimal", "sample": torch.randn(2, 5)}, "(2, 5)"),
    "sample not a tensor": ({"strategy": "optimal", "sample": [1, 2]}, "sample"),
    "sample of ints": ({"strategy": "optimal", "sample": torch.ones(2, 3, 8, 8, dtype=torch.long)}, "long int"),
    "budget below any plan": ({"memory_budget": 1, "strategy": "optimal", "sample": torch.randn(*X)}, "1 B"),
    "loss_fn not callable": ({"strategy": "optimal", "sample": torch.randn(*X), "loss_fn": 5}, "loss_fn"),
}


@cases("library", "sc refuses", SC_BAD)
def sc_bad(sb, case):
    from workbench.checkpoint import sc

    kwargs, needle = case
    return refusal(lambda: sc(net(), **kwargs), needle)


SC_MODELS = {"a Linear": (nn.Linear(2, 2), "nn.Sequential"), "empty": (nn.Sequential(), "empty"),
             "a list of ints": ([1, 2], "got list"), "None": (None, "None")}


@cases("library", "sc refuses the model", SC_MODELS)
def sc_model(sb, case):
    from workbench.checkpoint import sc

    model, needle = case
    return refusal(lambda: sc(model), needle)


SC_RUNS = {"batch of one": (1, 3, 8, 8), "empty batch": (0, 3, 8, 8), "odd image size": (2, 3, 9, 7)}


@cases("library", "sc trains like the model", SC_RUNS)
def sc_runs(sb, shape):
    """The same outputs as the plain model, or the same failure (a Linear that sees another width)."""
    from workbench.checkpoint import sc

    x = torch.randn(*shape)

    def outcome(model):
        try:
            y = model(x)
            y.sum().backward()
            return y.detach()
        except Exception as exc:  # noqa: BLE001
            return type(exc)

    def same():  # the wrapper may refuse earlier, naming the unit (its profile runs each unit on the sample)
        base, wrapped = outcome(net()), outcome(sc(net(), strategy="optimal"))
        if isinstance(base, type):
            return wrapped is base or wrapped is ValueError
        return isinstance(wrapped, torch.Tensor) and torch.allclose(base, wrapped)
    return works(same, lambda ok: ok is True)


PLAN_BAD = {
    "no sample": ({}, "sample"), "segments 0": ({"segments": 0, "sample": torch.randn(*X)}, "0"),
    "strategy unknown": ({"strategy": "x", "sample": torch.randn(*X)}, "'x'"),
    "budget nan": ({"memory_budget": NAN, "sample": torch.randn(*X)}, "nan"),
}


@cases("library", "plan_checkpoints refuses", PLAN_BAD)
def plan_bad(sb, case):
    from workbench.checkpoint import plan_checkpoints

    kwargs, needle = case
    return refusal(lambda: plan_checkpoints(net(), **kwargs), needle)


PROFILE_BAD = {"repeats 0": ({"repeats": 0}, "0"), "repeats 1.5": ({"repeats": 1.5}, "1.5"),
               "repeats -1": ({"repeats": -1}, "-1"), "repeats True": ({"repeats": True}, "True")}


@cases("library", "profile_layers refuses", PROFILE_BAD)
def profile_bad(sb, case):
    from workbench.checkpoint import profile_layers

    kwargs, needle = case
    return refusal(lambda: profile_layers(net(), torch.randn(*X), **kwargs), needle)


# ------------------------------------------------------------------ data
LOAD_BAD = {
    "unknown name": (("imagenet", 4, 4), {}, "'imagenet'"), "n_train 0": (("digits", 0, 4), {}, "0"),
    "n_train 2.5": (("digits", 2.5, 4), {}, "2.5"), "n_test '4'": (("digits", 4, "4"), {}, "'4'"),
    "n_train huge synthetic": (("synthetic", 10**12, 4), {}, "MAX_SYNTHETIC_BYTES"),
    "shape of two": (("synthetic", 4, 4), {"shape": (8, 8)}, "(8, 8)"),
    "shape negative": (("synthetic", 4, 4), {"shape": (1, -8, 8)}, "-8"),
    "shape a fraction": (("synthetic", 4, 4), {"shape": (1, 8.5, 8)}, "8.5"),
    "num_classes 0": (("synthetic", 4, 4), {"num_classes": 0}, "0"),
    "num_classes 2.5": (("synthetic", 4, 4), {"num_classes": 2.5}, "2.5"),
    "seed a string": (("synthetic", 4, 4), {"seed": "a"}, "'a'"),
    "seed 2**64": (("synthetic", 4, 4), {"seed": 2**64}, "18446744073709551616"),
    "digits shape too small": (("digits", 4, 4), {"shape": (1, 2, 2)}, "2"),
    "cifar10 missing": (("cifar10", 4, 4), {}, "cifar-10-batches-py"),
}


@cases("library", "load refuses", LOAD_BAD)
def load_bad(sb, case):
    import os

    from workbench.data import load

    args, kwargs, needle = case
    os.environ["WORKBENCH_DATA"] = str(sb.root / "data")
    return refusal(lambda: load(*args, **kwargs), needle, types=(ValueError, TypeError, FileNotFoundError))


@cases("library", "load works", {"digits": ("digits", 5, 3), "synthetic": ("synthetic", 5, 3),
                                  "cifar10 falls back": ("cifar10", 5, 3), "seed negative": ("synthetic", 4, 4),
                                  "seed 2**64-1": ("synthetic", 3, 2)})
def load_works(sb, args):
    import os

    from workbench.data import load

    os.environ["WORKBENCH_DATA"] = str(sb.root / "data")
    seed = {4: -1, 3: 2**64 - 1}.get(args[1], 0)
    return works(lambda: load(*args, fallback=True, seed=seed), lambda r: (len(r[0]), len(r[1])) == args[1:])


def _images(n=8):
    from workbench.data import synthetic_images
    return synthetic_images(n, (1, 8, 8))


LOADER_BAD = {
    "batch_size 0": ({"batch_size": 0}, "0"), "batch_size 2.5": ({"batch_size": 2.5}, "2.5"),
    "batch_size True": ({"batch_size": True}, "True"), "batch_size -3": ({"batch_size": -3}, "-3"),
    "max_prefetch 0": ({"batch_size": 2, "max_prefetch": 0}, "0"),
    "max_prefetch nan": ({"batch_size": 2, "max_prefetch": NAN}, "nan"),
    "scheme unknown": ({"batch_size": 2, "scheme": "int7"}, "'int7'"),
    "data not an ImageSet": ({"batch_size": 2, "data": [1, 2]}, "list"),
}


@cases("library", "PrefetchLoader refuses", LOADER_BAD)
def loader_bad(sb, case):
    from workbench.data.prefetch import PrefetchLoader

    kwargs = dict(case[0])
    data = kwargs.pop("data", None) or _images()

    def build_and_iterate():
        with PrefetchLoader(data, **kwargs) as loader:
            return next(iter(loader))
    return refusal(build_and_iterate, case[1])


@probe("library", "PrefetchLoader: a transform that raises reaches the training loop")
def loader_transform_raises(sb):
    from workbench.data.prefetch import PrefetchLoader

    def transform(images, labels):
        raise RuntimeError("transform broke at batch 0")

    def iterate():
        with PrefetchLoader(_images(), 2, transform=transform) as loader:
            list(loader)
    return refusal(iterate, "transform broke", types=(RuntimeError,))


@probe("library", "PrefetchLoader: a transform returning floats with a scheme")
def loader_transform_floats(sb):
    from workbench.data.prefetch import PrefetchLoader

    def iterate():
        with PrefetchLoader(_images(), 2, scheme="int64", transform=lambda x, y: (x.float(), y)) as loader:
            list(loader)
    return refusal(iterate, "uint8")


@probe("library", "PrefetchLoader: a sampler asking for indices past the data")
def loader_sampler_past(sb):
    from workbench.data.prefetch import PrefetchLoader

    def iterate():
        with PrefetchLoader(_images(), 2, batch_sampler=[[0, 99]]) as loader:
            list(loader)
    return refusal(iterate, "99", types=(ValueError, IndexError))


@probe("library", "PrefetchLoader: break, then a new epoch, then close twice")
def loader_epochs(sb):
    from workbench.data.prefetch import PrefetchLoader

    def run():
        loader = PrefetchLoader(_images(), 2, seed=1)
        first = [y.tolist() for _, y in loader]
        for _ in loader:
            break
        third = [y.tolist() for _, y in loader]
        loader.close()
        loader.close()
        return len(first) == 4 and len(third) == 4
    return works(run, lambda ok: ok)


SAMPLER_BAD = {"n 0": ((0, 2), {}, "0"), "batch 0": ((4, 0), {}, "0"), "n 2.5": ((2.5, 2), {}, "2.5"),
               "batch '2'": ((4, "2"), {}, "'2'"), "n True": ((True, 1), {}, "True"),
               "seed 'a'": ((4, 2), {"seed": "a"}, "'a'"), "seed 2**64": ((4, 2), {"seed": 2**64}, "2**64")}


@cases("library", "ShuffledBatchSampler refuses", SAMPLER_BAD)
def sampler_bad(sb, case):
    from workbench.data.prefetch import ShuffledBatchSampler

    args, kwargs, needle = case
    return refusal(lambda: list(ShuffledBatchSampler(*args, **kwargs)), needle)


ENCODE_BAD = {
    "floats": (lambda: torch.rand(2, 1, 4, 4), {}, "uint8"), "three dims": (lambda: torch.zeros(1, 4, 4,
                                                                                                 dtype=torch.uint8), {},
                                                                         "(1, 4, 4)"),
    "empty batch": (lambda: torch.zeros(0, 1, 4, 4, dtype=torch.uint8), {}, "(0, 1, 4, 4)"),
    "scheme unknown": (lambda: torch.zeros(2, 1, 4, 4, dtype=torch.uint8), {"scheme": "x"}, "'x'"),
    "per_element 0": (lambda: torch.zeros(2, 1, 4, 4, dtype=torch.uint8), {"per_element": 0}, "0"),
    "per_element 99": (lambda: torch.zeros(2, 1, 4, 4, dtype=torch.uint8), {"per_element": 99}, "99"),
    "per_element 2.5": (lambda: torch.zeros(2, 1, 4, 4, dtype=torch.uint8), {"per_element": 2.5}, "2.5"),
    "allow_lossy 'yes'": (lambda: torch.zeros(2, 1, 4, 4, dtype=torch.uint8), {"allow_lossy": "yes"}, "'yes'"),
}


@cases("library", "encode refuses", ENCODE_BAD)
def encode_bad(sb, case):
    from workbench.data.encode import encode

    images, kwargs, needle = case
    return refusal(lambda: encode(images(), **kwargs), needle)


@cases("library", "encode round trip", {"int64": "int64", "float32": "float32", "float64": "float64"})
def encode_round(sb, scheme):
    from workbench.data.encode import SCHEMES, decode, encode

    if scheme not in SCHEMES:
        return "ok", f"no scheme {scheme}"
    images = torch.randint(0, 256, (5, 3, 4, 4), dtype=torch.uint8)
    return works(lambda: decode(encode(images, scheme=scheme)), lambda out: torch.equal(out.to(torch.uint8), images))


AUGMENT_BAD = {"MixUp alpha 0": ("MixUp", 0, "0"), "MixUp alpha nan": ("MixUp", NAN, "nan"),
               "CutMix alpha -1": ("CutMix", -1, "-1"), "CutMix alpha 'a'": ("CutMix", "a", "'a'"),
               "MixUp alpha True": ("MixUp", True, "True"), "CutMix alpha inf": ("CutMix", INF, "inf")}


@cases("library", "augmenter refuses", AUGMENT_BAD)
def augment_bad(sb, case):
    from workbench.data import sampling

    cls, alpha, needle = case
    return refusal(lambda: getattr(sampling, cls)(alpha), needle)


SELECTIVE_BAD = {
    "negative weight": ([0, 1, 0, 1], [-0.5, 1.5], 2, {}, "-0.5"), "nan weight": ([0, 1], [NAN, 1], 2, {}, "nan"),
    "batch 0": ([0, 1], [0.5, 0.5], 0, {}, "0"), "labels empty": ([], [1.0], 2, {}, "labels"),
    "labels 2-D": ([[0, 1]], [0.5, 0.5], 2, {}, "labels"), "weights for absent classes": ([0, 0], {5: 1.0}, 2, {},
                                                                                          "5"),
}


@cases("library", "SelectiveBatchSampler refuses", SELECTIVE_BAD)
def selective_bad(sb, case):
    from workbench.data.sampling import SelectiveBatchSampler

    labels, weights, batch, kwargs, needle = case
    return refusal(lambda: list(SelectiveBatchSampler(labels, weights, batch, **kwargs)), needle)


# ------------------------------------------------------------------ measure and models
MEASURE_BAD = {
    "time_callable repeats 0": ("time_callable", (lambda: None,), {"repeats": 0}, "0"),
    "time_callable warmup -1": ("time_callable", (lambda: None,), {"warmup": -1}, "-1"),
    "time_callable repeats 2.5": ("time_callable", (lambda: None,), {"repeats": 2.5}, "2.5"),
    "time_interleaved empty": ("time_interleaved", ({},), {}, "{}"),
    "format_bytes None": ("format_bytes", (None,), {}, "None"),
    "check_device tpu": ("check_device", ("tpu",), {}, "'tpu'"),
    "check_device cuda:-1": ("check_device", ("cuda:-1",), {}, "cuda:-1"),
    "MemoryMeter device 5": ("MemoryMeter", (5,), {}, "5"),
    "calls_for sample_s -1": ("calls_for", (lambda: None, -1.0), {}, "-1"),
    "calls_for sample_s nan": ("calls_for", (lambda: None, NAN), {}, "nan"),
}


@cases("library", "measure refuses", MEASURE_BAD)
def measure_bad(sb, case):
    from workbench import measure

    name, args, kwargs, needle = case
    return refusal(lambda: getattr(measure, name)(*args, **kwargs), needle)


BUILD_BAD = {"unknown": ("resnet9", {}, "'resnet9'"), "width 0": ("resnet18", {"width": 0}, "0"),
             "width nan": ("resnet18", {"width": NAN}, "nan"), "stem unknown": ("resnet18", {"stem": "x"}, "'x'"),
             "num_classes -1": ("resnet18", {"num_classes": -1}, "-1"), "name None": (None, {}, "None"),
             "width -1": ("mobilenet_v1", {"width": -1.0}, "-1"), "in_channels 0": ("mlp", {"in_channels": 0}, "0")}


@cases("library", "build refuses", BUILD_BAD)
def build_bad(sb, case):
    from workbench.models import build

    name, kwargs, needle = case
    return refusal(lambda: build(name, **kwargs), needle)


@cases("library", "SelectiveBatchSampler works", {"relative weights": [0.9, 0.9], "one class": [0, 1.0]})
def selective_works(sb, weights):
    from workbench.data.sampling import SelectiveBatchSampler

    return works(lambda: list(SelectiveBatchSampler([0, 1, 0, 1], weights, 2)), lambda b: len(b) == 2)


@probe("library", "ShuffledBatchSampler: a seed near 2**64 at a later epoch")
def sampler_big_seed(sb):
    from workbench.data.prefetch import ShuffledBatchSampler

    sampler = ShuffledBatchSampler(10, 3, seed=2**64 - 1)
    sampler.set_epoch(10**6)
    return works(lambda: list(sampler), lambda b: sorted(i for batch in b for i in batch) == list(range(10)))
