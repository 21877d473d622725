"""The `workbench` command: build reports, install the Jupyter kernel, list what exists."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def _parse_override(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    # NOTE: the value stays text here; the runner converts it to the type of the notebook's declared
    # default before any kernel starts (YAML guessing turned `1e-3` into a string and `012` into 10).
    return name, value


def _folder(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty folder name; give a path or leave the option out")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL byte, which no path can hold")
    return text


def _workers(text: str) -> int:
    from .report.cluster import MAX_WORKERS

    # NOTE: ASCII digits only: int() also takes '٢' (Arabic-Indic) or '２' (fullwidth) as 2
    count = int(text) if re.fullmatch(r"\s*[0-9]{1,6}\s*", text) else 0
    if not 1 <= count <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of worker processes in 1..{MAX_WORKERS}")
    return count


def _address(text: str) -> str:
    from .report import UsageError
    from .report.cluster import check_cluster_options

    try:
        check_cluster_options(None, text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _report(args: argparse.Namespace) -> int:
    from .devices import repo_root
    from .report import UsageError, build_reports
    from .report.results import FAILED_RUN

    out = Path(args.out) if args.out is not None else repo_root() / "reports"
    names = [name for name, _ in args.param]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        print(f"workbench report: error: -p {', '.join(twice)} given more than once; give each parameter once",
              file=sys.stderr)
        return 2
    try:
        results = build_reports(
            args.names, profile=args.profile, out_dir=out, overrides=dict(args.param),
            notebooks=args.notebooks, workers=args.workers, scheduler=args.scheduler,
        )
    except UsageError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the index could not be written: the previous pages are intact
        print(f"workbench report: error: {exc.strerror or exc}: {exc.filename or out}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("workbench report: interrupted; the previous reports are intact", file=sys.stderr)
        return 130
    for row in results.itertuples():
        line = f"{row.status:>6}  {row.name}  ({row.seconds} s)"
        if isinstance(row.error, str) and row.error:  # pandas reads a missing error as NaN
            line += f"\n        {row.error}"
        if row.kept_previous:
            line += (f"\n        the last good report is kept; the failed run is in "
                     f"{out / args.profile / row.name / FAILED_RUN}")
        print(line)
    failed = results[results.status != "ok"]
    print(f"index: {out / 'index.html'} ({args.profile}: {out / args.profile / 'index.html'}); "
          f"{len(results) - len(failed)} ok, {len(failed)} failed")
    return 1 if len(failed) else 0


def _kernel_install(args: argparse.Namespace) -> int:
    from jupyter_client.kernelspec import KernelSpecManager

    from .devices import repo_root
    from .report import KERNEL_NAME, UsageError
    from .report.runner import check_kernel_spec

    source = repo_root() / "kernels" / KERNEL_NAME
    try:
        check_kernel_spec(source / "kernel.json")
    except UsageError as exc:
        print(f"workbench kernel install: error: {exc}", file=sys.stderr)
        return 2
    dest = KernelSpecManager().install_kernel_spec(
        str(source), KERNEL_NAME, user=args.user, prefix=None if args.user else sys.prefix,
    )
    print(f"installed kernel {KERNEL_NAME!r} in {dest}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from .report import PROFILES, available_notebooks

    print("notebooks:", ", ".join(available_notebooks()))
    print("profiles:", ", ".join(PROFILES))
    return 0


def _env(args: argparse.Namespace) -> int:
    from .devices import environment

    print(json.dumps(environment(), indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .advisor.command import add_parser as add_advise_parser
    from .report import PROFILES

    parser = argparse.ArgumentParser(
        prog="workbench", description="Memory-efficient deep learning, measured on your hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rep = sub.add_parser("report", help="execute notebooks with papermill into reports/<profile>/")
    rep.add_argument("names", nargs="*", metavar="NAME", help="notebooks to run (default: all)")
    rep.add_argument("--profile", default="cpu", choices=PROFILES, help="parameter profile")
    rep.add_argument("--out", default=None, type=_folder,
                     help="output folder (default: reports/); a profile writes <out>/<profile>/<name>/")
    rep.add_argument("--notebooks", default=None, type=_folder, help="notebook folder (default: notebooks/)")
    rep.add_argument("-p", "--param", action="append", default=[], type=_parse_override,
                     metavar="NAME=VALUE", help="override a notebook parameter (repeatable)")
    where = rep.add_mutually_exclusive_group()
    where.add_argument("--workers", type=_workers, default=None, metavar="N",
                       help="run notebooks in parallel on a local Dask cluster of N worker processes")
    where.add_argument("--scheduler", default=None, type=_address, metavar="ADDRESS",
                       help="run notebooks on the Dask cluster at ADDRESS (e.g. tcp://host:8786); its workers "
                            "need this package and the same notebook and report folders")
    rep.set_defaults(func=_report)

    kernel = sub.add_parser("kernel", help="manage the 'workbench' Jupyter kernel")
    ksub = kernel.add_subparsers(dest="kernel_command", required=True, metavar="ACTION")
    inst = ksub.add_parser("install", help="install kernels/workbench for JupyterLab")
    inst.add_argument("--user", action="store_true",
                      help="install for the user instead of the active environment")
    inst.set_defaults(func=_kernel_install)

    add_advise_parser(sub)
    sub.add_parser("list", help="list notebooks and profiles").set_defaults(func=_list)
    sub.add_parser("env", help="print the environment record").set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
