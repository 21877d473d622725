"""Reference folders between machines: one `.tar.gz` each, unpacked within limits, and the listing they leave.

A GPU machine writes each reference folder (`place.write_reference`) or part folder (run.sh's `tests`,
`kernels`, `memory`) as one archive whose members are `<device-slug>/<name>/<file>`; `unpack` brings them into
`reports/reference/` here. An archive comes from a machine nobody here controls, so `unpack` reads it as
untrusted: only a regular file (a named pipe or a device is refused before it is read), read once from start
to end, every member checked before anything is written: plain files only, named by the layout, at most
MAX_MEMBERS members and MAX_ARCHIVE_BYTES in all (a small archive cannot write gigabytes), a truncated or
damaged archive refused as such. Then each folder is written by `place.place_folder` (never through a
symbolic link; the files a reference did not write are kept) and `reports/reference/README.md` lists what each
device holds (`write_listing`).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import stat
import tarfile
import zlib
from pathlib import Path

from ..report.reference import (
    FILE_PATTERN, PART_FILE, PART_FILE_PATTERN, PARTS, RUN_FILE, SLUG_PATTERN, commit_mismatch, read_parts,
    read_references,
)
from ..report.results import _NONBLOCK, NAME_PATTERN, UsageError
from .place import _write_in, check_target, place_folder

__all__ = ["MAX_MEMBERS", "MAX_ARCHIVE_BYTES", "bundle", "bundle_part", "check_archive", "unpack", "listing_text",
           "write_listing"]

MAX_MEMBERS = 256  # a reference folder holds a dozen files
MAX_ARCHIVE_BYTES = 64 * 2**20  # the largest reference so far (packed_bit_optimizers on an H100) is 1.8 MiB
LISTING = "README.md"
# NOTE: the mark names the command by its earlier name (which still works): a listing with another first line
# would be left alone as someone else's, and the committed listings keep their text
_LISTING_MARK = "<!-- written by `python -m workbench.report.gpu_run unpack`; rewritten at each unpack -->"


def _pattern(name: str):
    return PART_FILE_PATTERN if name in PARTS else FILE_PATTERN


def _write_tar(path: Path, members: list[tuple[str, Path]]) -> Path:
    """A .tar.gz of (member name, file), written beside `path` and renamed into place (a reader, or a run
    stopped while writing, sees the previous archive or this one, never half of one)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tarfile.open(temporary, "w:gz") as tar:
        for arcname, file in members:
            tar.add(file, arcname=arcname, recursive=False)
    os.replace(temporary, path)
    return path


def bundle(folder: str | Path, dest: str | Path) -> Path:
    """One `.tar.gz` of a reference folder, its members named `<device-slug>/<name>/<file>`."""
    folder, dest = Path(folder), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    slug, name = folder.parent.name, folder.name
    files = [f for f in sorted(folder.iterdir())
             if f.is_file() and not f.is_symlink() and FILE_PATTERN.fullmatch(f.name)]
    return _write_tar(dest / f"reference-{slug}-{name}.tar.gz", [(f"{slug}/{name}/{f.name}", f) for f in files])


def bundle_part(files: list[Path], record: dict, slug: str, part: str, dest: str | Path) -> Path:
    """One `.tar.gz` of a part's `files` and its record (`part.json`, listing them), as `<slug>/<part>/...`."""
    if part not in PARTS:
        raise UsageError(f"part {part!r}: expected one of {', '.join(PARTS)}")
    dest = Path(dest)
    kept = [f for f in files if f.is_file() and PART_FILE_PATTERN.fullmatch(f.name) and f.name != PART_FILE]
    marker = dest / f".{part}-{PART_FILE}"
    marker.write_text(json.dumps({**record, "part": part, "files": [f.name for f in kept]}, indent=1, default=str))
    try:
        return _write_tar(dest / f"{part}-{slug}.tar.gz",
                          [(f"{slug}/{part}/{PART_FILE}", marker), *((f"{slug}/{part}/{f.name}", f) for f in kept)])
    finally:
        marker.unlink(missing_ok=True)


class _Bounded(io.RawIOBase):
    """A stream that refuses to give more than `limit` bytes: a backstop under the member checks (a tar header
    can itself be huge) so that no archive makes this process read or hold more than that."""

    def __init__(self, stream, limit: int, archive: Path) -> None:
        self.stream, self.left, self.archive, self.limit = stream, limit, archive, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(min(len(buffer), self.left + 1))
        if len(data) > self.left:
            raise UsageError(f"{self.archive}: unpacks to more than {self.limit >> 20} MiB; nothing was written")
        self.left -= len(data)
        buffer[:len(data)] = data
        return len(data)


