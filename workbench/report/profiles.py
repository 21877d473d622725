"""Profiles: named parameter sets of a notebook, `notebooks/profiles/<name>.yaml`, read strictly.

A profile file maps profile names (smoke, cpu, gpu, paper) to mappings of parameter names to values. It is
read only when it is a plain file of at most MAX_PROFILE_BYTES, with YAML's safe loader tightened where
YAML would otherwise guess or expand without a word: a key given twice, an alias (`*name`), a value nested
deeper than MAX_VALUE_DEPTH, a whole number longer than MAX_INT_DIGITS, and the numbers YAML 1.1 and 1.2
read differently (`010`, `1:30`) are refused, each naming the file and the line. The values are typed and
ranged afterwards by `parameters.coerce`.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import yaml

from .results import PROFILES, RESERVED, UsageError

__all__ = ["MAX_INT_DIGITS", "MAX_PROFILE_BYTES", "MAX_VALUE_DEPTH", "read_profiles"]

_PROFILE_SHAPE = "a mapping of profile names (smoke, cpu, gpu, paper) to mappings of parameter names to values"


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


class _Refusal(Exception):
    """What a profile file may not hold, with the line it is on."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(line, problem)
        self.line, self.problem = line, problem


MAX_PROFILE_BYTES = 2**20  # largest profile file read (the repository's are under 2 KB)
MAX_VALUE_DEPTH = 32  # lists and mappings nested deeper in a parameter value are refused (results.json reads 64)
MAX_INT_DIGITS = 30  # longest whole number written in a profile (int64 needs 19 digits)
_AMBIGUOUS = "tag:workbench,2026:ambiguous-number"
# YAML 1.1 (PyYAML) reads these as octal or base-60 numbers, YAML 1.2 as decimal numbers or text
_OCTAL = r"[-+]?0[0-7_]+"
_BASE60 = r"[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*"


class _ProfileLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping, aliases (`*name`), values nested
    deeper than MAX_VALUE_DEPTH, whole numbers longer than MAX_INT_DIGITS, and the numbers YAML 1.1 and
    1.2 read differently (`010`: 8 or 10; `1:30`: 90 or text).

    # NOTE: PyYAML keeps the last of two equal keys without a word, so a profile that sets a parameter
    # twice would silently run with one of them; the check is written here because PyYAML has no option.
    # An alias is shared, not copied, while loading: a few lines of aliases of aliases load at once and
    # expand to billions of elements only when the value is written out for the kernel (the build hung).
    # The composer recurses once per nesting level (a value 5000 lists deep raised RecursionError).
    """

    yaml_implicit_resolvers = {first: list(found) for first, found in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refusal(event.start_mark.line + 1, f"the alias *{event.anchor} (a profile writes every value "
                                                      f"out; aliases are not read)")
        self._depth += 1
        try:
            if self._depth > MAX_VALUE_DEPTH + 2:  # the profile and its parameter name are two levels
                mark = self.peek_event().start_mark
                raise _Refusal(mark.line + 1, f"a value nested more than MAX_VALUE_DEPTH={MAX_VALUE_DEPTH} "
                                              f"levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


for _first in "+-0123456789":  # checked before PyYAML's own int and float patterns
    _ProfileLoader.yaml_implicit_resolvers.setdefault(_first, []).insert(
        0, (_AMBIGUOUS, re.compile(f"^(?:{_OCTAL}|{_BASE60})$")))


def _ambiguous(loader: _ProfileLoader, node: yaml.ScalarNode):
    text = node.value
    if ":" in text:
        old, new = (loader.construct_yaml_float if "." in text else loader.construct_yaml_int)(node), "text"
    else:
        old, new = loader.construct_yaml_int(node), repr(int(text.replace("_", "")))
    raise _Refusal(node.start_mark.line + 1, f"{text} is {old!r} in YAML 1.1 but {new} in YAML 1.2; write the "
                                             f"number you mean without a leading 0 or ':' (or quote it as text)")


def _int(loader: _ProfileLoader, node: yaml.ScalarNode):
    digits = sum(c.isdigit() for c in node.value)
    if digits > MAX_INT_DIGITS:
        raise _Refusal(node.start_mark.line + 1, f"a whole number of {digits} digits ({node.value[:20]}...); at "
                                                 f"most {MAX_INT_DIGITS} digits")
    return loader.construct_yaml_int(node)


_ProfileLoader.add_constructor(_AMBIGUOUS, _ambiguous)
_ProfileLoader.add_constructor("tag:yaml.org,2002:int", _int)


def _unique_mapping(loader: _ProfileLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if first != key_node.start_mark.line + 1:
            raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
    return loader.construct_mapping(node, deep=deep)


_ProfileLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _profile_text(path: Path) -> str:
    """The text of profile file `path`; UsageError when it is not a plain file of at most MAX_PROFILE_BYTES.

    # NOTE: opened without blocking and checked with fstat: a named pipe in its place waited for a writer
    # forever, and /dev/zero would be read without end.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the profile file ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a named pipe" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a special file"
        raise UsageError(f"{path}: the profile file is {kind}, not a plain file")
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(MAX_PROFILE_BYTES + 1)
    if len(raw) > MAX_PROFILE_BYTES:
        raise UsageError(f"{path}: the profile file is over MAX_PROFILE_BYTES={MAX_PROFILE_BYTES:,} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: the profile file is not UTF-8 text ({exc})") from None


def read_profiles(path: Path) -> dict[str, dict]:
    """Every profile in `path`, its shape checked; UsageError naming the file and what was expected."""
    text = _profile_text(path)
    try:
        table = yaml.load(text, Loader=_ProfileLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise UsageError(f"{path}: {dup.key!r} is given twice (lines {dup.first} and {dup.second}); "
                         f"YAML would silently keep the last one: keep one") from None
    except _Refusal as refused:
        raise UsageError(f"{path}, line {refused.line}: {refused.problem}") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise UsageError(f"{path}: not a valid profile file ({problem}); expected {_PROFILE_SHAPE}") from None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: expected {_PROFILE_SHAPE}, got {type(table).__name__} {table!r}")
    unknown = sorted(map(str, set(table) - set(PROFILES)))
    if unknown:
        raise UsageError(f"{path}: unknown profiles {unknown}; allowed {list(PROFILES)}")
    for profile, section in table.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UsageError(f"{path}: profile {profile!r} must be a mapping of parameter names to values "
                             f"(e.g. 'batch_size: 8' indented under '{profile}:'), got {section!r}")
        for key in section:
            if not isinstance(key, str) or not key.isidentifier():
                raise UsageError(f"{path}: profile {profile!r} has a bad parameter name {key!r}")
            if key in RESERVED:
                raise UsageError(f"{path}: profile {profile!r} sets {key!r}, which the report runner sets itself")
    return {p: dict(s or {}) for p, s in table.items()}
