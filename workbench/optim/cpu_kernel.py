"""A hand-written CPU kernel for the packed optimizers' flat step (byte-plane formats), built at first use.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1: merge the
16-bit value with its extra bits, update in fp32, split back ("16bits only mixed-precision"), over a
group's parameters as one stream of values (the "Fused" optimizers, 8 and 16 extra bits).

The kernel (``csrc/packed_step.cpp`` and ``csrc/packed_bf16.cpp`` over ``csrc/packed_kernel.h``) runs
:func:`workbench.optim.update.packed_update` for byte-plane formats (8 or 16 stored bits: bf16+8, bf16+16, fp16+8,
and bf16+7 / bf16+15 / fp16+7 with stochastic rounding; and bf16+0 / fp16+0, no stored bits), Adam(W) or SGD,
fp32, bf16 or 8-bit states (``quantized``, in groups of 32: ``csrc/packed_int8.h``), truncated, stochastic or nearest
master rounding, in one vectorised loop (``at::vec::Vectorized``, AVX512 or AVX2) split over threads with
``at::parallel_for``, each stream prefetched ahead; on AVX512 CPUs that have them, byte permutes (VBMI)
assemble and split the bf16 master values and vcvtneps2bf16 (BF16) stores bf16 moments.
It gives the eager step's bits: the same operations in the same order, each rounded once, ATen's rules
for which NaN an operation returns, and the random bits of ``rng.hash_noise`` computed per element from
(key, index). Tested over ordinary values, special values and random bit patterns, for each build variant
(``tests/optim/test_cpu_kernel.py``).

Build variants (``workbench.optim.cpu_variants``): the ISA (AVX512 with or without the VBMI/BF16 extras, AVX2,
generic), the prefetch distance and hint, the division form, each a set of preprocessor defines and its own build
name. Which is fastest differs by CPU, so the one loaded is, in order: ``WORKBENCH_CPU_KERNEL_VARIANT`` (a variant
name such as ``avx2`` or ``avx512+vbmi+bf16-pf0-div``), else the choice a tuning run measured on this CPU model
and kept beside the builds (``python -m workbench.optim.tune_cpu_kernel``: every variant against torch's fused
AdamW at 1 and 2 threads, a few minutes), else today's build (:func:`cpu_variants.default_variant`); the first
use never tunes.

It is compiled with ``torch.utils.cpp_extension.load`` on the first call of :func:`available` into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), where
later processes find it built, from any checkout and venv with the same sources, torch and compiler.
Without a working C++ compiler :func:`available` warns once and returns False, and :func:`kernel_update`
runs its fallback (the ``torch.compile``d step).
``WORKBENCH_CPU_KERNEL=0`` in the environment turns the kernel off.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from workbench.optim import cpu_variants
from workbench.optim.cpu_variants import (ENV_VARIANT, Variant, default_variant, load_choice, parse_variant,
                                         unusable_reason)
from workbench.optim.formats import storage_bits
from workbench.optim.kernel_args import GradSegments, as_flat, flat_args_reason, planes_of
from workbench.optim.update import adam_math, chunked_update, sgd_math

__all__ = ["available", "build_flags", "extension_name", "kernel_update", "load_variant", "packed_update_cpu",
           "selected_variant", "supports", "unsupported_reason", "use_variant", "variant"]

# NOTE: hand-written because the torch.compile'd step (inductor's C++ backend) measured 0.43-0.56x
# of torch.optim.AdamW(fused=True) at 1 thread and 0.67-0.85x at 2 (issue 21; 0.15-0.45x in
# experiments/packed_bit_optimizers/cpu_throughput.py) although it moves 24 (bf16+8) or 16 (bf16 moments)
# bytes per parameter against torch's 28: inductor tiles 16 fp32 lanes against the mixed fp32/bf16
# stores and writes the uint8 byte planes with masked stores. Here every byte is read and written once
# per step in one loop, and the division by sqrt(1 - beta2**t) leaves the divider (see packed_vec.h).
# the op with the fp16 formats, and the bf16 formats: two translation units over packed_kernel.h's templates, which
# ninja compiles side by side (one per core)
SOURCES = [Path(__file__).resolve().parent / "csrc" / name for name in ("packed_step.cpp", "packed_bf16.cpp")]

_STATE: dict[str, Any] = {"tried": False, "ok": False, "error": None, "variant": None, "source": None, "op": None}
_LOADED: dict[str, Any] = {}  # variant name -> its step op, for each build loaded in this process
_FAKES: set[str] = set()  # the op namespaces given a fake kernel (once per process: a second one is an error)
# the options each algorithm's kernel reads; _OFF_ONLY ones are taken only when off
_OPTIONS = {adam_math: {"decoupled"}, sgd_math: {"momentum", "nesterov", "first"}}
_OFF_ONLY = {"maximize", "amsgrad"}


def _variant_of(variant: Variant | str | None) -> Variant:
    if variant is None:
        return default_variant()
    return variant if isinstance(variant, Variant) else parse_variant(variant)


def build_flags(variant: Variant | str | None = None) -> list[str]:
    """The C++ flags of a variant's build (by default :func:`cpu_variants.default_variant`, today's build: torch's
    CPU capability, on AVX512 with ``-mavx512vbmi`` and ``-mavx512bf16`` where the CPU has them)."""
    return cpu_variants.build_flags(_variant_of(variant))


# NOTE: a build killed midway leaves torch's `lock` file in the build folder, and torch then waits on it
# forever, in silence. torch writes the lock once, when a build starts, and a build takes 20-60 s on 2 cores,
# so a lock older than this is taken as abandoned; a younger one is waited for, said (`wait_for_build_lock`).
STALE_LOCK_S = 300.0


def wait_for_build_lock(lock: Path, stale_after: float | None = None) -> None:
    """Return once no build holds `lock` (torch's build lock of the kernel's folder): at once where there is none,
    when another process's build removes it, or after removing it once it is `stale_after` seconds old
    (`STALE_LOCK_S`: a build killed midway). Says so, naming the file, when it has to wait or remove."""
    stale_after = STALE_LOCK_S if stale_after is None else stale_after
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            lock.unlink(missing_ok=True)
            warnings.warn(f"workbench.optim.cpu_kernel: removed {lock}, a build lock {age:.0f} s old (a build killed "
                          f"midway leaves it, and torch would wait on it forever); building the kernel now",
                          stacklevel=3)
            return
        if not told:
            warnings.warn(f"workbench.optim.cpu_kernel: waiting for {lock}: another process is building the kernel, "
                          f"or a build killed midway left it; it is taken as abandoned in {stale_after - age:.0f} s "
                          f"(delete it yourself if no build runs)", stacklevel=3)
            told = True
        time.sleep(min(1.0, max(0.05, stale_after - age)))


def extension_name(variant: Variant | str | None = None) -> str:
    """The build's name in torch's extension cache and its op namespace: the variant (by default today's) and a
    digest of the sources and flags, so two checkouts with different kernels never share one build folder."""
    return cpu_variants.extension_name(_variant_of(variant))


def selected_variant() -> tuple[Variant, str]:
    """The variant :func:`available` builds, and why: ``WORKBENCH_CPU_KERNEL_VARIANT`` (``"env"``), else the
    choice a tuning run kept for this CPU and these sources (``"measured"``), else ``"default"``. Raises
    ValueError for a variable naming no variant or one this CPU cannot run."""
    text = os.environ.get(ENV_VARIANT, "").strip()
    if text:
        variant = parse_variant(text)
        if reason := unusable_reason(variant):
            raise ValueError(f"{ENV_VARIANT}={text!r}: {reason}; e.g. {default_variant().name}")
        return variant, "env"
    record = load_choice()
    if record is not None:
        variant = parse_variant(record["chosen"])
        if unusable_reason(variant) is None:
            return variant, "measured"
    return default_variant(), "default"


def load_variant(variant: Variant | str) -> Callable:
    """Compile (or find in torch's extension cache) and load a variant's build; returns its step op. Several
    variants load side by side (each registers its ops under its own build name)."""
    from torch.utils import cpp_extension

    variant = _variant_of(variant)
    if variant.name in _LOADED:
        return _LOADED[variant.name]
    if reason := unusable_reason(variant):
        raise ValueError(reason)
    name = extension_name(variant)
    folder = Path(cpp_extension._get_build_directory(name, False))
    if not _load_built(folder / f"{name}{cpp_extension.LIB_EXT}"):
        wait_for_build_lock(folder / "lock")
        cpp_extension.load(
            name=name, sources=[str(path) for path in SOURCES], extra_cflags=build_flags(variant),
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    # under fake tensors (CalcGraph's plan of a step) the in-place update allocates nothing
    if name not in _FAKES:
        torch.library.register_fake(f"{name}::step")(_allocates_nothing)
        _FAKES.add(name)
    _LOADED[variant.name] = getattr(torch.ops, name).step.default
    return _LOADED[variant.name]


def _load_built(library: Path) -> bool:
    """Load a build finished earlier under this name (its sources, flags, torch and compiler: `extension_name`);
    False where there is none, one is under way (torch's lock beside it) or it does not load.

    # NOTE: not left to cpp_extension.load: its ninja file holds the source's and torch's include paths, so a
    # checkout in another folder or with another venv (every CI run, the browser test's copy of the repo) compiled
    # the same kernel again: 44 s on the 2-core EPYC, once per notebook build from a fresh clone and per variant
    # in the tests
    """
    if not library.is_file() or (library.parent / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # a build killed while linking: built again
        return False
    return True


def _build() -> None:
    """Load the selected variant (:func:`selected_variant`) and make it the one the step runs."""
    variant, source = selected_variant()
    _STATE["variant"], _STATE["source"] = variant.name, source
    _STATE["op"] = load_variant(variant)


def use_variant(variant: Variant | str) -> str | None:
    """Make ``variant`` (built or loaded first) the build every later kernel call runs, in this process; returns
    the name of the one it replaces. For measuring variants against each other (``tune_cpu_kernel``)."""
    op = load_variant(variant)
    before = _STATE["variant"]
    _STATE.update(tried=True, ok=True, error=None, op=op, variant=_variant_of(variant).name,
                  source=_STATE["source"] or "use_variant")
    return before


def variant() -> str | None:
    """The name of the build the kernel runs (None before :func:`available` loaded one, or when none loaded)."""
    return _STATE["variant"] if _STATE["ok"] else None


def _allocates_nothing(*args: Any) -> None:
    return None


def available() -> bool:
    """True when the kernel is built and loaded; builds it on the first call (seconds, then cached).

    The build is :func:`selected_variant`'s: ``WORKBENCH_CPU_KERNEL_VARIANT``, else the variant a tuning run
    (``python -m workbench.optim.tune_cpu_kernel``) chose on this CPU, else today's default. False with a
    warning (once) when the build fails, e.g. without a C++ compiler; False without one when
    ``WORKBENCH_CPU_KERNEL=0`` is set. A variable naming no variant raises ValueError.
    """
    if os.environ.get("WORKBENCH_CPU_KERNEL", "1") == "0":
        return False
    if not _STATE["tried"]:
        selected_variant()  # a bad WORKBENCH_CPU_KERNEL_VARIANT is an error, not a silent fallback
        _STATE["tried"] = True
        try:
            _build()
            _STATE["ok"] = True
        except Exception as e:  # noqa: BLE001 - any build or load failure means: use the fallback
            text = f"{type(e).__name__}: {e}".strip()
            first, _, rest = text.partition("\n")
            _STATE["error"] = first[:300] + (f" ... {rest[-600:]}" if rest else "")
            warnings.warn(
                "workbench.optim.cpu_kernel: building the C++ packed-step kernel failed "
                f"({_STATE['error']}); the packed optimizers keep the torch.compile'd step",
                RuntimeWarning, stacklevel=2,
            )
    return bool(_STATE["ok"])


def _static_reason(math_fn: Callable, options: dict[str, Any], scaled: bool) -> str | None:
    """Why the kernel cannot run an update with these keywords, whatever its tensors (None when it can)."""
    if math_fn is not adam_math and math_fn is not sgd_math:
        return f"math_fn {getattr(math_fn, '__name__', math_fn)!r}: only adam_math and sgd_math"
    known = _OPTIONS[math_fn]
    unknown = sorted(k for k in options if k not in known and not (k in _OFF_ONLY and not options[k]))
    if unknown or scaled:
        return f"options the kernel does not implement: {unknown + (['scaled'] if scaled else [])}"
    return None


def _tensor_checks(math_fn: Callable, extra_bits: int, stochastic_rounding: bool, master_rounding: str,
                   options: dict[str, Any], quantized: tuple[str, ...] = ()) -> dict[str, Any]:
    """``kernel_args.flat_args_reason``'s keywords for an update the kernel takes by its keywords."""
    return dict(device_type="cpu", extra_bits=extra_bits, stochastic_rounding=stochastic_rounding,
                master_rounding=master_rounding, quantized=quantized,
                n_states=2 if math_fn is adam_math else int(bool(options.get("momentum"))),
                n_coef=9 if math_fn is adam_math else 4, planes=(0, 1, 2))


def unsupported_reason(
    half: torch.Tensor, grad: torch.Tensor, extra: Any, states: Sequence[torch.Tensor], coef: torch.Tensor, *,
    math_fn: Callable, extra_bits: int, stochastic_rounding: bool, master_rounding: str = "truncate",
    options: dict[str, Any], scaled: bool = False, quantized: tuple[str, ...] = (),
) -> str | None:
    """Why the kernel cannot run this update (None when it can); checks the arguments, builds nothing.

    The kernel takes Adam(W) (``decoupled``) and SGD (``momentum``, ``nesterov``, ``first``); options
    it does not implement (``maximize``, ``amsgrad``, loss scaling ``scaled``, any other name) are
    refused, so the caller's fallback computes them.
    """
    return _static_reason(math_fn, options, scaled) or flat_args_reason(
        half, grad, extra, states, coef,
        **_tensor_checks(math_fn, extra_bits, stochastic_rounding, master_rounding, options, quantized))


def supports(half, grad, extra, states, coef, **static) -> bool:
    """True when the kernel can run this update (:func:`unsupported_reason` is None); builds nothing."""
    return unsupported_reason(half, grad, extra, states, coef, **static) is None


def packed_update_cpu(
    half: torch.Tensor, grad: torch.Tensor, extra: Sequence[torch.Tensor] | torch.Tensor,
    states: Sequence[torch.Tensor], coef: torch.Tensor, key: torch.Tensor | int | None, *, math_fn: Callable,
    extra_bits: int, stochastic_rounding: bool, master_rounding: str = "truncate", options: dict[str, Any],
    scaled: bool = False, quantized: tuple[str, ...] = (), offset: int = 0,
) -> None:
    """:func:`workbench.optim.update.packed_update` (same arguments, same bits) run by the C++ kernel.

    ``extra`` is the list of byte planes (or their ``(planes, n)`` uint8 tensor). Raises ValueError
    for an update the kernel does not take (see :func:`unsupported_reason`) and RuntimeError when the
    kernel is not available.
    """
    static = dict(math_fn=math_fn, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding,
                  master_rounding=master_rounding, options=options, quantized=quantized)
    reason = unsupported_reason(half, grad, extra, states, coef, scaled=scaled, **static)
    if reason is not None:
        raise ValueError(f"the CPU packed-step kernel does not take this update: {reason}")
    if not available():
        raise RuntimeError(f"the CPU packed-step kernel is not available: {_STATE['error'] or 'turned off'}")
    _run(half, grad, extra, states, coef, key, offset=offset, **static)


def _kernel_args(math_fn: Callable, extra_bits: int, stochastic_rounding: bool, master_rounding: str,
                 options: dict[str, Any], scaled: bool = False, quantized: tuple[str, ...] = ()) -> tuple:
    """What the kernel call takes from the keywords: (stored bits, needs a key, the op's trailing arguments)."""
    math = (0 if options.get("decoupled", False) else 1) if math_fn is adam_math else 2  # AdamW, Adam, SGD
    master = ("truncate", "stochastic", "nearest").index(master_rounding)  # the op's int
    flags = (int(extra_bits), bool(stochastic_rounding), master, math, bool(options.get("momentum", False)),
             bool(options.get("nesterov", False)), bool(options.get("first", False)))
    return storage_bits(extra_bits, stochastic_rounding), bool(stochastic_rounding) or master == 1, flags


def _run(half, grad, extra, states, coef, key, *, offset=0, **static) -> None:
    """The kernel call itself, for arguments :func:`unsupported_reason` accepted."""
    _launch(half, grad, extra, states, coef, key, offset, _kernel_args(**static))


def _launch(half, grad, extra, states, coef, key, offset: int, kernel_args: tuple) -> None:
    bits, needs_key, flags = kernel_args
    if key is None and needs_key:
        raise ValueError("stochastic rounding needs a random key")
    grads, offsets = (grad.grads, grad.offsets) if isinstance(grad, GradSegments) else ((grad,), (0,))
    _STATE["op"](half, grads, offsets, planes_of(extra, bits), states, coef,
                                                0 if key is None else int(key), int(offset), *flags)


def kernel_update(fallback: Callable | None = None, **static: Any) -> Callable:
    """The flat step ``(half, grad, extra, states, coef, key)`` with :func:`packed_update`'s keywords bound.

    The calling convention of :func:`workbench.optim.update.compiled_update`'s result (``grad`` may also be a
    fused group's :class:`~workbench.optim.kernel_args.GradSegments`, read in place): each call runs the C++
    kernel when it is available and takes the update, else ``fallback`` (e.g. the compiled step; None:
    :func:`workbench.optim.update.chunked_update`, the eager step) on the flat gradient.
    """
    if fallback is None:
        bits = storage_bits(static["extra_bits"], static["stochastic_rounding"])

        def fallback(half, grad, extra, states, coef, key):
            chunked_update(half, grad, extra, states, coef, key, bits=bits, **static)

    # NOTE: what depends on the keywords alone is checked and converted once, here; the tensors are checked
    # at every call (a fused group's gradients are new tensors each step).
    refused = _static_reason(static["math_fn"], static["options"], static.get("scaled", False))
    checks = None if refused else _tensor_checks(**{k: v for k, v in static.items() if k != "scaled"})
    kernel_args = None if refused else _kernel_args(**static)

    def update(half, grad, extra, states, coef, key) -> None:
        if refused is None and available() and flat_args_reason(half, grad, extra, states, coef, **checks) is None:
            _launch(half, grad, extra, states, coef, key, 0, kernel_args)
        else:
            fallback(half, as_flat(grad), extra, states, coef, key)

    return update
