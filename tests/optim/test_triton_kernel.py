"""The hand-written Triton packed step against the eager step (Lewandowski & Kosson, 3.1, Fig 1).

Tests ``workbench.optim.triton_kernel``. Without a GPU the kernel's own source runs in Triton's
interpreter on CPU tensors, against the eager CPU step (the contract, see the module's docstring): the
byte-plane formats and dense words with every option (fp32 and bf16 states, truncated and stochastic
master rounding, AdamW, Adam, amsgrad, maximize, SGD, loss scaling), every width from 0 to 17 stored
bits with the options rotated over them, on ordinary and special values and random bit patterns, over
several programs and a last word shared with the padding; bit for bit wherever the eager value is a
number (NaN payloads are the device's: numpy's x86 rules in the interpreter). The kernel is also
compiled for an H100 (sm_90) without one, and its PTX and ptxas's report checked for what bit-exactness
and speed need: no fused multiply-add, no flushed subnormals, correctly rounded division and square
root, negation as a sign flip, vectorised loads, no register spills. On a GPU (``requires_cuda``) the
compiled kernel is checked bit for bit against the eager CPU step and the eager step run on CUDA.
"""

import os
import re
import subprocess
import tempfile

import pytest
import torch
from kernel_cases import ALL_FORMATS, BF16, FORMATS, FP16, KEY, MATHS, assert_same_bits, coef_for, fmt_id, inputs

from tests.conftest import requires_cuda
from workbench.optim import fused, triton_kernel
from workbench.optim.formats import storage_bits
from workbench.optim.fused import StepSpec, select_step
from workbench.optim.kernel_args import GradSegments
from workbench.optim.packing import pack, unpack
from workbench.optim.rng import shift_key
from workbench.optim.update import adam_math, chunked_update, packed_update, sgd_math

pytestmark = pytest.mark.skipif(not triton_kernel.available(), reason="needs triton (pip install triton)")

# beyond the C++ kernel's options: amsgrad and maximize (the Triton kernel takes them)
MORE_MATHS = [*MATHS, (adam_math, {"decoupled": True, "amsgrad": True, "maximize": True}),
              (sgd_math, {"momentum": True, "nesterov": False, "first": False, "maximize": True})]
DENSE = [(BF16, 12, False), (FP16, 13, True)]  # 12 and 14 stored bits: values straddle int32 words


def _ints(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _extra(planes, bits):
    """What the optimizer passes: a list of byte planes, dense words, or (k = 0) no word."""
    if bits == 0:
        return torch.zeros(0, dtype=torch.int32, device=planes.device)
    return planes.clone() if planes.dtype == torch.int32 else [p.clone() for p in planes]


def _flat(run, bits, n):
    """half, the extra bits one value each (dense words unpacked), the states."""
    half, extra, states = run
    words = torch.is_tensor(extra) and extra.dtype == torch.int32
    values = ([unpack(extra, bits, n)] if bits else []) if words else list(extra)
    return [half, *values, *states]


def _assert_same_numbers(eager, kernel):
    """Bit for bit, except NaN payloads: a NaN where eager has one (its half's extra bits are payload too)."""
    nan_half = eager[0].isnan()
    assert torch.equal(nan_half, kernel[0].isnan()), "a NaN half where the other has a number"
    for j, (a, b) in enumerate(zip(eager, kernel, strict=True)):
        differ = _ints(a) != _ints(b)
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), f"tensor {j}: NaN where the other has a number"
            differ &= ~a.isnan()
        elif j > 0:  # extra bits: a NaN value's are its payload
            differ &= ~nan_half
        bad = differ.nonzero().flatten()
        assert bad.numel() == 0, f"tensor {j}: {bad.numel()} values differ, first at {bad[:5].tolist()}"


