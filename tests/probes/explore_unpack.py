"""Exploration probes, family `unpack`: `python -m workbench.gpu unpack ARCHIVE --reports DIR` (see
explore.py). A bad archive must be refused (exit status 2) naming the archive or the member, writing nothing
outside `DIR/reference/` and deleting no file of the user's; a good one must land in
`DIR/reference/<device-slug>/<name>/`. (workbench/gpu and report/reference.py belong to another helper: reported.)"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import zipfile

from explore import cases, cli, cli_refusal, cli_works, probe

SLUG, NAME = "nvidia-h100-80gb-hbm3", "tour"
RUN = json.dumps({"name": NAME, "status": "ok", "profile": "gpu", "environment": {"device_name": "NVIDIA H100"}})


def _unpack(sb, *archives):
    from workbench.gpu.cli import main

    return cli(["unpack", *map(str, archives), "--reports", str(sb.root / "reports")], main=main)


def _tar(sb, members, mode="w:gz", name="reference.tar.gz"):
    """An archive of `members`: (name, bytes) for files, or (name, TarInfo-changing function, bytes)."""
    path = sb.root / name
    with tarfile.open(path, mode) as tar:
        for member in members:
            info = tarfile.TarInfo(member[0])
            data = member[-1] if isinstance(member[-1], bytes) else b""
            info.size = len(data)
            if len(member) == 3:
                member[1](info)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _good_members(extra=()):
    return [(f"{SLUG}/{NAME}/run.json", RUN.encode()), (f"{SLUG}/{NAME}/results.json", b'{"name": "tour"}'),
            (f"{SLUG}/{NAME}/tour.html", b"<html></html>"), *extra]


def _kind(kind):
    def change(info):
        info.type = kind
        info.linkname = "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        info.size = 0
    return change


BAD_MEMBERS = {
    "parent folder": "../evil.json", "absolute": "/tmp/evil.json", "climbing": f"{SLUG}/{NAME}/../../../evil.json",
    "too deep": f"{SLUG}/{NAME}/sub/x.json", "a script": f"{SLUG}/{NAME}/x.py", "an executable": f"{SLUG}/{NAME}/x.exe",
    "bad slug": f"Bad Slug/{NAME}/x.json", "slug climbing": f"../{NAME}/run.json", "bad name": f"{SLUG}/a b/x.json",
    "dot name": f"{SLUG}/./x.json", "long name": f"{SLUG}/{NAME}/{'x' * 5000}.json",
    "backslashes": f"{SLUG}\\..\\..\\evil.json", "hidden file": f"{SLUG}/{NAME}/.x.json",
}


@cases("unpack", "member refused", BAD_MEMBERS)
def bad_member(sb, member):
    archive = _tar(sb, _good_members([(member, b"{}")]))
    return cli_refusal(_unpack(sb, archive), str(archive))


KINDS = {"a symbolic link": tarfile.SYMTYPE, "a hard link": tarfile.LNKTYPE, "a named pipe": tarfile.FIFOTYPE,
         "a character device": tarfile.CHRTYPE, "a block device": tarfile.BLKTYPE, "a folder": tarfile.DIRTYPE}


@cases("unpack", "member kind refused", KINDS)
def bad_kind(sb, kind):
    archive = _tar(sb, _good_members([(f"{SLUG}/{NAME}/x.json", _kind(kind), b"")]))
    return cli_refusal(_unpack(sb, archive), str(archive))


@cases("unpack", "size refused", {"one member of 65 MiB": (1, 65), "300 members": (300, 0),
                                  "20000 members": (20000, 0), "5 members of 20 MiB": (5, 20)}, timeout=90)
def too_big(sb, case):
    count, mib = case
    data = bytes(mib * 2**20)
    extra = [(f"{SLUG}/{NAME}/f{i}.json", data) for i in range(count)]
    archive = _tar(sb, _good_members(extra), mode="w:gz")
    return cli_refusal(_unpack(sb, archive), str(archive))


BAD_ARCHIVES = {
    "truncated": "truncated", "not an archive": "text", "empty file": "empty", "a zip": "zip",
    "gzip of garbage": "gzgarbage", "a named pipe": "fifo", "/dev/zero": "zero", "a folder": "dir", "missing": "none",
    "run.json missing": "norun", "run.json without environment": "noenv", "run.json not JSON": "badrun",
    "run.json nested deep": "deeprun", "run.json a list": "listrun", "no members": "nomembers",
}


@cases("unpack", "archive refused", BAD_ARCHIVES, timeout=40)
def bad_archive(sb, kind):
    path = sb.root / "reference.tar.gz"
    runs = {"noenv": json.dumps({"name": NAME}), "badrun": "{", "deeprun": "[" * 100000 + "]" * 100000,
            "listrun": "[]"}
    if kind == "truncated":
        path.write_bytes(_tar(sb, _good_members()).read_bytes()[:100])
    elif kind == "text":
        path.write_text("not an archive")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{SLUG}/{NAME}/run.json", RUN)
    elif kind == "gzgarbage":
        path.write_bytes(gzip.compress(b"garbage" * 100))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
    elif kind == "none":
        pass
    elif kind == "norun":
        _tar(sb, _good_members()[1:])
    elif kind in runs:
        _tar(sb, [(f"{SLUG}/{NAME}/run.json", runs[kind].encode()), *_good_members()[1:]])
    elif kind == "nomembers":
        _tar(sb, [])
    return cli_refusal(_unpack(sb, path), str(path))


@cases("unpack", "good archive", {"gzip": "w:gz", "xz": "w:xz", "bz2": "w:bz2", "plain tar": "w"})
def good(sb, mode):
    archive = _tar(sb, _good_members(), mode=mode)
    outcome = _unpack(sb, archive)
    landed = (sb.root / "reports" / "reference" / SLUG / NAME / "run.json").is_file()
    return cli_works(outcome) if landed or outcome[0] != 0 else ("nonsense", "exit 0 but nothing landed")


@probe("unpack", "the same archive twice")
def twice(sb):
    archive = _tar(sb, _good_members())
    _unpack(sb, archive)
    return cli_works(_unpack(sb, archive))


def _target(sb, kind):
    reports = sb.root / "reports"
    reference = reports / "reference"
    folder = reference / SLUG / NAME
    if kind == "reference a link outside":
        reports.mkdir()
        reference.symlink_to(sb.outside / "folder")
    elif kind == "slug a link outside":
        reference.mkdir(parents=True)
        (reference / SLUG).symlink_to(sb.outside / "folder")
    elif kind == "target a link outside":
        (reference / SLUG).mkdir(parents=True)
        folder.symlink_to(sb.outside / "folder")
    elif kind == "notes of yours in the reference":
        _unpack(sb, _tar(sb, _good_members(), name="first.tar.gz"))
        (folder / "notes.txt").write_text("mine")
        sb.keep(folder / "notes.txt")
    elif kind == "a folder of yours in its place":
        folder.mkdir(parents=True)
        (folder / "draft.md").write_text("mine")
        sb.keep(folder / "draft.md")
    elif kind == "reports a file":
        reports.write_text("mine")
        sb.keep(reports)
    elif kind == "reference a file":
        reports.mkdir()
        reference.write_text("mine")
        sb.keep(reference)
    elif kind == "an index page of yours":
        reports.mkdir()
        (reports / "index.html").write_text("<html>mine</html>")
        sb.keep(reports / "index.html")
    elif kind == "a listing of yours":
        reference.mkdir(parents=True)
        (reference / "README.md").write_text("# my notes")
        sb.keep(reference / "README.md")


TARGETS = ["reference a link outside", "slug a link outside", "target a link outside",
           "notes of yours in the reference", "a folder of yours in its place", "reports a file", "reference a file",
           "an index page of yours", "a listing of yours"]


@cases("unpack", "in the way", {k: k for k in TARGETS})
def in_the_way(sb, kind):
    _target(sb, kind)
    archive = _tar(sb, _good_members())
    outcome = _unpack(sb, archive)
    if kind == "a listing of yours":  # kept as it is; the reference lands
        return cli_works(outcome)
    if kind == "notes of yours in the reference" and outcome[0] == 0:  # kept beside the new files (checked)
        return cli_works(outcome)
    return cli_refusal(outcome, "")


@probe("unpack", "a good archive, then a bad one")
def good_then_bad(sb):
    first = _tar(sb, _good_members(), name="a.tar.gz")
    second = _tar(sb, _good_members([("../evil.json", b"{}")]), name="b.tar.gz")
    return cli_refusal(_unpack(sb, first, second), str(second))
