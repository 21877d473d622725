"""The hand-written CPU packed step against the eager step, bit for bit (Lewandowski & Kosson, 3.1).

Tests ``workbench.optim.cpu_kernel``: every byte-plane format (bf16+8, bf16+16, fp16+8, and with
stochastic rounding bf16+7, bf16+15, fp16+7; bf16+0 and fp16+0 with no plane), fp32 and bf16 states,
truncated, stochastic and nearest master rounding, AdamW, Adam and SGD, on ordinary values, special values
(zeros, subnormals, infinities, NaNs, the largest finite values, rounding ties) and random bit patterns,
over one and two threads; and the fallback when the kernel cannot be built. The kernel is built once into
torch's extension cache (first run: seconds; later sessions load it). Each build variant (``cpu_variants``: every
ISA build, and a prefetch and division other than the default) is checked the same way against the eager step:
its first build takes 20-60 s, once per machine (the cache keeps it).
"""

import pytest
import torch

from kernel_cases import (BF16, FORMATS, KEY, MATHS, NO_PLANES, assert_same_bits, coef_for, fmt_id, inputs,
                          widened_apart)

from workbench.optim import cpu_kernel
from workbench.optim.cpu_variants import ENV_VARIANT, default_variant, parse_variant, unusable_reason
from workbench.optim.formats import storage_bits
from workbench.optim.kernel_args import GradSegments
from workbench.optim.rng import shift_key
from workbench.optim.update import adam_math, chunked_update, packed_update, sgd_math


@pytest.fixture(scope="module")
def kernel():
    """Build (or load from torch's extension cache) the kernel once; skip where it cannot be built."""
    if not cpu_kernel.available():
        pytest.skip(f"the C++ kernel could not be built here: {cpu_kernel._STATE['error']}")


def _compare(n, fmt, state_dtype, master_rounding, math_fn, options, *, steps=2, garbage=False, seed=0):
    dtype, k, sr = fmt
    g = torch.Generator().manual_seed(seed)
    n_states = 2 if math_fn is adam_math else int(options["momentum"])
    half, grad, planes, states = inputs(n, dtype, k, sr, state_dtype, n_states, g, garbage=garbage)
    static = dict(math_fn=math_fn, extra_bits=k, stochastic_rounding=sr, master_rounding=master_rounding,
                  options=options)
    eager = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    kernel = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    bits = storage_bits(k, sr)
    for step in range(steps):
        key = KEY + step
        coef = coef_for(math_fn, step=(1, 1000, 3)[step % 3])  # bias corrections of early and late steps
        # k = 0: the optimizer's extra storage is 0 int32 words
        extra = eager[1] if bits else torch.zeros(0, dtype=torch.int32)
        chunked_update(eager[0], grad, extra, eager[2], coef, key, bits=bits, **static)
        cpu_kernel.packed_update_cpu(kernel[0], grad, kernel[1] if bits else extra, kernel[2], coef, key, **static)
    assert_same_bits([eager[0], *eager[1], *eager[2]], [kernel[0], *kernel[1], *kernel[2]], nan_at=widened_apart(grad))


def _roundings(fmt):
    """The master roundings of a format: nearest, too, without stochastic rounding (which it excludes)."""
    return ("truncate", "stochastic") + (() if fmt[2] else ("nearest",))


@pytest.mark.parametrize("fmt", FORMATS + NO_PLANES, ids=fmt_id)
def test_every_option_equals_the_eager_step(kernel, fmt, one_thread):
    for state_dtype in (torch.float32, BF16):
        for master_rounding in _roundings(fmt):
            for math_fn, options in MATHS:
                _compare(4133, fmt, state_dtype, master_rounding, math_fn, options)


@pytest.mark.parametrize("fmt", FORMATS + NO_PLANES, ids=fmt_id)
def test_random_bit_patterns_equal_the_eager_step(kernel, fmt, one_thread):
    # NaN payloads and signs, infinities, subnormals and negative moments in every input
    for state_dtype in (torch.float32, BF16):
        for master_rounding in _roundings(fmt):
            for math_fn, options in MATHS[:3]:
                _compare(2053, fmt, state_dtype, master_rounding, math_fn, options, steps=1, garbage=True, seed=1)