def _compare(n, fmt, state_dtype, master_rounding, math_fn, options, *, scaled=False, steps=2, garbage=False,
             seed=0, device="cpu"):
    """The kernel against the eager CPU step (numbers bit for bit); on CUDA also against the eager step run
    on CUDA (bit for bit, NaN payloads included: both give the GPU's canonical NaN)."""
    dtype, k, sr = fmt
    bits = storage_bits(k, sr)
    g = torch.Generator().manual_seed(seed)
    n_states = (3 if options.get("amsgrad") else 2) if math_fn is adam_math else int(options["momentum"])
    half, grad, planes, states = inputs(n, dtype, k, sr, state_dtype, n_states, g, garbage=garbage)
    static = dict(math_fn=math_fn, extra_bits=k, stochastic_rounding=sr, master_rounding=master_rounding,
                  options=options, scaled=scaled)

    def start(dev):
        return [half.to(dev, copy=True), _extra(planes.to(dev), bits), [s.to(dev, copy=True) for s in states]]

    runs = {"eager cpu": start("cpu"), "kernel": start(device)}
    if device != "cpu":
        runs["eager cuda"] = start(device)
    for step in range(steps):
        coef = coef_for(math_fn, step=(1, 1000, 3)[step % 3])
        if scaled:  # 1 / loss scale, clip value
            coef = torch.cat([coef, torch.tensor([0.5, 1e-2])])
        for name, (h, extra, st) in runs.items():
            dev = h.device
            if name == "kernel":
                triton_kernel.packed_update_triton(h, grad.to(dev), extra, st, coef.to(dev), KEY + step, **static)
            else:
                chunked_update(h, grad.to(dev), extra, st, coef.to(dev), KEY + step, bits=bits, **static)
    kernel = _flat(runs["kernel"], bits, n)
    if torch.is_tensor(runs["kernel"][1]) and bits:  # past the last value: zero bits, as eager packs them
        words = runs["kernel"][1]
        assert torch.equal(words, pack(unpack(words, bits, n), bits)), "bits past the last value are not zero"
    _assert_same_numbers(_flat(runs["eager cpu"], bits, n), [t.cpu() for t in kernel])
    if "eager cuda" in runs:
        assert_same_bits(_flat(runs["eager cuda"], bits, n), kernel)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_every_option_equals_the_eager_step(fmt):
    for state_dtype in (torch.float32, BF16):
        for master_rounding in ("truncate", "stochastic"):
            for math_fn, options in MORE_MATHS:
                for scaled in (False, True):
                    _compare(4133, fmt, state_dtype, master_rounding, math_fn, options, scaled=scaled)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_random_bit_patterns_equal_the_eager_step(fmt):
    for state_dtype in (torch.float32, BF16):
        for master_rounding in ("truncate", "stochastic"):
            for math_fn, options in MORE_MATHS:
                _compare(2053, fmt, state_dtype, master_rounding, math_fn, options, steps=1, garbage=True, seed=1)


@pytest.mark.parametrize("fmt", DENSE, ids=fmt_id)
def test_dense_words_equal_the_eager_step(monkeypatch, fmt):
    # what changes the dense words' code: states, master rounding, loss scaling, ordinary values and random bit
    # patterns, over 4 programs of 256 values (the algorithms meet every width in the next test)
    monkeypatch.setitem(triton_kernel._BLOCK, "cpu", 256)
    for state_dtype in (torch.float32, BF16):
        for master_rounding in ("truncate", "stochastic"):
            for math_fn, options in (MORE_MATHS[5], MORE_MATHS[2]):
                _compare(1000, fmt, state_dtype, master_rounding, math_fn, options, scaled=True)
                _compare(1000, fmt, state_dtype, master_rounding, math_fn, options, steps=1, garbage=True, seed=1)


