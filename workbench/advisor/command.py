"""`workbench advise MODULE:FACTORY --batch 64x3x224x224 --budget 8GiB`: the advisor's table and choice.

Everything `advise()` takes from Python: the targets' shape and dtype (`--targets 64x128 --target-dtype long`
for a sequence model, `64x224x224` for per-pixel classes), a loss (`--loss MODULE:FN`), or the user's own
sample batch (`--sample batch.pt`, a file of `torch.save((inputs, targets))`) whose rows every real step takes.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import stat
import sys

import pandas as pd
import torch
from torch import nn

from workbench.calcgraph.graph import MAX_BATCH
from workbench.measure import check_device, format_bytes

from .advise import advise

__all__ = ["add_parser", "parse_bytes", "parse_shape"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'8GiB', '500MB', '1e9' -> bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not found or found.group(2) not in _UNITS:
        raise ValueError(f"--budget {text!r} is not a number of bytes (e.g. 8GiB, 500MB, 1e9; units "
                         f"{', '.join(u for u in _UNITS if u)})")
    value = float(found.group(1)) * _UNITS[found.group(2)]
    if not math.isfinite(value):
        raise ValueError(f"--budget {text!r} is too large to be a number of bytes")
    if not value > 0:
        raise ValueError(f"--budget {text!r} must be > 0 bytes")
    return value


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "long": torch.long, "int32": torch.int32, "bool": torch.bool}


def parse_shape(text: str, option: str = "--batch", *, least: int = 2) -> tuple[int, ...]:
    """'64x3x224x224' -> (64, 3, 224, 224): the batch first."""
    parts = text.lower().split("x")
    # NOTE: ASCII digits only: str.isdigit() takes '²' (then int() refuses it) and int() takes '٣' or '８'
    if not all(re.fullmatch(r"[0-9]+", p) and 1 <= int(p) <= 2**62 for p in parts) or len(parts) < least:
        example = "64x3x224x224" if least > 1 else "64, or 64x128 for a sequence"
        raise ValueError(f"{option} {text!r} must be {'' if least > 1 else 'one or more '}sizes >= 1 joined by 'x', "
                         f"the batch first (e.g. {example})")
    return tuple(int(p) for p in parts)


def _load(spec: str, what: str, example: str):
    """`MODULE:NAME` imported from the current folder (the user's code: anything it raises, sys.exit too, is
    reported naming it)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r} must be MODULE:NAME (e.g. {example})")
    sys.path.insert(0, "")
    try:
        loaded = importlib.import_module(module)
    except (Exception, SystemExit) as error:  # a syntax error, a failing import, sys.exit at import time
        raise ValueError(f"cannot import {module!r} (for {spec!r}): {type(error).__name__}: {error}") from None
    try:
        found = getattr(loaded, name)
    except AttributeError:
        raise ValueError(f"module {module!r} has no {name!r} (for {spec!r})") from None
    if isinstance(found, nn.Module) and what == "model":
        raise ValueError(f"{spec!r} is a {type(found).__name__} instance: pass a function that builds the model "
                         f"(its class, or a function returning a fresh one)")
    if not callable(found):
        raise ValueError(f"{what} {spec!r} is not callable (a {type(found).__name__})")
    return found


# the most bytes one tensor's storage can hold (torch counts them in an int64)
_MAX_BYTES = 2**63 - 1


