"""`workbench advise MODULE:FACTORY --batch 64x3x224x224 --budget 8GiB`: the advisor's table and choice."""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys

import pandas as pd
import torch

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


def parse_shape(text: str) -> tuple[int, ...]:
    """'64x3x224x224' -> (64, 3, 224, 224): the batch first."""
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) >= 1 for p in parts) or len(parts) < 2:
        raise ValueError(f"--batch {text!r} must be sizes >= 1 joined by 'x', the batch first (e.g. 64x3x224x224)")
    return tuple(int(p) for p in parts)


def _factory(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"model {spec!r} must be MODULE:FACTORY (e.g. mypkg.models:resnet)")
    sys.path.insert(0, "")
    try:
        loaded = importlib.import_module(module)
    except Exception as error:  # the user's module: a syntax error, a failing import, anything it raises
        raise ValueError(f"cannot import {module!r} (for {spec!r}): {type(error).__name__}: {error}") from None
    try:
        factory = getattr(loaded, name)
    except AttributeError:
        raise ValueError(f"module {module!r} has no {name!r} (for {spec!r})") from None
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory


def _run(args: argparse.Namespace) -> int:
    try:
        return _advise(args)
    except (ValueError, TypeError) as error:
        print(f"workbench advise: {error}", file=sys.stderr)
        return 2


def _advise(args: argparse.Namespace) -> int:
    shape = parse_shape(args.batch)
    dtype = {"float32": torch.float32, "long": torch.long}[args.input_dtype]
    # NOTE: the batch only gives shapes and dtypes (every real step makes its own): on the meta device, so a
    # batch far too large for this machine is planned (and refused by the budget), never allocated
    inputs = torch.empty(shape, dtype=dtype, device="meta")
    targets = torch.empty(shape[0], dtype=torch.long, device="meta")
    advice = advise(_factory(args.model), (inputs, targets), memory_budget=parse_bytes(args.budget),
                    optimizer=args.optimizer, device=args.device if args.device is not None else "cpu",
                    margin=args.margin, progress=True)
    table = advice.table.sort_values("predicted_step_seconds")
    view = pd.DataFrame({"config": table["config"], "peak": table["predicted_peak_bytes"].map(format_bytes),
                         "step (ms)": (table["predicted_step_seconds"] * 1e3).round(2), "fits": table["fits"],
                         "max batch": table["max_batch"]})
    print(view.to_string(index=False))
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
    adv.add_argument("--batch", required=True, help="input shape, batch first: 64x3x224x224")
    adv.add_argument("--budget", required=True, help="memory budget: 8GiB, 500MB, 1e9")
    adv.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    adv.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    adv.add_argument("--margin", type=float, default=0.05, help="fraction of the budget kept free (default 0.05)")
    adv.add_argument("--input-dtype", choices=("float32", "long"), default="float32",
                     help="long for token ids (inputs of zeros)")
    adv.add_argument("--verify", action="store_true", help="run the choice once and measure it")
    adv.set_defaults(func=_run)