def _rotated(index):
    """The options of the index-th width: every option meets several widths, each width one combination."""
    math_fn, options = MORE_MATHS[index % len(MORE_MATHS)]
    return dict(state_dtype=(torch.float32, BF16)[index % 2],
                master_rounding=("truncate", "stochastic")[index // 2 % 2],
                math_fn=math_fn, options=options, scaled=index % 3 == 0, garbage=index % 4 == 1)


@pytest.mark.parametrize(("dtype", "sr"), [(BF16, False), (BF16, True), (FP16, False), (FP16, True)],
                         ids=["bf16", "bf16 SR", "fp16", "fp16 SR"])
def test_every_width_equals_the_eager_step(monkeypatch, dtype, sr):
    # 128-value programs: 300 values take 3 of them, and the last word is shared with the padding
    monkeypatch.setitem(triton_kernel._BLOCK, "cpu", 128)
    widths = [f for f in ALL_FORMATS if f[0] == dtype and f[2] == sr]
    for index, fmt in enumerate(widths):
        kw = _rotated(index + 7 * sr)
        _compare(300, fmt, kw.pop("state_dtype"), kw.pop("master_rounding"), kw.pop("math_fn"), kw.pop("options"),
                 steps=1, seed=index, **kw)


def test_maximize_negates_plus_zero_to_minus_zero():
    # the first H100 run's failure: Triton 3.6 compiled -g as 0 - g, so exp_avg = -0.0 * b1 + (-(+0.0)) * (1 - b1)
    # came out +0.0 where eager keeps -0.0
    n = 64
    half = torch.full((n,), 0.5, dtype=BF16)
    grad = torch.zeros(n, dtype=BF16)
    states = [torch.full((n,), -0.0), torch.full((n,), 1e-3), torch.full((n,), 1e-3)]
    static = dict(math_fn=adam_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True, "amsgrad": True, "maximize": True})
    kernel = [t.clone() for t in states]
    triton_kernel.packed_update_triton(half.clone(), grad, [torch.zeros(n, dtype=torch.uint8)], kernel,
                                       coef_for(adam_math), None, **static)
    packed_update(half.clone(), grad, [torch.zeros(n, dtype=torch.uint8)], states, coef_for(adam_math), None,
                  **static)
    assert torch.signbit(states[0]).all() and torch.signbit(kernel[0]).all()


def test_bf16_states_round_ties_to_even():
    # SGD with momentum 1 and no dampening keeps buf + grad: sums exactly between two bf16 values
    n = 64
    half = torch.zeros(n, dtype=BF16)
    grad = torch.full((n,), 2.0**-8, dtype=BF16)
    buf = (1 + torch.arange(n) % 4 * 2.0**-7).to(BF16)  # 1, 1+2^-7, 1+2^-6, 1+3*2^-7: ties both ways
    coef = torch.tensor([0.0, 0.0, 1.0, 1.0])
    static = dict(math_fn=sgd_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options={"momentum": True, "nesterov": False, "first": False})
    eager, kernel = buf.clone(), buf.clone()
    packed_update(half.clone(), grad, [torch.zeros(n, dtype=torch.uint8)], [eager], coef, None, **static)
    triton_kernel.packed_update_triton(half.clone(), grad, [torch.zeros(n, dtype=torch.uint8)], [kernel], coef,
                                       None, **static)
    assert_same_bits([eager], [kernel])
    assert kernel[:4].tolist() == [1.0, 1 + 2.0**-6, 1 + 2.0**-6, 1 + 2.0**-5]


@pytest.mark.parametrize("k", [15, 12])  # byte planes as the flat group keeps them; dense words
def test_offset_and_the_flat_groups_layouts_match_packed_update(k):
    # a (planes, n) tensor or a word segment, and an offset into the key's stream
    g = torch.Generator().manual_seed(3)
    n = 1000
    half, grad, planes, states = inputs(n, BF16, k, True, torch.float32, 2, g)
    static = dict(math_fn=adam_math, extra_bits=k, stochastic_rounding=True, master_rounding="stochastic",
                  options={"decoupled": True})
    a = [half.clone(), planes.clone(), [s.clone() for s in states]]
    b = [half.clone(), planes.clone(), [s.clone() for s in states]]
    packed_update(a[0], grad, list(a[1].unbind(0)) if a[1].dim() == 2 else a[1], a[2], coef_for(adam_math), KEY,
                  offset=777, **static)
    triton_kernel.packed_update_triton(b[0], grad, b[1], b[2], coef_for(adam_math), torch.tensor(KEY), offset=777,
                                       **static)
    bits = storage_bits(k, True)
    _assert_same_numbers(_flat(a, bits, n), _flat(b, bits, n))