def _meta(shape: tuple[int, ...], dtype: torch.dtype, given: str) -> torch.Tensor:
    """A tensor of `shape` on the meta device (shapes and dtypes only); ValueError naming the option `given`
    (with its value) when its element count overflows what torch can address."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if numel * itemsize > _MAX_BYTES:
        raise ValueError(f"{given} has {numel:.3g} elements ({numel * itemsize:.3g} bytes of "
                         f"{str(dtype).removeprefix('torch.')}): a tensor holds at most "
                         f"{_MAX_BYTES // itemsize:.3g} elements of it (2**63 - 1 bytes)")
    return torch.empty(shape, dtype=dtype, device="meta")


def _describe(t: torch.Tensor) -> str:
    kind = "" if t.layout == torch.strided and not t.is_nested else f"{str(t.layout).removeprefix('torch.')} "
    return f"{kind}{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def _check_sample(path: str, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """`--sample`'s tensors as a batch the advisor can take rows of; ValueError naming `--sample` and the file."""
    got = f"got inputs {_describe(inputs)} and targets {_describe(targets)}"
    for name, t in (("inputs", inputs), ("targets", targets)):
        if t.is_nested or t.layout != torch.strided or t.is_quantized:
            raise ValueError(f"--sample {path!r}: its {name} must be a dense tensor (not sparse, nested or "
                             f"quantized: call .to_dense() or .dequantize() before torch.save); {got}")
        if t.is_complex():
            raise ValueError(f"--sample {path!r}: its {name} have dtype {str(t.dtype).removeprefix('torch.')}; "
                             f"allowed: a floating point, integer or bool dtype; {got}")
    if inputs.dim() < 1 or targets.dim() < 1 or inputs.shape[0] != targets.shape[0] or inputs.shape[0] < 1:
        raise ValueError(f"--sample {path!r} must hold (inputs, targets) with the batch first and the same "
                         f"batch size >= 1 in both; {got}")


def _sample(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: a named pipe or a device (/dev/zero) would block torch.load, or feed it without end
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        regular = True  # missing, a loop of links, a NUL byte: torch.load's error says which, below
    if not regular:
        raise ValueError(f"--sample {path!r} is not a regular file (a named pipe, a device or a folder); give the "
                         f"file torch.save((inputs, targets)) wrote")
    try:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # a missing file, not a torch file, a pickle torch refuses to load safely
        raise ValueError(f"--sample {path!r} cannot be read as torch.save((inputs, targets)): "
                         f"{type(error).__name__}: {str(error)[:200]}") from None
    if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2 and all(isinstance(t, torch.Tensor)
                                                                        for t in loaded)):
        raise ValueError(f"--sample {path!r} must hold (inputs, targets), two tensors with the batch first; "
                         f"got {type(loaded).__name__}")
    _check_sample(path, *loaded)
    return tuple(loaded)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    if args.sample is not None:
        if args.batch is not None or args.targets is not None:
            given = " and ".join(f"{o} {v!r}" for o, v in (("--batch", args.batch), ("--targets", args.targets))
                                 if v is not None)
            raise ValueError(f"--sample {args.sample!r} gives the batch and its targets: leave --batch and "
                             f"--targets out (got {given})")
        return _sample(args.sample)
    if args.batch is None:
        raise ValueError("give --batch SHAPE (e.g. 64x3x224x224) or --sample FILE (your own batch)")
    shape = parse_shape(args.batch)
    if shape[0] > MAX_BATCH:
        raise ValueError(f"--batch {args.batch!r}: batch size {shape[0]} is more than the advisor plans (at most "
                         f"2**40 = {MAX_BATCH}: beyond it a plan's byte counts leave int64)")
    target_shape = parse_shape(args.targets, "--targets", least=1) if args.targets is not None else shape[:1]
    if target_shape[0] != shape[0]:
        raise ValueError(f"--targets {args.targets!r} must start with the batch size of --batch {args.batch!r} "
                         f"({shape[0]})")
    # NOTE: the batch only gives shapes and dtypes (every real step makes its own): on the meta device, so a
    # batch far too large for this machine is planned (and refused by the budget), never allocated
    return (_meta(shape, _DTYPES[args.input_dtype], f"--batch {args.batch!r}"),
            _meta(target_shape, _DTYPES[args.target_dtype], f"--targets {args.targets or target_shape[0]!r}"))