def _open_regular(archive: Path):
    """The archive opened for reading, refused (UsageError) unless it is a regular file; never blocks."""
    try:
        fd = os.open(archive, os.O_RDONLY | _NONBLOCK)
    except OSError as exc:
        raise UsageError(f"{archive}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a named pipe" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a device or socket"
        raise UsageError(f"{archive}: not a regular file ({kind}); expected a .tar.gz that the GPU run wrote")
    return os.fdopen(fd, "rb")


NAME_MAX = 255  # bytes in one file name on Linux and macOS file systems
# NOTE: by the first bytes, as `tar` does: the GPU run writes gzip, a person repacking by hand may choose another.
_MAGIC = ((b"\x1f\x8b", lambda raw: gzip.GzipFile(fileobj=raw)), (b"BZh", bz2.BZ2File),
          (b"\xfd7zXZ\x00", lzma.LZMAFile))


def _decompressed(raw):
    """`raw` read through the decompressor its first bytes name (gzip, bzip2, xz), or as a plain tar."""
    head = raw.read(6)
    raw.seek(0)
    for magic, opener in _MAGIC:
        if head.startswith(magic):
            return opener(raw)
    return raw


def _read_members(archive: Path) -> dict[tuple[str, str], dict[str, bytes]]:
    """The archive's files by folder (device slug, name), every member checked, read in one pass."""
    folders: dict[tuple[str, str], dict[str, bytes]] = {}
    count = total = 0
    with _open_regular(archive) as raw:
        stream = _Bounded(_decompressed(raw), MAX_ARCHIVE_BYTES + MAX_MEMBERS * 4096 + 2**20, archive)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                count += 1
                if count > MAX_MEMBERS:
                    raise UsageError(f"{archive}: more than {MAX_MEMBERS} members (a reference archive holds a "
                                     f"few files); nothing was written")
                parts = member.name.split("/")
                if member.isdir() and len(parts) <= 2:
                    continue
                ok = (member.isfile() and len(parts) == 3 and SLUG_PATTERN.fullmatch(parts[0]) is not None
                      and NAME_PATTERN.fullmatch(parts[1]) is not None and _pattern(parts[1]).fullmatch(parts[2]))
                if not ok:
                    raise UsageError(f"{archive}: refusing member {member.name!r} (expected plain files "
                                     f"<device-slug>/<name>/<file>.json|.html|.png, or .json|.csv|.log|.xml|.txt "
                                     f"in a part folder {'|'.join(PARTS)})")
                if len(parts[2].encode()) > NAME_MAX:
                    raise UsageError(f"{archive}: refusing member {parts[0]}/{parts[1]}/{parts[2][:40]}... (a file "
                                     f"name of {len(parts[2].encode())} bytes; a file system allows {NAME_MAX})")
                total += member.size
                if total > MAX_ARCHIVE_BYTES:
                    raise UsageError(f"{archive}: its files add up to more than {MAX_ARCHIVE_BYTES >> 20} MiB "
                                     f"(a reference folder is a few MiB); nothing was written")
                data = tar.extractfile(member).read()
                if len(data) != member.size:
                    raise EOFError(f"{member.name} ends early")
                folders.setdefault((parts[0], parts[1]), {})[parts[2]] = data
    return folders


def _has_record(data: bytes | None) -> bool:
    try:
        record = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and isinstance(record.get("environment"), dict)


def unpack(archive: str | Path, root: str | Path) -> list[Path]:
    """Bring the folders of a `bundle`/`bundle_part` archive into `<root>/<device-slug>/<name>/`.

    Every member must be a plain file named `<device-slug>/<name>/<file>` with a file name the layout allows,
    and each folder must hold its record (run.json, or a part's part.json) with an `environment`; otherwise
    nothing is written (UsageError naming the member, folder or limit). See the module's docstring."""
    folders = check_archive(archive, root)
    return [place_folder(Path(root), slug, name, files) for (slug, name), files in folders.items()]


def check_archive(archive: str | Path, root: str | Path) -> dict:
    """The folders `unpack` would write from `archive` into `root`, read and checked, nothing written: UsageError
    naming the member, folder or limit otherwise (`unpack` checks every archive of a command before any)."""
    archive, root = Path(archive), Path(root)
    for what, path in (("archive", archive), ("--reports", root)):
        if "\0" in str(path):
            raise UsageError(f"{what} {str(path)!r} holds a NUL byte, which no path can hold; nothing was written")
    for path in (root.parent, root):
        try:
            os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            pass  # made later, or refused by check_target naming what is in the way
        except OSError as exc:  # a name too long, a loop of links
            raise UsageError(f"--reports {str(root.parent)!r}: {exc.strerror or exc}; nothing was written") from None
    try:
        folders = _read_members(archive)
    except (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError) as exc:
        raise UsageError(f"{archive}: truncated or damaged archive ({exc}); nothing was written") from None
    if not folders:
        raise UsageError(f"{archive}: empty archive (no reference folder with {RUN_FILE})")
    bad = [f"{slug}/{name}" for (slug, name), files in folders.items()
           if not _has_record(files.get(PART_FILE if name in PARTS else RUN_FILE))]
    if bad:
        raise UsageError(f"{archive}: {', '.join(bad)}: no {RUN_FILE} (or {PART_FILE}) holding an environment "
                         f"(not a reference folder)")
    for slug, name in folders:
        check_target(root, slug, name)
    return folders


def listing_text(root: Path) -> str:
    """reports/reference/README.md as `write_listing` writes it now."""
    from ..devices import repo_root
    from ..report.runner import available_notebooks

    references, parts = read_references(root), read_parts(root)
    devices: dict[str, dict] = {}
    for refs in references.values():
        for ref in refs:
            devices.setdefault(ref["slug"], {"refs": [], "name": ref["environment"].get("device_name")})
            devices[ref["slug"]]["refs"].append(ref)
    for slug, found in parts.items():
        devices.setdefault(slug, {"refs": [], "name": found[0]["record"].get("environment", {}).get("device_name")})
    lines = [_LISTING_MARK, "# Reference reports", "",
             "Each notebook's `gpu` profile (and run.sh's parts) as built on the device named, one folder per "
             "device: `results.json`, `run.json` (status, seconds, where it ran, the commit), the notebook as HTML "
             "and its figures. The index pages show them beside your own build.", ""]
    try:
        notebooks = available_notebooks(repo_root() / "notebooks")
    except Exception:  # no notebooks folder: list what is here only
        notebooks = []
    for slug, device in sorted(devices.items()):
        lines += [f"## {device['name'] or slug} (`{slug}/`)", "",
                  "| notebook | status | profile | seconds | made | commit | torch | driver |", "|---" * 8 + "|"]
        notes: dict[str, list[str]] = {}
        for ref in sorted(device["refs"], key=lambda r: r["name"]):
            env = ref["environment"]
            lines.append(f"| {ref['name']} | {env.get('status', '?')} | {env.get('profile', '?')} | "
                         f"{env.get('seconds', '?')} | {env.get('made', '?')} | {str(env.get('commit') or '?')[:12]} | "
                         f"{env.get('torch') or '?'} | {env.get('driver') or '?'} |")
            note = commit_mismatch(ref)
            if note:
                notes.setdefault(note, []).append(ref["name"])
        missing = [n for n in notebooks if n not in {r["name"] for r in device["refs"]}]
        lines += ["", f"Not built on this device: {', '.join(missing)}." if missing else "Every notebook is here.", ""]
        for found in parts.get(slug, []):
            record = found["record"]
            lines.append(f"- part `{found['part']}`: {record.get('status', '?')} in {record.get('seconds', '?')} s, "
                         f"made {record.get('made', '?')}, commit {str(record.get('commit') or '?')[:12]}; "
                         f"files: {', '.join(record.get('files') or []) or 'none'}")
        lines += ([""] if parts.get(slug) else [])
        lines += [f"- {', '.join(names)}: {note}." for note, names in notes.items()] + ([""] if notes else [])
    return "\n".join(lines)


def write_listing(root: str | Path) -> Path | None:
    """Rewrite `<root>/README.md`: for each device, which notebooks and parts it holds, their status, when they
    were made and from which commit. A README.md that unpack did not write is left alone (None returned)."""
    root = Path(root)
    path = root / LISTING
    if path.is_symlink() or (path.exists() and not path.read_text(errors="replace").startswith(_LISTING_MARK)):
        return None
    if root.is_symlink() or not root.is_dir():
        return None
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        _write_in(fd, LISTING, listing_text(root).encode())
    finally:
        os.close(fd)
    return path