def test_two_threads_and_chunk_boundaries_equal_the_eager_step(kernel):
    # 70001 values: the eager path's chunks of 32768, the kernel's two threads and a tail
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compare(70001, (BF16, 8, False), torch.float32, "truncate", adam_math, {"decoupled": True}, steps=1)
        _compare(70001, (BF16, 7, True), BF16, "stochastic", adam_math, {"decoupled": True}, steps=1)
    finally:
        torch.set_num_threads(threads)


def test_bf16_states_round_ties_to_even(kernel, one_thread):
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
    cpu_kernel.packed_update_cpu(half.clone(), grad, [torch.zeros(n, dtype=torch.uint8)], [kernel], coef, None,
                                 **static)
    assert_same_bits([eager], [kernel])
    assert kernel[:4].tolist() == [1.0, 1 + 2.0**-6, 1 + 2.0**-6, 1 + 2.0**-5]


def test_offset_and_planes_tensor_match_packed_update(kernel, one_thread):
    g = torch.Generator().manual_seed(3)
    n = 1000
    half, grad, planes, states = inputs(n, BF16, 15, True, torch.float32, 2, g)
    static = dict(math_fn=adam_math, extra_bits=15, stochastic_rounding=True, master_rounding="stochastic",
                  options={"decoupled": True})
    a = [half.clone(), planes.clone(), [s.clone() for s in states]]
    b = [half.clone(), planes.clone(), [s.clone() for s in states]]
    packed_update(a[0], grad, list(a[1].unbind(0)), a[2], coef_for(adam_math), KEY, offset=777, **static)
    cpu_kernel.packed_update_cpu(b[0], grad, b[1], b[2], coef_for(adam_math), torch.tensor(KEY), offset=777, **static)
    assert_same_bits([a[0], a[1], *a[2]], [b[0], b[1], *b[2]])


@pytest.mark.parametrize("fmt", [(BF16, 8, False), (BF16, 15, True)], ids=fmt_id)
def test_a_fused_groups_gradients_read_in_place_equal_the_per_parameter_step(kernel, one_thread, fmt):
    # GradSegments: each parameter's gradient where autograd left it (32-value-aligned segments of the flat
    # buffers, padding between them), against the eager step on each parameter alone
    dtype, k, sr = fmt
    offsets, lengths = (0, 64, 160, 256), (37, 96, 1, 70)
    g = torch.Generator().manual_seed(7)
    half, _, planes, states = inputs(352, dtype, k, sr, torch.float32, 2, g)
    grads = [(torch.randn(n, generator=g) * 1e-3).to(dtype) for n in lengths]
    static = dict(math_fn=adam_math, extra_bits=k, stochastic_rounding=sr, master_rounding="stochastic",
                  options={"decoupled": True})
    ref = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    got = [half.clone(), [p.clone() for p in planes], [s.clone() for s in states]]
    segments = GradSegments(offsets, tuple(grads), gather=lambda: pytest.fail("gathered into a flat copy"))
    cpu_kernel.packed_update_cpu(got[0], segments, got[1], got[2], coef_for(adam_math), KEY, offset=5, **static)
    for at, n, grad in zip(offsets, lengths, grads, strict=True):
        def part(run, at=at, n=n):
            return run[0][at: at + n], [p[at: at + n] for p in run[1]], [s[at: at + n] for s in run[2]]

        h, extra, st = part(ref)
        chunked_update(h, grad, extra, st, coef_for(adam_math), shift_key(KEY, 5 + at), bits=storage_bits(k, sr),
                       **static)
        want, have = part(ref), part(got)
        assert_same_bits([want[0], *want[1], *want[2]], [have[0], *have[1], *have[2]], nan_at=widened_apart(grad))


