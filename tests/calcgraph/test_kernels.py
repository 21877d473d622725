"""A plan's fake tensors take each op's meta kernel over its Python decomposition, and keep their dispatch cache
from trace to trace (`calcgraph.kernels`, issue 45): the same traces as torch's own `FakeTensorMode`, except BatchNorm's
saved statistics under autocast and an LSTM backward's first call, where they now agree with the kernel that runs
(checked against real runs, not against either fake path), and the same traces on a cold cache and on a warm one."""

import contextlib
import functools
import itertools

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from workbench.calcgraph import kernels, tracker, training_program
from workbench.calcgraph.tracker import _trace
from workbench.calcgraph.zoo import ZOO, case_program
from workbench.optim import PackedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")
BATCH_NORM = "native_batch_norm.default"
LSTM_BACKWARD = "mkldnn_rnn_layer_backward.default"


def _traced(program, mode=None, monkeypatch=None, device: str = "cpu"):
    if mode is not None:
        monkeypatch.setattr(tracker, "_fake_mode", lambda _device: mode)
    return _trace(program, device=torch.device(device))


def _cnn(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(1), nn.Linear(8 * 6 * 6, 5)).to(dtype)


PROGRAMS = {
    "cnn fp32": functools.partial(training_program, _cnn, (3, 6, 6), 3),
    "cnn autocast bf16": functools.partial(training_program, _cnn, (3, 6, 6), 3, autocast=torch.bfloat16),
    "cnn bf16 weights": functools.partial(training_program, functools.partial(_cnn, torch.bfloat16), (3, 6, 6), 3,
                                          input_dtype=torch.bfloat16,
                                          optimizer=lambda params: PackedAdamW(params, extra_bits=8, seed=0)),
    **{f"zoo {name}": functools.partial(case_program(case), 3) for name, case in ZOO.items()},
}


def _from(trace, phase: str) -> tuple:
    """The events of `trace` from the mark of `phase` on, each allocation by its op and size."""
    return tuple((trace.info[e]["op"], int(trace.sizes[e])) if e >= 0 else "free"
                 for e in trace.events[trace.marks[phase]:])


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_trace_equals_torchs_fake_tensors_but_where_those_differ_from_the_kernels(name, monkeypatch):
    program = lambda annotate: PROGRAMS[name](annotate=annotate)  # noqa: E731
    ours = _traced(program)
    torchs = _traced(program, FakeTensorMode, monkeypatch)
    if name == "zoo lstm":
        # torch's step 1 ran the LSTM backward's meta kernel, which returns its two bias gradients as one tensor (and
        # autograd then copied it), its step 2 the cached call, which returns two as the CPU kernel does: ours makes
        # two in both steps, so both our steps are torch's step 2
        assert _from(ours, "step2") == _from(torchs, "step2") and _from(ours, "step1") != _from(torchs, "step1")
        return
    assert ours.signature == torchs.signature, name
    differ = np.nonzero(ours.sizes != torchs.sizes)[0]
    calls = {ours.keys[i][0] for i in range(len(ours.keys)) if ours.keys[i] != torchs.keys[i]}
    if name == "cnn autocast bf16":  # each BatchNorm's two saved statistics of 8 channels, in each of two steps
        assert {ours.info[i]["op"] for i in differ} == {BATCH_NORM} and len(differ) == 2 * 2 * 2
        assert set(ours.sizes[differ]) == {32} and set(torchs.sizes[differ]) == {16}
        assert calls == {"native_batch_norm_backward.default"}  # which takes them
    else:
        assert len(differ) == 0, [(ours.info[i]["op"], ours.sizes[i], torchs.sizes[i]) for i in differ]
        assert not calls


@pytest.mark.parametrize("name, op", [("cnn fp32", BATCH_NORM), ("cnn autocast bf16", BATCH_NORM),
                                      ("cnn bf16 weights", BATCH_NORM), ("zoo lstm", LSTM_BACKWARD)])
def test_where_torchs_fake_tensors_differ_ours_are_the_real_kernels(name, op):
    program = lambda annotate: PROGRAMS[name](annotate=annotate)  # noqa: E731
    fake, real = _traced(program), _trace(program, fake=False)

    def made_by(trace) -> list[int]:
        return [int(trace.sizes[i]) for i, info in enumerate(trace.info) if info["op"] == op]
    assert made_by(fake) == made_by(real) != []


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_trace_on_a_warm_cache_equals_one_on_a_cold_cache(name, monkeypatch):
    """Traces keep this process's dispatch cache from one to the next (`kernels.plan_cache`): every op found there
    must give what it gave when run (an LSTM's backward did not, until a call whose outputs share a storage was
    dispatched again, `PlanFakeTensorMode._cached_dispatch_impl`)."""
    program = lambda annotate: PROGRAMS[name](annotate=annotate)  # noqa: E731
    monkeypatch.setattr(kernels, "_CACHE", {})
    cold = _traced(program)
    assert len(kernels._CACHE) > 0
    warm = _traced(program)  # every op call the cold trace cached is found now
    assert warm.signature == cold.signature and warm.keys == cold.keys, name
    np.testing.assert_array_equal(warm.sizes, cold.sizes, err_msg=name)


