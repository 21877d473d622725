"""``fused=True`` runs the fastest step available on the device, chosen in one place
(``workbench.optim.fused.select_step``): the compiled update where torch.compile works, the eager one
where it does not or fails to build, and a backend put at the front of ``STEP_BACKENDS`` (the slot a
hand-written kernel plugs into) before either. Lewandowski & Kosson, 3.1 ("Fused" optimizers)."""

import pytest
import torch

from workbench.optim import PackedAdamW, fused
from workbench.optim.fused import StepSpec, compile_available, eager_step, select_step

BF16 = torch.bfloat16
SHAPES = [(37, 5), (64,), (3, 3, 3)]
needs_compile = pytest.mark.skipif(not compile_available("cpu"), reason="torch.compile has no C++ compiler here")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(BF16)) for s in SHAPES]


def _run(opt, params, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(BF16)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params] + [opt.state[p]["extra"].clone() for p in params]


def _spec():
    from workbench.optim.update import sgd_math

    static = dict(math_fn=sgd_math, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options=dict(momentum=False, nesterov=False, first=True), scaled=False)
    return StepSpec(static, 8, BF16, torch.float32, dynamic=True)


def test_explicit_choices_and_the_unfused_default(monkeypatch):
    from workbench.optim import cpu_kernel

    cpu = torch.device("cpu")
    assert select_step(cpu, _spec(), fused=True, compile=False)[0] == "eager"
    assert select_step(cpu, _spec(), fused=False, compile=False)[0] == "eager"
    # not fused, compile=None: the C++ kernel per parameter where it is built, else the eager step
    expected = "cpu_kernel" if cpu_kernel.available() else "eager"
    assert select_step(cpu, _spec(), fused=False, compile=None)[0] == expected
    opt = PackedAdamW(_params(), extra_bits=8)
    assert opt.step_backend() == expected and opt.step_backend(per_parameter=True) == expected
    assert PackedAdamW(_params(), extra_bits=8, amsgrad=True).step_backend() == "eager"  # the kernel lacks it
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    assert PackedAdamW(_params(), extra_bits=8).step_backend() == "eager"