def test_updates_the_kernel_does_not_take_are_named():
    n = 64
    half, grad = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    states, coef = [torch.zeros(n), torch.zeros(n)], coef_for(adam_math)
    static = dict(math_fn=adam_math, extra_bits=12, stochastic_rounding=False, options={"decoupled": True})
    words = torch.zeros(24, dtype=torch.int32)
    assert "byte planes" in cpu_kernel.unsupported_reason(half, grad, words, states, coef, **static)
    planes = [torch.zeros(n, dtype=torch.uint8)]
    static["extra_bits"] = 8
    assert cpu_kernel.supports(half, grad, planes, states, coef, **static)
    assert "contiguous" in cpu_kernel.unsupported_reason(half, grad[::1].expand(2, n)[:, 0], planes, states, coef,
                                                         **static)
    assert "state" in cpu_kernel.unsupported_reason(half, grad, planes, states[:1], coef, **static)
    # options the kernel does not implement go to the fallback; the same options switched off do not
    for options in ({"decoupled": True, "maximize": True}, {"decoupled": True, "amsgrad": True},
                    {"decoupled": True, "foreach": False}):
        assert "does not implement" in cpu_kernel.unsupported_reason(half, grad, planes, states, coef,
                                                                     **dict(static, options=options))
    assert "scaled" in cpu_kernel.unsupported_reason(half, grad, planes, states, coef, scaled=True, **static)
    assert cpu_kernel.supports(half, grad, planes, states, coef,
                               **dict(static, options={"decoupled": True, "maximize": False, "amsgrad": False}))
    with pytest.raises(ValueError, match="does not take this update"):
        cpu_kernel.packed_update_cpu(half, grad, words, states, coef, None, **dict(static, extra_bits=12))


def _fresh_state(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_STATE", {"tried": False, "ok": False, "error": None, "variant": None,
                                               "source": None, "op": None})
    monkeypatch.setattr(cpu_kernel, "_LOADED", {})


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    cpu_kernel.available()  # the real build first (cached), so the failing one below gets its own name
    # no compiler: a fresh extension directory and a C++ compiler that does not exist
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    _fresh_state(monkeypatch)
    with pytest.warns(RuntimeWarning, match="packed-step kernel failed"):
        assert not cpu_kernel.available()
    assert not cpu_kernel.available()  # tried once, warned once
    n = 100
    g = torch.Generator().manual_seed(4)
    half, grad, planes, states = inputs(n, BF16, 8, False, torch.float32, 2, g)
    static = dict(math_fn=adam_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True})
    calls = []

    def fallback(*args):
        calls.append(1)
        chunked_update(*args, bits=8, **static)

    a = [half.clone(), [p.clone() for p in planes.unbind(0)], [s.clone() for s in states]]
    b = [half.clone(), [p.clone() for p in planes.unbind(0)], [s.clone() for s in states]]
    cpu_kernel.kernel_update(fallback, **static)(a[0], grad, a[1], a[2], coef_for(adam_math), None)
    chunked_update(b[0], grad, b[1], b[2], coef_for(adam_math), None, bits=8, **static)
    assert calls == [1]
    assert_same_bits([a[0], *a[1], *a[2]], [b[0], *b[1], *b[2]])
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernel.packed_update_cpu(a[0], grad, a[1], a[2], coef_for(adam_math), None, **static)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_KERNEL", "0")
    _fresh_state(monkeypatch)
    assert not cpu_kernel.available()
    assert not cpu_kernel._STATE["tried"]  # nothing built, nothing warned


def test_kernel_update_runs_the_kernel_when_it_can(kernel, one_thread):
    n = 300
    g = torch.Generator().manual_seed(5)
    half, grad, planes, states = inputs(n, BF16, 16, False, BF16, 2, g)
    static = dict(math_fn=adam_math, extra_bits=16, stochastic_rounding=False, master_rounding="truncate",
                  options={"decoupled": True})

    def fallback(*args):
        raise AssertionError("the fallback ran")

    a = [half.clone(), list(planes.clone().unbind(0)), [s.clone() for s in states]]
    b = [half.clone(), list(planes.clone().unbind(0)), [s.clone() for s in states]]
    cpu_kernel.kernel_update(fallback, **static)(a[0], grad, a[1], a[2], coef_for(adam_math), None)
    chunked_update(b[0], grad, b[1], b[2], coef_for(adam_math), None, bits=16, **static)
    assert_same_bits([a[0], *a[1], *a[2]], [b[0], *b[1], *b[2]])


