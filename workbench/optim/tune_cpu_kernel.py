"""Measure every build variant of the CPU packed step against torch's fused AdamW, and keep the fastest per CPU.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (the fused packed
optimizers) and Fig 3 (their step's throughput); issue 48: the fastest build of ``csrc/packed_step.cpp`` differs
by CPU (``workbench.optim.cpu_variants`` names the variants).

Each variant runs ``PackedAdamW(fused=True).step()`` as a training loop calls it (new gradient tensors each
step) on ``numel`` parameters in ``n_tensors`` tensors, for bf16+8 and bf16+16 with fp32 moments and bf16+8 with
bf16 moments, every sample paired with a sample of ``torch.optim.AdamW(fused=True).step()`` on the same number
of fp32 parameters timed right beside it (order alternating, variants rotated round by round), so that load
from other processes falls on both. ``ratio`` is the median over rounds of torch's time / the variant's
(above 1: faster than torch), ``ratio_p25``/``ratio_p75`` its quartiles, ``ratio_best`` torch's fastest sample
over the variant's (load from other processes only adds time). A variant's score is the geometric
mean of its ratios over formats and thread counts; a first round measures the default build and each
variant with one knob changed, a second round measures again the default, the two best and the default with
each knob's winner, and the choice (:func:`cpu_variants.choose`: the best unless within 2% of the default)
is kept in torch's extension cache beside the builds, keyed by the CPU model and the sources, where
``cpu_kernel.available()`` finds it in later processes. Builds take 20-60 s each the first time.

Measure every variant at 1 and 2 threads and keep the choice with::

    python -m workbench.optim.tune_cpu_kernel

(``--variants avx2 avx512-pf0`` measures only those; ``--no-save`` keeps nothing; ``--csv`` writes the table).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch

from workbench.optim import cpu_kernel, cpu_variants
from workbench.optim.cpu_variants import Variant, parse_variant

__all__ = ["FORMATS", "main", "measure_variants", "training_step", "tune"]

# (label, extra bits, moment dtype)
FORMATS = (("bf16+8", 8, torch.float32), ("bf16+16", 16, torch.float32), ("bf16+8 bf16 moments", 8, torch.bfloat16))
SAMPLE_S = 0.01  # the least time of one timed sample (steps in a row): ~1 step of 4M parameters


def training_step(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], sizes: Sequence[int],
                  dtype: torch.dtype, device: torch.device | str = "cpu",
                  ) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
    """An optimizer over new parameters of ``sizes``, and its step as a training loop runs it: before each
    ``step()`` every parameter gets a gradient tensor it did not hold the step before (what backward leaves
    after ``zero_grad(set_to_none=True)``, torch's default), from two sets made beforehand so that no
    gradient is computed or allocated inside the timed step."""
    params = [torch.zeros(n, device=device, dtype=dtype, requires_grad=True) for n in sizes]
    pool = [[(torch.randn(n, device=device) * 1e-3).to(dtype) for n in sizes] for _ in range(2)]
    opt, turn = make(params), [0]

    def step() -> None:
        for p, g in zip(params, pool[turn[0]], strict=True):
            p.grad = g
        turn[0] ^= 1
        opt.step()

    return opt, step


def _timed(fn: Callable[[], None], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure_variants(
    variants: Iterable[Variant | str], *, threads: int = 1, numel: int = 1 << 22, n_tensors: int = 8,
    formats: Sequence[tuple] = FORMATS, repeats: int = 15, progress: bool = False,
) -> pd.DataFrame:
    """One row per (variant, format): the variant's ``PackedAdamW`` step against torch's fused fp32 AdamW step,
    paired sample by sample (see the module docstring), at ``threads`` intra-op threads. Builds what is not
    built; the build the process ran before is restored afterwards."""
    from workbench.optim.algorithms import PackedAdamW

    variants = [v if isinstance(v, Variant) else parse_variant(v) for v in variants]
    if not variants:
        raise ValueError("measure_variants: no variant given")
    if numel < n_tensors or n_tensors < 1:
        raise ValueError(f"numel={numel} must be >= n_tensors={n_tensors} >= 1")
    if repeats < 3 or threads < 1:
        raise ValueError(f"repeats={repeats} must be >= 3 and threads={threads} >= 1")
    if not cpu_kernel.available():
        raise RuntimeError(f"the CPU kernel is not available ({cpu_kernel._STATE['error'] or 'turned off'}): "
                           "nothing to measure")
    before, saved_threads = cpu_kernel.variant(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for v in variants:
            cpu_kernel.load_variant(v)  # builds first, so that no build falls between timed samples
        load_before = os.getloadavg()[0]
        torch.manual_seed(0)
        sizes = [numel // n_tensors + (numel % n_tensors if i == 0 else 0) for i in range(n_tensors)]
        _, torch_step = training_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), sizes, torch.float32)
        steps = {}
        for label, k, sdt in formats:
            opt, step = training_step(lambda ps, k=k, sdt=sdt: PackedAdamW(ps, lr=1e-3, extra_bits=k, fused=True,
                                                                           state_dtype=sdt), sizes, torch.bfloat16)
            if opt.step_backend() != "cpu_kernel":
                raise RuntimeError(f"{label}: PackedAdamW runs {opt.step_backend()!r}, not the CPU kernel")
            steps[label] = step
        items = [(v, label) for v in variants for label in steps]

        def run(item) -> Callable[[], None]:
            cpu_kernel.use_variant(item[0])
            return steps[item[1]]

        for _ in range(2):  # warm-up: every build's first call, the optimizers' state
            torch_step()
            for item in items:
                run(item)()
        calls = max(1, round(SAMPLE_S / max(_timed(torch_step, 1), 1e-6)))
        times: dict[tuple, list[tuple[float, float]]] = {item: [] for item in items}
        from tqdm.auto import tqdm

        for r in tqdm(range(repeats), desc=f"variants, {threads} thread(s)", disable=not progress, leave=False):
            shift = r % len(items)
            for j, item in enumerate(items[shift:] + items[:shift]):
                step = run(item)
                if (r + j) % 2:
                    t_torch = _timed(torch_step, calls)
                    t_item = _timed(step, calls)
                else:
                    t_item = _timed(step, calls)
                    t_torch = _timed(torch_step, calls)
                times[item].append((t_torch, t_item))
        load_after = os.getloadavg()[0]
    finally:
        torch.set_num_threads(saved_threads)
        if before is not None:
            cpu_kernel.use_variant(before)
    rows = []
    for (v, label), pairs in times.items():
        ratios = [a / b for a, b in pairs]
        p25, _, p75 = statistics.quantiles(ratios, n=4, method="inclusive")
        med_item, med_torch = statistics.median(b for _, b in pairs), statistics.median(a for a, _ in pairs)
        rows.append({"variant": v.name, "format": label, "threads": threads, "ratio": statistics.median(ratios),
                     "ratio_p25": p25, "ratio_p75": p75, "ratio_lo": min(ratios), "ratio_hi": max(ratios),
                     "ratio_best": min(a for a, _ in pairs) / min(b for _, b in pairs),
                     "steps_per_s": 1 / med_item, "torch_steps_per_s": 1 / med_torch, "numel": numel,
                     "n_tensors": n_tensors, "repeats": repeats, "calls_per_sample": calls})
    df = pd.DataFrame(rows)
    df["cpu"] = cpu_variants.cpu_model()
    df["torch"] = torch.__version__
    df["load_before"], df["load_after"] = round(load_before, 2), round(load_after, 2)
    return df


def tune(
    *, threads: Sequence[int] = (1, 2), numel: int = 1 << 22, n_tensors: int = 8, repeats: int = 15,
    variants: Iterable[Variant | str] | None = None, save: bool = True, progress: bool = False,
) -> tuple[pd.DataFrame, dict]:
    """Measure the variants (by default :func:`cpu_variants.candidates`, then a second round of finalists) at
    each thread count, choose one (:func:`cpu_variants.choose`), keep it (``save``) and run it from now on in
    this process. Returns the table (``stage`` 1 and 2) and the record kept."""
    base = cpu_variants.default_variant()
    explicit = variants is not None
    first = [v if isinstance(v, Variant) else parse_variant(v) for v in variants] if explicit else \
        cpu_variants.candidates(base)

    def measure(vs: list[Variant], stage: int, reps: int) -> pd.DataFrame:
        vs = [v for v in vs if _builds(v)]
        frames = [measure_variants(vs, threads=t, numel=numel, n_tensors=n_tensors, repeats=reps, progress=progress)
                  for t in threads]
        return pd.concat(frames, ignore_index=True).assign(stage=stage)

    df = measure(first, 1, repeats)
    final = df
    if not explicit:
        again = cpu_variants.finalists(df.to_dict("records"), base)
        final = measure(again, 2, 2 * repeats)
        df = pd.concat([df, final], ignore_index=True)
    records = final.to_dict("records")
    chosen = cpu_variants.choose(records, base.name)
    record = {
        "chosen": chosen, "default": base.name, "cpu": cpu_variants.cpu_model(), "torch": torch.__version__,
        "source_digest": cpu_variants.source_digest(),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": list(threads), "numel": numel, "n_tensors": n_tensors, "margin": cpu_variants.CHOICE_MARGIN,
        "scores": cpu_variants.scores(records),
        "load": [float(df["load_before"].min()), float(df["load_after"].max())],
        "records": [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in df.to_dict("records")],
    }
    if save:
        record["path"] = str(cpu_variants.save_choice(record))
    cpu_kernel.use_variant(chosen)
    cpu_kernel._STATE["source"] = "measured"
    return df, record


def _builds(variant: Variant) -> bool:
    """Whether ``variant`` builds and loads here; a build that fails (a compiler without one of its flags) is
    left out of the measurement with a warning rather than ending the run."""
    try:
        cpu_kernel.load_variant(variant)
    except Exception as e:  # noqa: BLE001 - any build failure: measure the others
        warnings.warn(f"tune_cpu_kernel: {variant.name} left out, its build failed: {type(e).__name__}: "
                      f"{str(e)[:300]}", RuntimeWarning, stacklevel=2)
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    """Print every variant's ratio against torch at 1 and 2 threads, and keep the choice."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--numel", type=int, default=1 << 22, help="parameters (default 4M)")
    ap.add_argument("--tensors", type=int, default=8, help="the parameters are split into this many tensors")
    ap.add_argument("--repeats", type=int, default=15, help="paired samples per variant and format (first round)")
    ap.add_argument("--variants", nargs="+", help="measure only these (names or short forms: avx2, avx512-pf0)")
    ap.add_argument("--no-save", action="store_true", help="keep no choice (the build used stays as it is)")
    ap.add_argument("--csv", help="also write the table to this path")
    args = ap.parse_args(argv)
    df, record = tune(threads=args.threads, numel=args.numel, n_tensors=args.tensors, repeats=args.repeats,
                      variants=args.variants, save=not args.no_save, progress=True)
    print_table(df, record)
    if args.csv:
        df.to_csv(args.csv, index=False)


def print_table(df: pd.DataFrame, record: dict) -> None:
    """The table a tuning run prints: one row per (stage, threads, variant, format), then the scores."""
    cols = ["stage", "threads", "variant", "format", "ratio", "ratio_p25", "ratio_p75", "ratio_best", "steps_per_s",
            "torch_steps_per_s", "load_before", "load_after"]
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 40):
        print(f"CPU {record['cpu']}, torch {record['torch']}, {record['numel']} parameters in "
              f"{record['n_tensors']} tensors; ratio = torch fused AdamW (fp32) step time / the packed step's "
              "(median of paired samples, [p25, p75])")
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        last = df[df["stage"] == df["stage"].max()]
        summary = last.pivot_table(index="variant", columns="threads", values="ratio", aggfunc="median")
        summary["score"] = pd.Series(record["scores"])
        print("\nmedian ratio over formats by threads, and the score (geometric mean over formats and threads):")
        print(summary.sort_values("score", ascending=False).to_string(float_format=lambda v: f"{v:.3f}"))
    kept = f"kept in {record['path']}" if record.get("path") else "not kept (--no-save)"
    print(f"\nchosen: {record['chosen']} (default {record['default']}); {kept}")


if __name__ == "__main__":
    main()