def _check_trainable(model_fn, spec: str) -> None:
    """ValueError naming the model when it has no parameter to train (all frozen, or none), found by building
    it once on the meta device (no memory) before anything is traced; a factory that fails to build is left
    to `advise`, which names it."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except (Exception, SystemExit):  # noqa: BLE001 - reported by advise's own check of the factory
        return
    if not isinstance(model, nn.Module):
        return
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        what = (f"all {len(params)} of its parameters have requires_grad=False" if params
                else "it has no parameters")
        raise ValueError(f"model {spec!r} has nothing to train: {what}; the advisor plans training steps, so at "
                         f"least one parameter must have requires_grad=True")


def _run(args: argparse.Namespace) -> int:
    try:
        return _advise(args)
    except (ValueError, TypeError) as error:
        print(f"workbench advise: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # the user's model, loss or module called sys.exit: no advice was given
        print(f"workbench advise: your code called sys.exit({exit_.code!r}) while the advisor ran it; no advice "
              f"was made", file=sys.stderr)
        return 2


def _advise(args: argparse.Namespace) -> int:
    budget = parse_bytes(args.budget)
    model_fn = _load(args.model, "model", "mypkg.models:resnet")
    loss_fn = _load(args.loss, "--loss", "mypkg.losses:sequence_loss") if args.loss is not None else None
    batch = _batch(args)
    if not 0 <= args.margin < 1:  # nan too
        raise ValueError(f"--margin {args.margin!r} must be a fraction of the budget in [0, 1) (e.g. 0.05)")
    try:
        device = check_device(args.device if args.device is not None else "cpu", "advise")
    except ValueError as error:
        raise ValueError(f"--device {args.device!r}: {error}") from None
    _check_trainable(model_fn, args.model)  # the options first: a model with nothing to train is refused last
    try:
        advice = advise(model_fn, batch, memory_budget=budget, loss_fn=loss_fn,
                        optimizer=args.optimizer, device=device, margin=args.margin, progress=True)
    except ValueError as error:  # the model or the loss refusing the user's own batch: say where it came from
        if args.sample is None or not re.search(r"\b(input|target)", str(error)):
            raise
        raise ValueError(f"{error} (the batch of --sample {args.sample!r})") from None
    table = advice.table.sort_values("predicted_step_seconds")
    view = pd.DataFrame({"config": table["config"], "peak": table["predicted_peak_bytes"].map(format_bytes),
                         "step (ms)": (table["predicted_step_seconds"] * 1e3).round(2), "fits": table["fits"],
                         "max batch": table["max_batch"]})
    print(view.to_string(index=False))
    for note in advice.notes:
        print(f"note: {note}")
    try:
        best = advice.best
    except ValueError as error:
        print(f"\nno choice: {error}", file=sys.stderr)
        return 1
    print(f"\nchoice: {best['config']} ({format_bytes(best['predicted_peak_bytes'])} predicted, "
          f"{best['predicted_step_seconds'] * 1e3:.2f} ms per step); real steps taken: {advice.real_runs}")
    if args.verify:
        result = advice.verify()
        print(f"verified: {format_bytes(result['measured_peak_bytes'])} measured ({result['peak_error']:+.1%}), "
              f"{result['measured_step_seconds'] * 1e3:.2f} ms per step; choice after: {result['choice_after']}")
    return 0


def add_parser(sub) -> None:
    """The `advise` subcommand of `workbench`."""
    adv = sub.add_parser("advise", help="predict every memory technique for your model; pick the fastest that fits")
    adv.add_argument("model", help="MODULE:FACTORY, a function that builds your nn.Module")
    adv.add_argument("--batch", help="input shape, batch first: 64x3x224x224 (or --sample)")
    adv.add_argument("--targets", help="targets' shape, batch first (default: the batch size alone, class indices): "
                                       "64x128 for a sequence, 64x224x224 per pixel")
    adv.add_argument("--target-dtype", choices=tuple(_DTYPES), default="long",
                     help="targets' dtype (default long: class indices)")
    adv.add_argument("--sample", help="your own batch: a file of torch.save((inputs, targets)); its rows are what "
                                      "every real step takes (instead of --batch and --targets)")
    adv.add_argument("--loss", help="MODULE:FN, a loss (outputs, targets) -> scalar (default cross-entropy)")
    adv.add_argument("--budget", required=True, help="memory budget: 8GiB, 500MB, 1e9")
    adv.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    adv.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    adv.add_argument("--margin", type=float, default=0.05, help="fraction of the budget kept free (default 0.05)")
    adv.add_argument("--input-dtype", choices=tuple(_DTYPES), default="float32",
                     help="long for token ids (drawn below the model's smallest embedding table)")
    adv.add_argument("--verify", action="store_true", help="run the choice once and measure it")
    adv.set_defaults(func=_run)