def test_updates_the_kernel_does_not_take_are_named():
    n = 64
    half, grad = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    states, coef = [torch.zeros(n), torch.zeros(n)], coef_for(adam_math)
    static = dict(math_fn=adam_math, extra_bits=12, stochastic_rounding=False, options={"decoupled": True})
    words = torch.zeros(24, dtype=torch.int32)
    assert triton_kernel.supports(half, grad, words, states, coef, **static)  # dense words: every width
    assert "packed_words(64, 12) = 24 words" in triton_kernel.unsupported_reason(half, grad, words[:23], states,
                                                                                  coef, **static)
    planes = [torch.zeros(n, dtype=torch.uint8)]
    assert "byte planes" in triton_kernel.unsupported_reason(half, grad, planes, states, coef, **static)
    static["extra_bits"] = 8
    assert triton_kernel.supports(half, grad, planes, states, coef, **static)
    assert "3 state tensors" in triton_kernel.unsupported_reason(
        half, grad, planes, states, coef, **dict(static, options={"decoupled": True, "amsgrad": True}))
    assert "does not implement" in triton_kernel.unsupported_reason(
        half, grad, planes, states, coef, **dict(static, options={"decoupled": True, "foreach": True}))
    assert "coef" in triton_kernel.unsupported_reason(half, grad, planes, states, coef, scaled=True, **static)
    with pytest.raises(ValueError, match="does not take this update"):
        triton_kernel.packed_update_triton(half, grad, words[:5], states, coef, None, **dict(static, extra_bits=12))
    # an update it does not take runs the fallback
    calls = []
    update = triton_kernel.kernel_update(fallback=lambda *args: calls.append(args), **dict(static, extra_bits=12))
    update(half, grad, words[:5], states, coef, None)
    assert len(calls) == 1


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("ptxas fatal: no such GPU\nsecond line")

    monkeypatch.setattr(triton_kernel, "_run", broken)
    calls = []
    static = dict(math_fn=adam_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True})
    update = triton_kernel.kernel_update(fallback=lambda *args: calls.append(args), **static)
    n = 64
    args = (torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16), [torch.zeros(n, dtype=torch.uint8)],
            [torch.zeros(n), torch.zeros(n)], coef_for(adam_math), None)
    with pytest.warns(RuntimeWarning, match="failed to build .*ptxas fatal: no such GPU\\)"):
        update(*args)
    update(*args)  # no second warning, no second try
    assert len(calls) == 2


def _spec(k, sr=False, dtype=BF16, dynamic=False):
    static = dict(math_fn=adam_math, extra_bits=k, stochastic_rounding=sr, master_rounding="truncate",
                  options={"decoupled": True}, scaled=False)
    return StepSpec(static, storage_bits(k, sr), dtype, torch.float32, dynamic=dynamic)


def test_chosen_on_cuda_for_every_format_fused_and_per_parameter(monkeypatch):
    # a fake CUDA device: what select_step picks, without running anything
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused.STEP_BACKENDS[0][0] == "triton_kernel" and fused.PER_PARAMETER_BACKENDS[0][0] == "triton_kernel"
    for dtype, k, sr in ALL_FORMATS:
        assert select_step(cuda, _spec(k, sr, dtype), fused=True, compile=None)[0] == "triton_kernel"
        assert select_step(cuda, _spec(k, sr, dtype, True), fused=False, compile=None)[0] == "triton_kernel"
    assert select_step(cuda, _spec(12), fused=True, compile=False)[0] == "eager"
    assert triton_kernel.triton_step(cpu, _spec(8)) is None
    assert select_step(cpu, _spec(12), fused=True, compile=None)[0] != "triton_kernel"
    monkeypatch.setenv("WORKBENCH_TRITON_KERNEL", "0")
    assert triton_kernel.triton_step(cuda, _spec(8)) is None
    assert select_step(cuda, _spec(12, dynamic=True), fused=False, compile=None)[0] == "eager"


