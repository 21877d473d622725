"""The hand-written Triton packed step against the eager step (Lewandowski & Kosson, 3.1).

Tests ``workbench.optim.triton_kernel``. Without a GPU the kernel's own source runs in Triton's
interpreter on CPU tensors, against the eager CPU step: every byte-plane format, fp32 and bf16
states, truncated and stochastic master rounding, AdamW, Adam (and amsgrad, maximize), SGD, loss
scaling, on ordinary and special values and random bit patterns, bit for bit wherever the eager value
is a number. NaN payloads are the device's: numpy's x86 rules in the interpreter, canonical NaNs on
CUDA, so a NaN must stay a NaN here and is compared bit for bit on CUDA (the CUDA tests, skipped
without a GPU). The kernel is also compiled for an H100 (sm_90) without one, and its PTX checked for
what bit-exactness needs: no fused multiply-add, no flushed subnormals, correctly rounded division and
square root, and vectorised loads.
"""

import re

import pytest
import torch
from kernel_cases import BF16, FORMATS, KEY, MATHS, assert_same_bits, coef_for, fmt_id, inputs

from tests.conftest import requires_cuda
from workbench.optim import fused, triton_kernel
from workbench.optim.fused import StepSpec, select_step
from workbench.optim.formats import storage_bits
from workbench.optim.update import adam_math, chunked_update, packed_update, sgd_math

pytestmark = pytest.mark.skipif(not triton_kernel.available(), reason="needs triton (pip install triton)")

# beyond the C++ kernel's options: amsgrad and maximize (the Triton kernel takes them)
MORE_MATHS = [*MATHS, (adam_math, {"decoupled": True, "amsgrad": True, "maximize": True}),
              (sgd_math, {"momentum": True, "nesterov": False, "first": False, "maximize": True})]


def _ints(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_numbers(eager, kernel):
    """Bit for bit, except NaN payloads: a NaN where eager has one (its half's extra bits are payload too)."""
    nan_half = eager[0].isnan()
    assert torch.equal(nan_half, kernel[0].isnan()), "a NaN half where the other has a number"
    for j, (a, b) in enumerate(zip(eager, kernel, strict=True)):
        differ = _ints(a) != _ints(b)
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), f"tensor {j}: NaN where the other has a number"
            differ &= ~a.isnan()
        elif j > 0:  # byte planes: a NaN value's extra bits are its payload
            differ &= ~nan_half
        bad = differ.nonzero().flatten()
        assert bad.numel() == 0, f"tensor {j}: {bad.numel()} values differ, first at {bad[:5].tolist()}"


def _compare(n, fmt, state_dtype, master_rounding, math_fn, options, *, scaled=False, steps=2, garbage=False,
             seed=0, device="cpu", exact=False):
    dtype, k, sr = fmt
    g = torch.Generator().manual_seed(seed)
    n_states = (3 if options.get("amsgrad") else 2) if math_fn is adam_math else int(options["momentum"])
    half, grad, planes, states = inputs(n, dtype, k, sr, state_dtype, n_states, g, garbage=garbage)
    half, grad, planes, states = half.to(device), grad.to(device), planes.to(device), [s.to(device) for s in states]
    static = dict(math_fn=math_fn, extra_bits=k, stochastic_rounding=sr, master_rounding=master_rounding,
                  options=options, scaled=scaled)
    eager = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    kernel = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    for step in range(steps):
        coef = coef_for(math_fn, step=(1, 1000, 3)[step % 3])
        if scaled:  # 1 / loss scale, clip value
            coef = torch.cat([coef, torch.tensor([0.5, 1e-2])])
        coef = coef.to(device)
        chunked_update(eager[0], grad, eager[1], eager[2], coef, KEY + step, bits=storage_bits(k, sr), **static)
        triton_kernel.packed_update_triton(kernel[0], grad, kernel[1], kernel[2], coef, KEY + step, **static)
    flat = ([eager[0], *eager[1], *eager[2]], [kernel[0], *kernel[1], *kernel[2]])
    (assert_same_bits if exact else _assert_same_numbers)(*flat)


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


def test_offset_and_planes_tensor_match_packed_update():
    # a (planes, n) tensor as the flat group keeps it, and an offset into the key's stream
    g = torch.Generator().manual_seed(3)
    n = 1000
    half, grad, planes, states = inputs(n, BF16, 15, True, torch.float32, 2, g)
    static = dict(math_fn=adam_math, extra_bits=15, stochastic_rounding=True, master_rounding="stochastic",
                  options={"decoupled": True})
    a = [half.clone(), planes.clone(), [s.clone() for s in states]]
    b = [half.clone(), planes.clone(), [s.clone() for s in states]]
    packed_update(a[0], grad, list(a[1].unbind(0)), a[2], coef_for(adam_math), KEY, offset=777, **static)
    triton_kernel.packed_update_triton(b[0], grad, b[1], b[2], coef_for(adam_math), torch.tensor(KEY), offset=777,
                                       **static)
    _assert_same_numbers([a[0], a[1], *a[2]], [b[0], b[1], *b[2]])


