"""Reference reports built on a bare CUDA machine in three commands: `python -m workbench.gpu COMMAND`.

The whole round trip (README, "Profiles"): here, `python -m workbench.gpu pack gpu-pack` (a clean copy of the
committed checkout, the wheels of the Jupyter stack and `run.sh`, see `pack`); there, `bash gpu-pack/run.sh
PART "$OUT"` for each part (`parts`, which runs notebooks through `run`); here again, `python -m workbench.gpu
unpack <archives>` into `reports/reference/` (`archive`), then the listing and the index are rewritten from
what is on disk. `wheels` downloads the Jupyter stack alone (`make wheels`). `python -m
workbench.report.gpu_run` is the same command under its earlier name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..devices import repo_root
from ..report.folders import locked
from ..report.index import write_index
from ..report.reference import REFERENCE
from ..report.results import PROFILES, UsageError
from .archive import check_archive, unpack, write_listing
from .pack import add_pack_parser
from .parts import add_part_parser
from .run import environment_restored, run
from .wheels import download_wheels, wheel_requirements

__all__ = ["main"]

PROG = "python -m workbench.gpu"


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"-p {pair!r}: expected name=value")
        out[key] = value
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m workbench.gpu pack gpu-pack   (here; then on the GPU machine:\n"
               "  bash gpu-pack/run.sh tests \"$OUT\")\n"
               "  python -m workbench.gpu unpack reference-*.tar.gz tests-*.tar.gz\n"
               "  python -m workbench.gpu run tour --profile smoke --device cpu --bundle out/  (dry run)")
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="build notebooks at a profile and keep them as reference reports")
    go.add_argument("names", nargs="+", help="notebooks (one per call on a time-limited machine)")
    go.add_argument("--profile", default="gpu", choices=PROFILES)
    go.add_argument("--device", help="overrides the profile's device (the gpu profile's is cuda): cuda:N, or cpu "
                                     "for a dry run")
    go.add_argument("--commit", help="the commit this checkout holds (a copy without .git knows none)")
    go.add_argument("--out", type=Path, help="where the runner builds (default: a temporary folder)")
    go.add_argument("--reference", type=Path, help="reference root (default: reports/reference)")
    go.add_argument("--bundle", type=Path, default=os.environ.get("OUT") or None,
                    help="folder for one .tar.gz per notebook (default: $OUT when set)")
    go.add_argument("--wheels", type=Path, default=repo_root() / "wheels", help="wheels to install if needed")
    go.add_argument("--site", type=Path, help="where the wheels go (default: <tmp>/workbench-gpu-site, reused by "
                                             "later calls on the same machine)")
    go.add_argument("--deadline", type=float, help="seconds per notebook; past it the run stops and is recorded "
                                                   "as failed with the cells it finished (under a call's limit)")
    go.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    back = sub.add_parser("unpack", help="put archives from run.sh (or `run`) into reports/reference/, rewrite "
                                         "reports/reference/README.md and the index")
    back.add_argument("archives", nargs="+", type=Path)
    back.add_argument("--reports", type=Path, default=repo_root() / "reports")
    get = sub.add_parser("wheels", help="download the wheels a bare PyTorch image lacks (needs the network)")
    get.add_argument("--dest", type=Path, default=repo_root() / "wheels")
    get.add_argument("--print", dest="only_print", action="store_true", help="list the requirements only")
    add_pack_parser(sub)
    add_part_parser(sub)
    return parser


def _unpack(archives: list[Path], reports: Path) -> None:
    for archive in archives:  # all checked before any is written: a bad second archive leaves the first unwritten
        check_archive(archive, reports / REFERENCE)
    for archive in archives:
        for target in unpack(archive, reports / REFERENCE):
            print(f"reference: {target}")
    listing = write_listing(reports / REFERENCE)
    print(f"listing: {listing}" if listing else f"listing: {reports / REFERENCE / 'README.md'} was not written by "
          f"unpack; left as it is")
    with locked(reports):
        print(f"index: {write_index(reports)}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "wheels":
            requirements = wheel_requirements()
            if args.only_print:
                print("\n".join(requirements))
                return 0
            download_wheels(args.dest, requirements)
            print(f"{len(list(args.dest.glob('*.whl')))} wheels in {args.dest} (carry this folder to the GPU machine)")
            return 0
        if args.command == "unpack":
            _unpack(args.archives, args.reports)
            return 0
        if args.command in ("pack", "part"):
            return args.handler(args)
        with environment_restored():
            done = run(args.names, profile=args.profile, device=args.device, commit=args.commit, out=args.out,
                       reference=args.reference, bundle_dir=args.bundle, wheels=args.wheels, site=args.site,
                       deadline=args.deadline, overrides=_overrides(args.param))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in done:
        print(f"{row['name']}: {row['status']} in {row['seconds']} s; reference {row['reference']}; "
              f"archive {row['archive']}" + (f"; error: {row['error']}" if row["error"] else ""))
    return 0 if all(row["status"] == "ok" for row in done) else 1


if __name__ == "__main__":
    sys.exit(main())