def test_fake_tensors_are_planned_without_a_launch():
    # CalcGraph plans a step on fake tensors: the in-place update allocates nothing and launches nothing
    from torch._subclasses.fake_tensor import FakeTensorMode

    static = dict(math_fn=adam_math, extra_bits=12, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True})
    with FakeTensorMode():
        n = 1 << 20
        half, grad = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
        triton_kernel.packed_update_triton(half, grad, torch.zeros(n * 12 // 32, dtype=torch.int32),
                                           [torch.zeros(n), torch.zeros(n)], coef_for(adam_math), None, **static)


# ---------------------------------------------------------------------------------------------- the CUDA build
def _cuda_build(**constexprs):
    """The kernel compiled for an H100 (sm_90) here without one, as a 1e8-value flat group launches it: its PTX,
    and cuobjdump's resource report of the cubin (registers, stack and local memory: spills)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = triton_kernel._kernel(interpret=False)
    names = list(fn.arg_names)
    half = "*bf16" if constexprs["IS_BF16"] else "*fp16"
    state = "*bf16" if constexprs["STATE_BF16"] else "*fp32"
    extra = {0: half, 1: "*u8", 2: "*i32"}[constexprs["STORE"]]
    grad, rows = ("*i64", "*i32") if constexprs["SEGMENTED"] else (half, half)
    types = {"half_ptr": half, "grad_ptr": grad, "seg_ptr": rows, "x0_ptr": extra, "x1_ptr": extra, "s0_ptr": state,
             "s1_ptr": state, "s2_ptr": state, "coef_ptr": "*fp32", "key": "i32", "offset": "i32", "n": "i32"}
    signature = {name: types.get(name, "constexpr") for name in names}
    # aligned pointers and a length divisible by 16: what Triton's launcher specialises a flat group to
    aligned = [(names.index(name),) for name in names if name.endswith("_ptr") or name == "n"]
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={index: [["tt.divisibility", 16]] for index in aligned})
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=triton_kernel._launch_options("cuda"))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    report = ""
    if os.path.exists(cuobjdump) and "cubin" in compiled.asm:  # Triton's bundled CUDA tools
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "step.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            done = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, timeout=120)
        report = done.stdout + done.stderr
    return compiled.asm["ptx"], report


_BUILDS = {  # constexprs beyond bf16+8 AdamW with fp32 moments, truncated
    "bf16+8": {},
    "bf16+15 SR, stochastic master, bf16 moments": {"EXTRA_BITS": 15, "SR": True, "MASTER_SR": True,
                                                    "STATE_BF16": True},
    "fp16+8 amsgrad, maximize, loss scaled": {"IS_BF16": False, "AMSGRAD": True, "MAXIMIZE": True, "SCALED": True,
                                              "N_COEF": 11},
    "bf16+12 dense words": {"EXTRA_BITS": 12, "STORE": 2, "WORDS_P2": 512},
    "fp16+13 SR dense words, stochastic master, bf16 moments, maximize": {
        "IS_BF16": False, "EXTRA_BITS": 13, "SR": True, "MASTER_SR": True, "STATE_BF16": True, "MAXIMIZE": True,
        "STORE": 2, "WORDS_P2": 512},
    "bf16+1 dense words, SGD": {"EXTRA_BITS": 1, "STORE": 2, "WORDS_P2": 32, "MATH": 1, "MOMENTUM": True,
                                "N_COEF": 4},
    "bf16+8, gradients read in place": {"SEGMENTED": True},
    "bf16+12 dense words, gradients read in place": {"EXTRA_BITS": 12, "STORE": 2, "WORDS_P2": 512, "SEGMENTED": True},
    "bf16+8 nearest master": {"NEAREST": True},
    "fp16+5 dense words, nearest master, bf16 moments": {"IS_BF16": False, "EXTRA_BITS": 5, "STORE": 2, "WORDS_P2": 256,
                                                         "NEAREST": True, "STATE_BF16": True},
}


@pytest.mark.parametrize("build", list(_BUILDS))
def test_the_cuda_build_keeps_eager_numerics_and_vectorises(build):
    pytest.importorskip("triton.backends.nvidia.compiler")
    constexprs = dict(IS_BF16=True, EXTRA_BITS=8, SR=False, MASTER_SR=False, MATH=0, DECOUPLED=True,
                      MOMENTUM=False, NESTEROV=False, FIRST=False, MAXIMIZE=False, AMSGRAD=False, SCALED=False,
                      N_COEF=9, STATE_BF16=False, NATIVE_BF16=True, STORE=1, WORDS_P2=1, SEGMENTED=False,
                      BLOCK=triton_kernel._BLOCK["cuda"])
    constexprs.update(_BUILDS[build])
    try:
        ptx, report = _cuda_build(**constexprs)
    except Exception as e:  # noqa: BLE001 - e.g. a Triton build without its bundled ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    assert not re.search(r"\bfma\.", ptx), "a fused multiply-add rounds once where eager rounds twice"
    assert ".ftz" not in ptx, "flushed subnormals"
    assert "div.full" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx
    if constexprs["MATH"] == 0:
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    assert not re.search(r"sub(\.rn)?\.f32\s+%\w+,\s*0f00000000", ptx), "negation as 0 - x loses -0.0"
    assert ".local" not in ptx, "a local (stack) array"
    if report:
        usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
        assert usage and usage[2] == usage[3] == "0", f"registers spilled to the stack or local memory: {report}"
    # 8 values per thread: 16-byte loads of the 16-bit values and gradients and of each moment
    assert len(re.findall(r"ld\.global(\.[a-z]+)*\.v4\.b32", ptx)) >= 4


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS + DENSE, ids=fmt_id)
def test_cuda_equals_the_eager_steps_bit_for_bit(fmt):
    for state_dtype in (torch.float32, BF16):
        for master_rounding in ("truncate", "stochastic"):
            for math_fn, options in MORE_MATHS:
                for garbage in (False, True):
                    _compare(70001, fmt, state_dtype, master_rounding, math_fn, options, scaled=garbage,
                             steps=1 if garbage else 2, garbage=garbage, device="cuda")


@requires_cuda
def test_cuda_every_width_equals_the_eager_steps_bit_for_bit():
    for index, fmt in enumerate(ALL_FORMATS):
        kw = _rotated(index)
        _compare(70001, fmt, kw.pop("state_dtype"), kw.pop("master_rounding"), kw.pop("math_fn"), kw.pop("options"),
                 steps=2, seed=index, device="cuda", **kw)


@pytest.mark.parametrize("fmt", [(BF16, 8, False), (BF16, 12, False), (FP16, 13, True)], ids=fmt_id)
def test_a_fused_groups_gradients_read_in_place_equal_the_per_parameter_step(monkeypatch, fmt):
    # GradSegments: each parameter's gradient where autograd left it, 32-value-aligned segments of the flat
    # buffers (with padding between them), over 64-value programs; against the eager step on each parameter
    monkeypatch.setitem(triton_kernel._BLOCK, "cpu", 64)
    dtype, k, sr = fmt
    bits = storage_bits(k, sr)
    offsets, lengths = (0, 64, 160, 256), (37, 96, 1, 70)
    g = torch.Generator().manual_seed(7)
    half, _, planes, states = inputs(352, dtype, k, sr, torch.float32, 3, g)
    grads = [(torch.randn(n, generator=g) * 1e-3).to(dtype) for n in lengths]
    static = dict(math_fn=adam_math, extra_bits=k, stochastic_rounding=sr, master_rounding="stochastic",
                  options={"decoupled": True, "amsgrad": True, "maximize": True})
    ref = [half.clone(), _extra(planes, bits), [s.clone() for s in states]]
    got = [half.clone(), _extra(planes, bits), [s.clone() for s in states]]

    def part(run, at, n):
        h, extra, st = run
        piece = (extra[at * bits // 32: at * bits // 32 + (n * bits + 31) // 32] if torch.is_tensor(extra)
                 else [p[at: at + n] for p in extra])
        return h[at: at + n], piece, [s[at: at + n] for s in st]

    segments = GradSegments(offsets, tuple(grads), gather=lambda: pytest.fail("gathered into a flat copy"))
    triton_kernel.packed_update_triton(got[0], segments, got[1], got[2], coef_for(adam_math), KEY, offset=5,
                                       **static)
    for at, n, grad in zip(offsets, lengths, grads, strict=True):
        h, extra, st = part(ref, at, n)
        chunked_update(h, grad, extra, st, coef_for(adam_math), shift_key(KEY, 5 + at), bits=bits, **static)
        want, have = part(ref, at, n), part(got, at, n)
        _assert_same_numbers(_flat(want, bits, n), _flat(have, bits, n))
        if torch.is_tensor(have[1]):  # the segment's last word: zero bits past its last value, as eager leaves
            assert torch.equal(have[1], pack(unpack(have[1], bits, n), bits))