def test_updates_the_kernel_does_not_take_are_named():
    n = 64
    half, grad = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    states, coef = [torch.zeros(n), torch.zeros(n)], coef_for(adam_math)
    static = dict(math_fn=adam_math, extra_bits=12, stochastic_rounding=False, options={"decoupled": True})
    words = torch.zeros(24, dtype=torch.int32)
    assert "byte planes" in triton_kernel.unsupported_reason(half, grad, words, states, coef, **static)
    planes = [torch.zeros(n, dtype=torch.uint8)]
    static["extra_bits"] = 8
    assert triton_kernel.supports(half, grad, planes, states, coef, **static)
    assert "3 state tensors" in triton_kernel.unsupported_reason(
        half, grad, planes, states, coef, **dict(static, options={"decoupled": True, "amsgrad": True}))
    assert "does not implement" in triton_kernel.unsupported_reason(
        half, grad, planes, states, coef, **dict(static, options={"decoupled": True, "foreach": True}))
    assert "coef" in triton_kernel.unsupported_reason(half, grad, planes, states, coef, scaled=True, **static)
    with pytest.raises(ValueError, match="does not take this update"):
        triton_kernel.packed_update_triton(half, grad, words, states, coef, None, **dict(static, extra_bits=12))
    # an update it does not take runs the fallback
    calls = []
    update = triton_kernel.kernel_update(fallback=lambda *args: calls.append(args), **dict(static, extra_bits=12))
    update(half, grad, words, states, coef, None)
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


def test_offered_to_the_optimizers_on_cuda_only(monkeypatch):
    static = dict(math_fn=adam_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True}, scaled=False)
    spec = StepSpec(static, 8, BF16, torch.float32, dynamic=False)
    assert triton_kernel.triton_step(torch.device("cpu"), spec) is None
    assert triton_kernel.triton_step(torch.device("cuda"), spec) is not None
    assert triton_kernel.triton_step(torch.device("cuda"), StepSpec(static, 12, BF16, torch.float32, False)) is None
    monkeypatch.setenv("WORKBENCH_TRITON_KERNEL", "0")
    assert triton_kernel.triton_step(torch.device("cuda"), spec) is None
    assert fused.STEP_BACKENDS[0][0] == "triton_kernel"
    assert select_step(torch.device("cpu"), spec, fused=True, compile=None)[0] != "triton_kernel"


def _ptx(**constexprs):
    """The kernel's PTX for an H100 (sm_90), compiled here without a GPU, as a 1e8-value flat group launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = triton_kernel._kernel(interpret=False)
    names = list(fn.arg_names)
    half = "*bf16" if constexprs["IS_BF16"] else "*fp16"
    state = "*bf16" if constexprs["STATE_BF16"] else "*fp32"
    types = {"half_ptr": half, "grad_ptr": half, "p0_ptr": "*u8", "p1_ptr": "*u8", "s0_ptr": state,
             "s1_ptr": state, "s2_ptr": state, "coef_ptr": "*fp32", "key": "i32", "offset": "i32", "n": "i32"}
    signature = {name: types.get(name, "constexpr") for name in names}
    # aligned pointers and a length divisible by 16: what Triton's launcher specialises a flat group to
    aligned = [(names.index(name),) for name in names if name.endswith("_ptr") or name == "n"]
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={index: [["tt.divisibility", 16]] for index in aligned})
    options = triton_kernel._launch_options("cuda")
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


_BUILDS = {  # constexprs beyond bf16+8 AdamW with fp32 moments, truncated
    "bf16+8": {},
    "bf16+15 SR, stochastic master, bf16 moments": {"EXTRA_BITS": 15, "SR": True, "MASTER_SR": True,
                                                    "STATE_BF16": True},
    "fp16+8 amsgrad, loss scaled": {"IS_BF16": False, "AMSGRAD": True, "SCALED": True, "N_COEF": 11},
}


@pytest.mark.parametrize("build", list(_BUILDS))
def test_the_cuda_build_keeps_eager_numerics_and_vectorises(build):
    pytest.importorskip("triton.backends.nvidia.compiler")
    constexprs = dict(IS_BF16=True, EXTRA_BITS=8, SR=False, MASTER_SR=False, MATH=0, DECOUPLED=True,
                      MOMENTUM=False, NESTEROV=False, FIRST=False, MAXIMIZE=False, AMSGRAD=False, SCALED=False,
                      N_COEF=9, STATE_BF16=False, NATIVE_BF16=True, BLOCK=triton_kernel._BLOCK["cuda"])
    constexprs.update(_BUILDS[build])
    try:
        ptx = _ptx(**constexprs)
    except Exception as e:  # noqa: BLE001 - e.g. a Triton build without its bundled ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    assert not re.search(r"\bfma\.", ptx), "a fused multiply-add rounds once where eager rounds twice"
    assert ".ftz" not in ptx, "flushed subnormals"
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "sqrt.rn.f32" in ptx and "sqrt.approx" not in ptx
    assert ".local" not in ptx, "registers spilled to local memory"
    # 8 values per thread: 16-byte loads of the 16-bit values and gradients and of each moment
    assert len(re.findall(r"ld\.global(\.[a-z]+)*\.v4\.b32", ptx)) >= 4


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_cuda_equals_the_eager_cuda_step_bit_for_bit(fmt):
    for state_dtype in (torch.float32, BF16):
        for master_rounding in ("truncate", "stochastic"):
            for math_fn, options in MORE_MATHS:
                for garbage in (False, True):
                    _compare(70001, fmt, state_dtype, master_rounding, math_fn, options, scaled=garbage,
                             steps=1 if garbage else 2, garbage=garbage, device="cuda", exact=True)
