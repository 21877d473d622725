"""A notebook's parameters: what its parameters cell declares (defaults and ranges) and its profiles.

The parameters cell is the first code cell tagged `parameters`: flat literal assignments, one per line.
A numeric parameter (a number, or a list of numbers) states the values it allows in a comment on its
line, beside its default:

    batch_size = 4            # range: 1..4096; images per step
    lr = 0.01                 # range: 1e-06..10
    batch_sizes = [1, 8, 32]  # range: 1..65536 (each element)

`range: LO..HI` holds both ends (a value equal to LO or HI is allowed); the rest of the comment is
free text. The runner types every `-p` and profile value by the default's type and refuses one
outside its range before any kernel starts, naming the parameter, the value and the range. A ranged
list takes a flat, non-empty list (empty only where the default is) of numbers, whole numbers where
every default element is one; the message names the element that is not.
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..devices import repo_root
from .results import NAME_PATTERN, PROFILES, RESERVED, UsageError, _check_name

__all__ = ["Declared", "notebook_parameters", "numeric", "coerce", "load_profile", "available_notebooks",
           "notebooks_dir"]


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def available_notebooks(folder: Path | None = None) -> list[str]:
    """Notebook names in `folder`; files whose names are not letters, digits, '_' and '-' are skipped."""
    folder = folder or notebooks_dir()
    return sorted(p.stem for p in folder.glob("*.ipynb") if NAME_PATTERN.fullmatch(p.stem) and p.is_file())


# ---------------------------------------------------------------------------------------------
# The parameters cell

MISSING = object()  # a default written as an expression: its type is unknown
_NUMBER = r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?"
_RANGE = re.compile(rf"\brange:\s*({_NUMBER})\s*\.\.\s*({_NUMBER})(?![\w.])")


@dataclass(frozen=True)
class Declared:
    """One parameter of a notebook's parameters cell."""

    name: str
    text: str  # the default as written
    default: object  # the literal value, or MISSING
    comment: str  # the comment on its line, without '#'
    bounds: tuple[float, float] | None = None  # range: LO..HI, both allowed

    @property
    def bounds_text(self) -> str:
        return "" if self.bounds is None else f"{_show(self.bounds[0])}..{_show(self.bounds[1])}"


def _show(number: float) -> str:
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else repr(float(number))