def test_a_trace_leaves_no_entry_in_torchs_dispatch_cache():
    FakeTensorMode.cache_clear()
    _traced(lambda annotate: PROGRAMS["cnn autocast bf16"](annotate=annotate))
    assert len(FakeTensorMode.cache) == 0


def test_a_cuda_program_or_another_torch_is_traced_on_torchs_own_path(monkeypatch):
    assert tracker._fake_mode(torch.device("cuda")) is FakeTensorMode
    assert tracker._fake_mode(torch.device("cpu")) is tracker.PlanFakeTensorMode
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")  # the GPU machine's image
    assert tracker._fake_mode(torch.device("cpu")) is FakeTensorMode


@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in ZOO if "lstm" not in n and n != "gru"])  # cuDNN's RNNs: `Unplannable`
def test_on_cuda_the_meta_kernels_give_torchs_traces(name, monkeypatch):
    """Whether a CUDA program may take the meta kernels too (`tracker._fake_mode`): equal traces both ways (on
    the GPU machine's torch, which may differ from the one `kernels.CHECKED_TORCH` names)."""
    program = functools.partial(case_program(ZOO[name], "cuda"), 3)
    ours = _traced(program, tracker.PlanFakeTensorMode, monkeypatch, device="cuda")
    torchs = _traced(program, FakeTensorMode, monkeypatch, device="cuda")
    assert ours.signature == torchs.signature, name
    np.testing.assert_array_equal(ours.sizes, torchs.sizes, err_msg=name)


def _key_cases(mode: FakeTensorMode) -> dict[str, object]:
    """Fake tensors (and arguments beside them) that differ in one piece of what torch keys a tensor by."""
    with mode:
        base = torch.empty(4, 6)
        cases = {
            "4x6": base, "another 4x6": torch.empty(4, 6), "6x4": torch.empty(6, 4), "transposed": base.t(),
            "bf16": torch.empty(4, 6, dtype=torch.bfloat16), "int64": torch.empty(4, 6, dtype=torch.long),
            "offset slice": torch.empty(5, 6)[1:], "slice at 0": torch.empty(5, 6)[:4],
            "in a larger storage": torch.empty(30)[:24].view(4, 6),
            "requires grad": torch.empty(4, 6, requires_grad=True),
            "expanded": torch.empty(1, 6).expand(4, 6), "channels last": torch.empty(2, 3, 4, 5).to(
                memory_format=torch.channels_last), "contiguous 4-d": torch.empty(2, 3, 4, 5), "0-d": torch.empty(()),
            "empty": torch.empty(0, 6), "complex": torch.empty(4, 6, dtype=torch.cfloat),
            "conjugate": torch.empty(4, 6, dtype=torch.cfloat).conj(),
            "negative": torch._neg_view(torch.empty(4, 6, dtype=torch.cfloat)),
            "sparse": torch.empty(4, 6).to_sparse(), "a list of two": [base, base], "an int": 4, "a float": 4.0,
        }
        with torch.inference_mode():
            cases["inference"] = torch.empty(4, 6)
    return cases


def test_a_dense_fake_tensors_cache_key_tells_apart_what_torchs_key_tells_apart():
    """`PlanFakeTensorMode._prep_args_for_hash` keys a dense fake tensor by one tuple: two arguments get one key
    exactly where torch's own key gives them one."""
    from torch._subclasses._fake_tensor_utils import _CacheKeyState

    mode = kernels.PlanFakeTensorMode(allow_non_fake_inputs=True)
    cases = _key_cases(mode)

    def keys(prep) -> dict[str, tuple]:
        out = {}
        for name, arg in cases.items():
            result: list = []
            try:
                prep(mode, result, (arg,), _CacheKeyState(), [])
            except Exception as error:  # noqa: BLE001 - a bypass (sparse) must bypass both ways
                result = [type(error).__name__]
            out[name] = tuple(result)
        return out
    ours, torchs = keys(kernels.PlanFakeTensorMode._prep_args_for_hash), keys(FakeTensorMode._prep_args_for_hash)
    assert ours["sparse"] == torchs["sparse"] == ("_BypassDispatchCache",)
    for a in cases:
        for b in cases:
            assert (ours[a] == ours[b]) == (torchs[a] == torchs[b]), (a, b)
    assert ours["4x6"] == ours["another 4x6"] and ours["4x6"] != ours["in a larger storage"]