def test_the_build_is_named_by_its_variant_and_sources_and_a_stale_lock_is_taken_away(tmp_path, monkeypatch):
    """Two checkouts with different kernels never share a build folder (each would rebuild the other's
    library, and a process could load the other's schema), nor do two variants; a lock left by a killed build
    is removed, since torch waits on it forever, while a fresh lock (a build under way) is waited for until its
    build removes it (tests/probes/test_probe_kernel_lock.py: the wait itself)."""
    import os
    import threading
    import time

    from torch.utils import cpp_extension

    name = cpu_kernel.extension_name("avx512")
    assert name.startswith("workbench_packed_step_avx512_pf32nta_fma_") and len(name.rsplit("_", 1)[1]) == 10
    assert name != cpu_kernel.extension_name("avx2") and name == cpu_kernel.extension_name("avx512")
    assert name != cpu_kernel.extension_name("avx512-pf0") != cpu_kernel.extension_name("avx512-div")
    assert cpu_kernel.extension_name() == cpu_kernel.extension_name(default_variant())
    monkeypatch.delenv(ENV_VARIANT, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)
    monkeypatch.setattr(torch.library, "register_fake", lambda name: (lambda fn: fn))
    monkeypatch.setattr(torch, "ops", type("Ops", (), {"__getattr__": lambda self, ns: _FakeNamespace()})())
    lock = tmp_path / cpu_kernel.extension_name() / "lock"
    lock.parent.mkdir()
    lock.touch()
    _fresh_state(monkeypatch)
    seen = []  # fresh: another process may be compiling; its build takes the lock away
    threading.Timer(0.3, lambda: (seen.append(lock.exists()), lock.unlink())).start()
    with pytest.warns(UserWarning, match="waiting for"):
        cpu_kernel._build()
    assert seen == [True]
    lock.touch()
    old = time.time() - cpu_kernel.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    _fresh_state(monkeypatch)
    with pytest.warns(UserWarning, match=r"removed .*lock, a build lock \d+ s old"):
        cpu_kernel._build()
    assert not lock.exists()


class _FakeNamespace:
    step = type("Step", (), {"default": None})


