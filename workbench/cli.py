"""The `workbench` command: build reports, install the Jupyter kernel, list what exists."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

__all__ = ["main"]


def _parse_override(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    return name, yaml.safe_load(value)  # papermill's -y style: 3 -> int, 0.1 -> float, x -> str


def _report(args: argparse.Namespace) -> int:
    from .report import UsageError, build_reports

    try:
        results = build_reports(
            args.names, profile=args.profile, out_dir=args.out, overrides=dict(args.param),
            notebooks=args.notebooks,
        )
    except UsageError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    for row in results.itertuples():
        line = f"{row.status:>6}  {row.name}  ({row.seconds} s)"
        print(line + (f"\n        {row.error}" if row.error else ""))
    failed = results[results.status != "ok"]
    out = args.out or "reports"
    print(f"index: {out}/index.html; {len(results) - len(failed)} ok, {len(failed)} failed")
    return 1 if len(failed) else 0


def _kernel_install(args: argparse.Namespace) -> int:
    from jupyter_client.kernelspec import KernelSpecManager

    from .devices import repo_root
    from .report import KERNEL_NAME

    source = repo_root() / "kernels" / KERNEL_NAME
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
    from .report import PROFILES

    parser = argparse.ArgumentParser(
        prog="workbench", description="Memory-efficient deep learning, measured on your hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rep = sub.add_parser("report", help="execute notebooks with papermill into reports/")
    rep.add_argument("names", nargs="*", metavar="NAME", help="notebooks to run (default: all)")
    rep.add_argument("--profile", default="cpu", choices=PROFILES, help="parameter profile")
    rep.add_argument("--out", default=None, help="output folder (default: reports/)")
    rep.add_argument("--notebooks", default=None, help="notebook folder (default: notebooks/)")
    rep.add_argument("-p", "--param", action="append", default=[], type=_parse_override,
                     metavar="NAME=VALUE", help="override a notebook parameter (repeatable)")
    rep.set_defaults(func=_report)

    kernel = sub.add_parser("kernel", help="manage the 'workbench' Jupyter kernel")
    ksub = kernel.add_subparsers(dest="kernel_command", required=True, metavar="ACTION")
    inst = ksub.add_parser("install", help="install kernels/workbench for JupyterLab")
    inst.add_argument("--user", action="store_true",
                      help="install for the user instead of the active environment")
    inst.set_defaults(func=_kernel_install)

    sub.add_parser("list", help="list notebooks and profiles").set_defaults(func=_list)
    sub.add_parser("env", help="print the environment record").set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