def test_the_unfused_kernel_step_computes_what_eager_does_and_allocates_nothing_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from workbench.optim import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("no C++ compiler for the CPU kernel here")
    params, ref = _params(), _params()
    opt = PackedAdamW(params, lr=1e-2, extra_bits=8, seed=3)
    eager = PackedAdamW(ref, lr=1e-2, extra_bits=8, seed=3, compile=False)
    for a, b in zip(_run(opt, params), _run(eager, ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with FakeTensorMode():  # the step CalcGraph plans: one call per parameter, nothing allocated
        p = torch.nn.Parameter(torch.zeros(4096, 64, dtype=BF16))
        fake = PackedAdamW([p], extra_bits=8, seed=0)
        p.grad = torch.ones_like(p)
        fake.step()
        assert fake.step_backend() == "cpu_kernel" and fake.state[p]["extra"].shape == (1, 4096 * 64)


@needs_compile
@pytest.mark.parametrize("kernel", [True, False])
def test_fused_alone_selects_the_fastest_step_and_computes_what_eager_does(monkeypatch, kernel):
    from workbench.optim import cpu_kernel

    if not kernel:  # no C++ kernel (no compiler, or WORKBENCH_CPU_KERNEL=0): the compiled step
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    expected = "cpu_kernel" if kernel and cpu_kernel.available() else "compiled"
    params = _params()
    opt = PackedAdamW(params, lr=1e-2, extra_bits=16, fused=True)
    assert opt.step_backend() == expected and opt.step_backend(per_parameter=True) == expected
    ref = _params()
    eager = PackedAdamW(ref, lr=1e-2, extra_bits=16, fused=True, compile=False)
    for a, b in zip(_run(opt, params), _run(eager, ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_torch_compile_fused_falls_back_to_eager_and_compile_true_says_why(monkeypatch):
    from workbench.optim import cpu_kernel

    monkeypatch.setattr(fused, "compile_available", lambda device_type: False)
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)  # nor a C++ kernel
    opt = PackedAdamW(_params(), extra_bits=8, fused=True)
    assert opt.step_backend() == "eager"
    with pytest.raises(RuntimeError, match=r"compile=True, but torch.compile cannot build code for cpu.*"
                                           r"use compile=None"):
        select_step(torch.device("cpu"), _spec(), fused=True, compile=True)


def test_a_backend_at_the_front_of_the_list_is_used_first(monkeypatch):
    calls = []

    def plugged(device, spec):
        if spec.static["extra_bits"] != 8:
            return None  # cannot serve this format: the next backend is asked
        inner = eager_step(device, spec)

        def step(*args):
            calls.append(args[0].numel())
            inner(*args)

        return step

    monkeypatch.setattr(fused, "STEP_BACKENDS", [("plugged", plugged), *fused.STEP_BACKENDS])
    params = _params()
    opt = PackedAdamW(params, extra_bits=8, fused=True)
    assert opt.step_backend() == "plugged"
    out = _run(opt, params)
    assert len(calls) == 3  # one flat update per step
    ref = _params()
    for a, b in zip(out, _run(PackedAdamW(ref, extra_bits=8, fused=True, compile=False), ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(fused, "compile_available", lambda device_type: False)
    assert PackedAdamW(_params(), extra_bits=5, fused=True).step_backend() == "eager"


def test_a_backend_that_fails_to_build_warns_once_and_eager_takes_over(monkeypatch):
    def broken(device, spec):
        def step(*args):
            raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: no working C++ compiler")

        return step

    monkeypatch.setattr(fused, "STEP_BACKENDS", [("broken", broken), ("eager", eager_step)])
    monkeypatch.setattr(fused, "_FAILED", set())
    params = _params()
    opt = PackedAdamW(params, extra_bits=8, fused=True)
    with pytest.warns(UserWarning, match=r"the broken packed update failed to build on cpu.*eager update"):
        out = _run(opt, params)
    assert opt.step_backend() == "eager"  # skipped from then on
    ref = _params()
    for a, b in zip(out, _run(PackedAdamW(ref, extra_bits=8, fused=True, compile=False), ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_lazily_imported_backend_is_skipped_while_its_module_is_missing(monkeypatch):
    # the one-line plug-in for a kernel in a module of its own: absent module, next backend
    missing = fused.lazy_backend("workbench.optim.no_such_kernel", "packed_step")
    monkeypatch.setattr(fused, "STEP_BACKENDS", [("kernel", missing), ("eager", eager_step)])
    assert PackedAdamW(_params(), extra_bits=8, fused=True).step_backend() == "eager"
    present = fused.lazy_backend("workbench.optim.fused", "eager_step")
    monkeypatch.setattr(fused, "STEP_BACKENDS", [("kernel", present), ("eager", eager_step)])
    assert PackedAdamW(_params(), extra_bits=8, fused=True).step_backend() == "kernel"


def test_the_cpu_kernel_adapter_keeps_away_the_updates_the_kernel_does_not_take(monkeypatch):
    # a stand-in for workbench.optim.cpu_kernel (building the real one is its own tests' business)
    import sys
    import types

    built = []
    fake = types.ModuleType("workbench.optim.cpu_kernel")
    fake.available = lambda: True
    fake.kernel_update = lambda fallback=None, **static: built.append(static) or fallback
    monkeypatch.setitem(sys.modules, "workbench.optim.cpu_kernel", fake)
    cpu = torch.device("cpu")
    spec = _spec()
    assert fused.cpu_kernel_step(cpu, spec) is not None and "scaled" not in built[0]
    for change in (dict(scaled=True), dict(options=dict(spec.static["options"], maximize=True))):
        assert fused.cpu_kernel_step(cpu, StepSpec(dict(spec.static, **change), 8, BF16, torch.float32, True)) is None
    assert fused.cpu_kernel_step(torch.device("cuda"), spec) is None
    fake.available = lambda: False
    assert fused.cpu_kernel_step(cpu, spec) is None


def test_the_fused_kernel_step_reads_fresh_gradients_where_autograd_left_them(one_thread):
    # zero_grad(set_to_none=True), torch's default, leaves new gradient tensors each step: the C++ kernel reads
    # them in place (no flat gradient copy, which cost a read, a write and a fresh buffer per step)
    from workbench.measure import MemoryMeter
    from workbench.optim import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("no C++ compiler for the CPU kernel here")
    params, ref = _params(), _params()
    opt = PackedAdamW(params, lr=1e-2, extra_bits=8, fused=True)
    eager = PackedAdamW(ref, lr=1e-2, extra_bits=8, fused=True, compile=False)
    assert opt.step_backend() == "cpu_kernel"
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g).to(BF16) for p in params]
        for o, ps in ((opt, params), (eager, ref)):
            for p, grad in zip(ps, grads, strict=True):
                p.grad = grad.clone()
            with MemoryMeter("cpu") as meter:
                o.step()
            o.zero_grad(set_to_none=True)
            if o is opt and step > 0:  # after the first step: only the step's 9 coefficients are new
                assert meter.peak_bytes <= 64, meter.peak_bytes
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["extra"], eager.state[q]["extra"], rtol=0, atol=0)


def _replace_parameter(opt, p):
    p.data = p.detach() * 2  # a new storage (bf16 doubling is exact)


def _replace_state_dict(opt, p):
    opt.state[p] = dict(opt.state[p])


def _replace_moment(opt, p):
    opt.state[p]["exp_avg"] = torch.full_like(opt.state[p]["exp_avg"], 1e-3)


def _replace_extra_bits(opt, p):
    opt.state[p]["extra"] = torch.zeros_like(opt.state[p]["extra"])


def _drop_moment(opt, p):
    del opt.state[p]["exp_avg_sq"]  # made again, as zeros, by the next step


def _change_hyperparameters(opt, p):
    opt.param_groups[0].update(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize("change", [_replace_parameter, _replace_state_dict, _replace_moment, _replace_extra_bits,
                                    _drop_moment, _change_hyperparameters], ids=lambda f: f.__name__.strip("_"))
def test_the_fused_step_follows_every_change_its_cached_checks_guard(one_thread, change):
    # FlatGroup.valid and the kernel's keyword checks run once per step or once per update: each thing they
    # guard, changed between steps, must reach the next step as it does in a per-parameter (unfused) twin
    from workbench.optim import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("no C++ compiler for the CPU kernel here")
    params, ref = _params(), _params()
    opt = PackedAdamW(params, lr=1e-2, extra_bits=8, fused=True)
    twin = PackedAdamW(ref, lr=1e-2, extra_bits=8, fused=False)
    assert opt.step_backend() == "cpu_kernel"
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g).to(BF16) for p in params]
        if step == 3:  # a gradient laid out otherwise (transposed strides): read in the parameter's order
            grads[0] = grads[0].t().contiguous().t()
        for o, ps in ((opt, params), (twin, ref)):
            if step == 2:
                change(o, ps[0])
            for p, grad in zip(ps, grads, strict=True):
                p.grad = grad.clone(memory_format=torch.preserve_format)
            o.step()
            o.zero_grad(set_to_none=True)
        if step == 2:
            assert opt._flat[0].valid(opt.state)
    for p, q in zip(params, ref, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for k in ("extra", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k].reshape(-1), twin.state[q][k].reshape(-1)), k