def literal(text: str | None):
    """The Python literal `text` stands for, or MISSING."""
    try:
        return ast.literal_eval(text) if text is not None else MISSING
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return MISSING


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric(value) -> bool:
    """True for a number or a non-empty list or tuple of numbers: the parameters that need a range."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_number(v) for v in value)
    return _is_number(value)


def _comments(source: str) -> dict[int, str]:
    found = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found[token.start[0]] = token.string.lstrip("#").strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def _bounds(comment: str, where: str) -> tuple[float, float] | None:
    if "range:" not in comment:
        return None
    match = _RANGE.search(comment)
    bounds = None if match is None else (float(match.group(1)), float(match.group(2)))
    if bounds is None or not all(map(math.isfinite, bounds)) or bounds[0] > bounds[1]:
        raise UsageError(f"{where}: the comment {comment!r} holds no valid range; write 'range: LO..HI' "
                         f"with numbers LO <= HI (e.g. 'range: 1..4096')")
    return tuple(int(b) if b.is_integer() else b for b in bounds)


def notebook_parameters(path: str | Path) -> dict[str, Declared]:
    """The parameters declared in the notebook's cell tagged `parameters` (empty when it has none), by name.

    # NOTE: papermill.inspect_notebook reads the same cell with a regular expression that skips a line
    # holding two '=' (in a comment too) without a word; the cell is parsed here as Python instead.
    """
    import nbformat

    path = Path(path)
    try:
        notebook = nbformat.read(path, as_version=4)
        cell = next((c for c in notebook.cells if c.cell_type == "code"
                     and "parameters" in c.get("metadata", {}).get("tags", [])), None)
        source = "" if cell is None else cell.source
    except Exception as exc:  # not JSON, not a notebook
        raise UsageError(f"{path}: cannot read the notebook's parameters ({type(exc).__name__}: {exc})") from None
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise UsageError(f"{path}: the parameters cell is not valid Python (line {exc.lineno}: {exc.msg})") from None
    comments = _comments(source)
    declared = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if isinstance(target, ast.Name):
                comment = comments.get(node.end_lineno, "")
                text = ast.get_source_segment(source, node.value) or ""
                declared[target.id] = Declared(target.id, text, literal(text), comment,
                                               _bounds(comment, f"{path}: parameter {target.id}"))
    return declared


# ---------------------------------------------------------------------------------------------
# Typing and ranging a value


def coerce(name: str, value, declared: Declared, where: str):
    """`value` converted to the type of the declared default and checked against its range; UsageError
    naming the parameter, the value and what is allowed when it cannot be.

    # NOTE: strings from the command line are parsed by the declared type, not guessed with YAML
    # (where `1e-3` stays a string, `012` is octal 10 and `no`/`off` are False): an int parameter
    # takes decimal digits only, a float any finite number, a bool only true/false.
    """
    typed = _typed(name, value, declared, where)
    if declared.bounds is not None:
        lo, hi = declared.bounds
        if isinstance(typed, (list, tuple)):
            _check_elements(name, typed, declared, where)
        values = typed if isinstance(typed, (list, tuple)) else [typed]
        outside = [v for v in values if _is_number(v) and not lo <= v <= hi]
        if outside and isinstance(typed, (list, tuple)):
            raise UsageError(f"{where}: {name}={typed!r} is out of range: each element must lie in "
                             f"{declared.bounds_text}, {outside[0]!r} does not")
        if outside:
            raise UsageError(f"{where}: {name}={typed!r} is out of range {declared.bounds_text}")
    return typed


def _check_elements(name: str, values, declared: Declared, where: str) -> None:
    """A list for a ranged list parameter: not empty (unless the default is), and each element a number of
    the default's element type (whole numbers when every default element is one), not a nested list;
    UsageError naming the parameter and the bad element."""
    default = declared.default if isinstance(declared.default, (list, tuple)) else None
    allowed = f"each element a number in {declared.bounds_text}"
    if not values:
        if default is not None and not default:
            return  # the notebook's own default is empty: an empty list means something there
        raise UsageError(f"{where}: {name}={values!r} is empty; give at least one value ({allowed}, e.g. "
                         f"-p '{name}={declared.text}')")
    whole = default is not None and bool(default) and all(isinstance(v, int) and _is_number(v) for v in default)
    for element in values:
        if isinstance(element, (list, tuple, dict, set)):
            raise UsageError(f"{where}: {name}={values!r} holds the nested {type(element).__name__} {element!r}; "
                             f"give a flat list ({allowed})")
        if not _is_number(element):
            raise UsageError(f"{where}: {name}={values!r} holds {element!r}, which is not a number ({allowed})")
        if not math.isfinite(element):
            raise UsageError(f"{where}: {name}={values!r} holds {element!r}, which is not a finite number "
                             f"({allowed})")
        if whole and not isinstance(element, int):
            raise UsageError(f"{where}: {name}={values!r} holds {element!r}, which is not a whole number "
                             f"(the notebook's default is {declared.text}: {allowed})")


def _typed(name: str, value, declared: Declared, where: str):
    default, kind = declared.default, type(declared.default)
    shown = value

    def refuse(expected: str):
        return UsageError(f"{where}: {name}={shown!r} is not {expected} (the notebook's default is {declared.text})")

    if default is MISSING or default is None:
        if isinstance(value, str):
            parsed = literal(value)
            return value if parsed is MISSING else parsed
        return value
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise refuse("true or false")
            return text.lower() == "true"
        if kind is int:
            if not re.fullmatch(r"[+-]?\d+", text):
                raise refuse("a whole number")
            return int(text)
        if kind is float:
            try:
                number = float(text)
            except ValueError:
                raise refuse("a number") from None
            if not math.isfinite(number):
                raise refuse("a finite number")
            return number
        value = literal(text)
        if value is MISSING:
            example = f"; e.g. -p '{name}={declared.text}'" if kind in (list, tuple, dict) else ""
            raise refuse(f"a Python {kind.__name__} literal{example}")
    if kind is bool:
        if not isinstance(value, bool):
            raise refuse("true or false")
    elif kind is int:
        if not _is_number(value) or not isinstance(value, int):
            raise refuse("a whole number")
    elif kind is float:
        if not _is_number(value):
            raise refuse("a number")
        if not math.isfinite(value):
            raise refuse("a finite number")
        value = float(value)
    elif kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise refuse("a list")
    elif not isinstance(value, kind):
        raise refuse(f"a {kind.__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Profiles: notebooks/profiles/<name>.yaml

_PROFILE_SHAPE = "a mapping of profile names (smoke, cpu, gpu, paper) to mappings of parameter names to values"


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


class _ProfileLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping.

    # NOTE: PyYAML keeps the last of two equal keys without a word, so a profile that sets a parameter
    # twice would silently run with one of them; the check is written here because PyYAML has no option.
    """


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


def _read_profiles(path: Path) -> dict[str, dict]:
    """Every profile in `path`, its shape checked; UsageError naming the file and what was expected."""
    try:
        table = yaml.load(path.read_text(), Loader=_ProfileLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise UsageError(f"{path}: {dup.key!r} is given twice (lines {dup.first} and {dup.second}); "
                         f"YAML would silently keep the last one: keep one") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise UsageError(f"{path}: not a valid profile file ({problem}); expected {_PROFILE_SHAPE}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the profile file ({exc})") from None
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


def load_profile(name: str, profile: str, folder: Path | None = None) -> dict:
    """Parameter overrides of notebook `name` at `profile` (notebooks/profiles/<name>.yaml)."""
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    path = (folder or notebooks_dir()) / "profiles" / f"{_check_name(name)}.yaml"
    if not path.exists():
        return {}
    return _read_profiles(path).get(profile, {})