# ------------------------------------------------------------------------------------------ build variants
# every vector ISA build (the default is AVX512 with VBMI and BF16 where the CPU has them), and a prefetch and a
# division other than the default (the prefetch hint changes no bits; pf0 drops the prefetch code entirely); the
# generic build in a process whose ATen runs its scalar kernels (test_the_generic_build_...)
VARIANTS = ["default", "avx512", "avx2", "default-pf0-div"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant_kernel(request):
    """Each variant built (or loaded from torch's extension cache) once per session, and made the one the kernel
    runs for the module's tests that take this fixture; the build selected before comes back afterwards."""
    if not cpu_kernel.available():
        pytest.skip(f"the C++ kernel could not be built here: {cpu_kernel._STATE['error']}")
    variant = parse_variant(request.param)
    if reason := unusable_reason(variant):
        pytest.skip(reason)
    before = cpu_kernel.use_variant(variant)
    yield variant
    cpu_kernel.use_variant(before)


def test_each_build_variant_equals_the_eager_step(variant_kernel, one_thread):
    assert cpu_kernel.variant() == variant_kernel.name
    for fmt in FORMATS + NO_PLANES:
        for state_dtype in (torch.float32, BF16):
            for master_rounding in _roundings(fmt):
                for math_fn, options in MATHS:
                    _compare(4133, fmt, state_dtype, master_rounding, math_fn, options)
                for math_fn, options in MATHS[:3]:
                    _compare(2053, fmt, state_dtype, master_rounding, math_fn, options, steps=1, garbage=True,
                             seed=1)


def test_each_build_variant_splits_over_two_threads_as_the_eager_step(variant_kernel):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compare(70001, (BF16, 8, False), torch.float32, "truncate", adam_math, {"decoupled": True}, steps=1)
        _compare(70001, (BF16, 16, False), BF16, "stochastic", adam_math, {"decoupled": True}, steps=1)
    finally:
        torch.set_num_threads(threads)


def test_the_generic_build_equals_the_eager_step_of_atens_scalar_kernels():
    """The generic build (the fallback of a CPU without AVX2) against the eager step where ATen runs its scalar
    kernels as such a CPU's does: this file's option and bit-pattern tests in a process started with
    ATEN_CPU_CAPABILITY=default, where the generic build is the default one (with bf16 moments ATen's scalar and
    vector kernels round differently, so it cannot be compared in this process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this process runs ATen's scalar kernels: the tests above checked the generic build")
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VARIANT, "WORKBENCH_CPU_KERNEL")}
    env.update(ATEN_CPU_CAPABILITY="default", **{ENV_VARIANT: "generic"})
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "every_option or random_bit_patterns or two_threads_and_chunk"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


def test_a_build_from_another_checkout_is_loaded_without_compiling(kernel, tmp_path):
    """A build made elsewhere under the same name (sources, flags, torch, compiler) is loaded as it is: in a fresh
    process whose sources are a copy in another folder (cpp_extension.load's ninja file names the old folder, so it
    compiled again: every CI clone, the browser test's copy), with cpp_extension.load made to fail."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension

    name = cpu_kernel.extension_name(cpu_kernel.variant())
    built = Path(cpp_extension._get_build_directory(name, False)) / f"{name}{cpp_extension.LIB_EXT}"
    (tmp_path / "cache" / name).mkdir(parents=True)
    shutil.copy(built, tmp_path / "cache" / name)
    shutil.copytree(Path(cpu_kernel.__file__).parents[1], tmp_path / "checkout" / "workbench")
    script = ("from torch.utils import cpp_extension\n"
              "def refuse(**kw): raise AssertionError('compiled again')\n"
              "cpp_extension.load = refuse\n"
              "import torch\n"
              "from workbench.optim import cpu_kernel\n"
              "assert cpu_kernel.available(), cpu_kernel._STATE\n"
              f"print(cpu_kernel.__file__, cpu_kernel.variant(), torch.ops.{name}.lanes())\n")
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CPU_KERNEL"}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path / "checkout"),
               **{ENV_VARIANT: cpu_kernel.variant()})
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(str(tmp_path / "checkout")) and cpu_kernel.variant() in done.stdout


def test_a_build_is_not_loaded_while_one_is_under_way_or_where_it_does_not_load(tmp_path):
    library = tmp_path / "workbench_packed_step_x.so"
    assert not cpu_kernel._load_built(library)  # none yet
    library.write_bytes(b"not a shared library: a link killed midway")
    assert not cpu_kernel._load_built(library)
    (tmp_path / "lock").touch()
    assert not cpu_kernel._load_built(library)


def test_a_forced_variant_is_the_one_built(monkeypatch):
    monkeypatch.setenv(ENV_VARIANT, "avx2-pf0")
    _fresh_state(monkeypatch)
    built = []
    monkeypatch.setattr(cpu_kernel, "load_variant", lambda v: built.append(v.name) or (lambda *a: None))
    assert cpu_kernel.available() and built == ["avx2-pf0-fma"] and cpu_kernel.variant() == "avx2-pf0-fma"
    assert cpu_kernel._STATE["source"] == "env"
    monkeypatch.setenv(ENV_VARIANT, "avx512+nope")
    _fresh_state(monkeypatch)
    with pytest.raises(ValueError, match="avx512\\+nope"):
        cpu_kernel.available()
