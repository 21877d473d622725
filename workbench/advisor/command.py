"""`workbench advise MODULE:FACTORY --batch 64x3x224x224 --budget 8GiB`: the advisor's table and choice.

Everything `advise()` takes from Python: the targets' shape and dtype (`--targets 64x128 --target-dtype long`
for a sequence model, `64x224x224` for per-pixel classes), a loss (`--loss MODULE:FN`), or the user's own
sample batch (`--sample batch.pt`, a file of `torch.save((inputs, targets))`) whose rows every real step takes.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys

import pandas as pd
import torch
from torch import nn

from workbench.measure import format_bytes

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
    if not all(p.isdigit() and 1 <= int(p) <= 2**62 for p in parts) or len(parts) < least:
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


def _sample(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # a missing file, not a torch file, a pickle torch refuses to load safely
        raise ValueError(f"--sample {path!r} cannot be read as torch.save((inputs, targets)): "
                         f"{type(error).__name__}: {str(error)[:200]}") from None
    if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2 and all(isinstance(t, torch.Tensor)
                                                                        for t in loaded)):
        raise ValueError(f"--sample {path!r} must hold (inputs, targets), two tensors with the batch first; "
                         f"got {type(loaded).__name__}")
    return tuple(loaded)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    if args.sample is not None:
        if args.batch is not None or args.targets is not None:
            raise ValueError("--sample gives the batch and its targets: leave --batch and --targets out")
        return _sample(args.sample)
    if args.batch is None:
        raise ValueError("give --batch SHAPE (e.g. 64x3x224x224) or --sample FILE (your own batch)")
    shape = parse_shape(args.batch)
    target_shape = parse_shape(args.targets, "--targets", least=1) if args.targets is not None else shape[:1]
    if target_shape[0] != shape[0]:
        raise ValueError(f"--targets {args.targets!r} must start with the batch size of --batch {args.batch!r} "
                         f"({shape[0]})")
    # NOTE: the batch only gives shapes and dtypes (every real step makes its own): on the meta device, so a
    # batch far too large for this machine is planned (and refused by the budget), never allocated
    return (torch.empty(shape, dtype=_DTYPES[args.input_dtype], device="meta"),
            torch.empty(target_shape, dtype=_DTYPES[args.target_dtype], device="meta"))


def _run(args: argparse.Namespace) -> int:
    try:
        return _advise(args)
    except (ValueError, TypeError) as error:
        print(f"workbench advise: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # the user's model, loss or module called sys.exit: no advice was given
        print(f"workbench advise: your code called sys.exit({exit_.code!r}) while the advisor ran it; no advice "
              f"was made", file=sys.stderr)
        return 2


def _advise(args: argparse.Namespace) -> int:
    budget = parse_bytes(args.budget)
    model_fn = _load(args.model, "model", "mypkg.models:resnet")
    loss_fn = _load(args.loss, "--loss", "mypkg.losses:sequence_loss") if args.loss is not None else None
    advice = advise(model_fn, _batch(args), memory_budget=budget, loss_fn=loss_fn,
                    optimizer=args.optimizer, device=args.device if args.device is not None else "cpu",
                    margin=args.margin, progress=True)
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