SLICES = [(0, 1, 3, 1), (1, 2, None, 1), (1, None, 2, 1), (-1, 1, -1, 2), (0, -3, None, 1), (2, 0, 9 ** 18, 1),
          (1, 5, 2, 1), (0, -100, 100, 3), (3, 1, 4, 1), (1, 4, 4, 1)]


@pytest.mark.parametrize("dim, start, end, step", SLICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels last", "offset view"])
def test_a_slice_is_the_view_torch_makes(dim, start, end, step, layout, monkeypatch):
    """`aten.slice` at concrete sizes takes its C++ kernel on the meta device (`PlanFakeTensorMode._dispatch_impl`),
    not torch's Python rule: the same view (sizes, strides, offset) of the same storage as torch's fake tensors and
    a real tensor make."""
    def sliced(mode):
        with mode if mode is not None else contextlib.nullcontext():
            base = torch.empty(2, 5, 4, 6)
            x = {"contiguous": base, "channels last": base.to(memory_format=torch.channels_last),
                 "offset view": base[1:, 1:]}[layout]
            y = torch.ops.aten.slice.Tensor(x, dim, start, end, step)
            return tuple(y.shape), y.stride(), y.storage_offset(), y.dtype, \
                y.untyped_storage()._cdata == x.untyped_storage()._cdata
    monkeypatch.setattr(kernels, "_CACHE", {})
    with kernels.plan_cache():  # not torch's cache, where torch's own path would find our output
        ours = sliced(kernels.PlanFakeTensorMode())
    FakeTensorMode.cache_clear()
    assert ours == sliced(FakeTensorMode()) == sliced(None)


def _batch_norm_layouts(case: tuple, rule: bool, monkeypatch) -> list:
    """A BatchNorm forward and backward in training traced under the plan's fake tensors with the made outputs
    (`kernels._batch_norm_outputs`) or torch's meta kernel: each output's shape, strides, dtype and offset."""
    shape, layout, (dtype, weight_dtype), affine, running, mask, grad_layout = case
    monkeypatch.setattr(kernels, "_CACHE", {})
    if not rule:
        monkeypatch.setattr(kernels, "_training_batch_norm", lambda *args: False)
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    try:
        with kernels.plan_cache(), kernels.PlanFakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(shape, dtype=dtype)
            x = x.to(memory_format=formats.get(x.dim(), torch.contiguous_format)) if layout == "channels last" else \
                x.transpose(0, -1) if layout == "transposed" else x
            channels = x.shape[1]
            weight, bias, mean, var = (torch.empty(channels, dtype=weight_dtype) if on else None
                                       for on in (affine, affine, running, running))
            out = torch.ops.aten.native_batch_norm.default(x, weight, bias, mean, var, True, 0.1, 1e-5)
            grad = torch.empty_like(out[0]) if grad_layout == "the input's" else torch.empty(out[0].shape, dtype=dtype)
            grads = torch.ops.aten.native_batch_norm_backward.default(grad, x, weight, mean, var, out[1], out[2], True,
                                                                      1e-5, list(mask))
    except ZeroDivisionError:  # the meta kernel's, at one value per channel with running statistics
        return ["ZeroDivisionError"]
    return [None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in (*out, *grads)]


def test_a_training_batch_norms_outputs_are_those_of_torchs_meta_kernel(monkeypatch):
    """`PlanFakeTensorMode` makes a training BatchNorm's outputs by hand (`kernels._batch_norm_outputs`) in place of
    torch's meta kernel, a Python decomposition: the same shapes, strides, dtypes and offsets on every layout (size-1
    dimensions too), dtype pair, affine or not, with running statistics or not, gradient mask and incoming gradient laid
    out as the input or contiguous; the same error where that kernel raises."""
    made = []
    monkeypatch.setattr(kernels, "_batch_norm_outputs", lambda *args, f=kernels._batch_norm_outputs: made.append(1)
                        or f(*args))
    shapes = [(3, 5), (3, 5, 4), (3, 5, 4, 2), (1, 5, 4, 2), (3, 5, 1, 1), (1, 5, 1, 1), (2, 5, 1, 3),
              (2, 5, 2, 3, 2), (1, 1, 1, 1), (2, 5, 4, 1)]
    dtypes = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float16)]
    cases = list(itertools.product(shapes, ["contiguous", "channels last", "transposed"], dtypes, [True, False],
                                   [True, False], [(True, True, True), (True, False, False), (False, True, True)],
                                   ["the input's", "contiguous"]))
    for case in cases:
        with monkeypatch.context() as patch:
            ours = _batch_norm_layouts(case, True, patch)
        with monkeypatch.context() as patch:
            assert ours == _batch_norm_layouts(case, False, patch), case
    assert len(made) > len(cases)  # made by hand in most cases (forward and backward), not all left to torch
