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

A parameter may declare more beside its default (`declarations`): `choices: a | b` (each element, for a
list), `multiple of: N`, `length: N` (or LO..HI) for a list, and `input: F x F x ... bytes`, the tensor it
allocates first, refused when it takes more than half of this machine's memory. A list with choices is not
empty unless its default is or its length allows 0.
"""

from __future__ import annotations

import ast
import io
import math
import os
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from ..devices import repo_root
from . import declarations
from .declarations import parse_choices, parse_input, parse_length, parse_multiple, show_bytes
from .profiles import MAX_VALUE_DEPTH, read_profiles
from .results import NAME_PATTERN, PROFILES, UsageError, _check_name, _depth_ok

__all__ = ["Declared", "notebook_parameters", "numeric", "coerce", "check_inputs", "load_profile",
           "available_notebooks", "notebooks_dir"]


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
    choices: tuple | None = None  # choices: a | b (declarations.Choice)
    multiple: int | None = None  # multiple of: N
    length: tuple[int, int] | None = None  # length: LO..HI of a list
    input: tuple | None = None  # input: F x F x ... bytes (whole numbers and parameter names)

    @property
    def choices_text(self) -> str:
        return " | ".join(c.shown for c in self.choices or ())

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
                where = f"{path}: parameter {target.id}"
                declared[target.id] = Declared(
                    target.id, text, literal(text), comment, _bounds(comment, where), parse_choices(comment, where),
                    parse_multiple(comment, where), parse_length(comment, where), parse_input(comment, where))
    for d in declared.values():
        unknown = [f for f in d.input or () if isinstance(f, str) and f not in declared]
        if unknown:
            raise UsageError(f"{path}: parameter {d.name}: its input names {', '.join(unknown)}, which the "
                             f"parameters cell does not declare")
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
    if isinstance(typed, (list, tuple, dict)) and not _depth_ok(typed, MAX_VALUE_DEPTH):
        raise UsageError(f"{where}: {name}={_shown(typed)} is nested more than MAX_VALUE_DEPTH={MAX_VALUE_DEPTH} "
                         f"levels deep (the notebook's default is {declared.text})")
    if declared.bounds is not None:
        lo, hi = declared.bounds
        if isinstance(typed, (list, tuple)):
            _check_elements(name, typed, declared, where)
        values = typed if isinstance(typed, (list, tuple)) else [typed]
        outside = [v for v in values if _is_number(v) and not lo <= v <= hi]
        if outside and isinstance(typed, (list, tuple)):
            raise UsageError(f"{where}: {name}={_shown(typed)} is out of range: each element must lie in "
                             f"{declared.bounds_text}, {_shown(outside[0])} does not")
        if outside:
            raise UsageError(f"{where}: {name}={_shown(typed)} is out of range {declared.bounds_text}")
    _check_declared(name, typed, declared, where)
    return typed


def _check_declared(name: str, typed, declared: Declared, where: str) -> None:
    """`typed` against the declared choices, multiple and length; UsageError naming what is allowed."""
    is_list = isinstance(typed, (list, tuple))
    if declared.length is not None and is_list and not declared.length[0] <= len(typed) <= declared.length[1]:
        lo, hi = declared.length
        wanted = f"{lo} values" if lo == hi else f"{lo} to {hi} values"
        raise UsageError(f"{where}: {name}={_shown(typed)} holds {len(typed)} value{'s' * (len(typed) != 1)}; "
                         f"the notebook declares {wanted} (length: {lo if lo == hi else f'{lo}..{hi}'})")
    if declared.multiple is not None:
        bad = [v for v in (typed if is_list else [typed]) if _is_number(v) and v % declared.multiple]
        if bad:
            raise UsageError(f"{where}: {name}={_shown(typed)} is not a multiple of {declared.multiple}"
                             + (f" ({_shown(bad[0])} is not)" if is_list else ""))
    if declared.choices is None:
        return
    allowed = f"the declared choices: {declared.choices_text}"
    if is_list:
        default = declared.default if isinstance(declared.default, (list, tuple)) else None
        if not typed and not (default is not None and not default) and not (
                declared.length is not None and declared.length[0] == 0):
            raise UsageError(f"{where}: {name}={_shown(typed)} is empty; give at least one of {allowed}")
        for element in typed:
            if not any(c.matches(element) for c in declared.choices):
                raise UsageError(f"{where}: {name}={_shown(typed)} holds {_shown(element)}, which is not one of "
                                 f"{allowed}")
    elif not any(c.matches(typed) for c in declared.choices):
        raise UsageError(f"{where}: {name}={_shown(typed)} is not one of {allowed}")


def check_inputs(params: dict, declared: dict[str, Declared], where) -> None:
    """The inputs the parameters declare (`input: ... bytes`) at `params` (the rest at their defaults), each
    within half of this machine's memory; UsageError naming the parameters and both sizes. `where(names)`
    says where the values came from."""
    memory = declarations.machine_memory()
    if not memory:
        return
    for d in declared.values():
        if d.input is None:
            continue
        names = list(dict.fromkeys(f for f in d.input if isinstance(f, str)))
        values = {n: params.get(n, declared[n].default) for n in names}
        if not all(_is_number(v) for v in values.values()):
            continue
        size = declarations.input_bytes(d.input, values)
        if size > memory / 2:
            given = " and ".join(f"{n}={_shown(v)}" for n, v in values.items())
            formula = " x ".join(map(str, d.input))
            raise UsageError(f"{where(names)}: {given} give an input tensor of {show_bytes(size)} ({formula} bytes), "
                             f"more than half of this machine's memory ({show_bytes(memory)}), before the "
                             f"network's activations; lower {' or '.join(names)}")


_INT64 = "a whole number in -2**63..2**63-1 (64 bits)"


def _finite(number) -> bool:
    """True for a number a float can hold that is not inf or nan (an int past 1e308 is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _shown(value) -> str:
    """repr of a value for a message, cut to 80 characters (a 5000-digit number is read by no one)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's 4300-digit limit, a value nested too deep
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text):,} characters)"


def _check_elements(name: str, values, declared: Declared, where: str) -> None:
    """A list for a ranged list parameter: not empty (unless the default is), and each element a number of
    the default's element type (whole numbers when every default element is one), not a nested list;
    UsageError naming the parameter and the bad element."""
    default = declared.default if isinstance(declared.default, (list, tuple)) else None
    allowed = f"each element a number in {declared.bounds_text}"
    if not values:
        if default is not None and not default:
            return  # the notebook's own default is empty: an empty list means something there
        raise UsageError(f"{where}: {name}={_shown(values)} is empty; give at least one value ({allowed}, e.g. "
                         f"-p '{name}={declared.text}')")
    whole = default is not None and bool(default) and all(isinstance(v, int) and _is_number(v) for v in default)
    for element in values:
        if isinstance(element, (list, tuple, dict, set)):
            raise UsageError(f"{where}: {name}={_shown(values)} holds the nested {type(element).__name__} "
                             f"{_shown(element)}; "
                             f"give a flat list ({allowed})")
        if not _is_number(element):
            raise UsageError(f"{where}: {name}={_shown(values)} holds {_shown(element)}, which is not a number "
                             f"({allowed})")
        if not _finite(element):
            raise UsageError(f"{where}: {name}={_shown(values)} holds {_shown(element)}, which is not a finite number "
                             f"({allowed})")
        if whole and not isinstance(element, int):
            raise UsageError(f"{where}: {name}={_shown(values)} holds {_shown(element)}, which is not a whole number "
                             f"(the notebook's default is {declared.text}: {allowed})")


def _typed(name: str, value, declared: Declared, where: str):
    default, kind = declared.default, type(declared.default)
    shown = _shown(value)

    def refuse(expected: str):
        return UsageError(f"{where}: {name}={shown} is not {expected} (the notebook's default is {declared.text})")

    if default is MISSING or default is None:
        if isinstance(value, str):
            parsed = literal(value)
            return value if parsed is MISSING else parsed
        return value
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind in (int, float) and not text.isascii():  # int() and float() read '٣' and '１' as 3 and 1
            raise refuse("a whole number" if kind is int else "a number")
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise refuse("true or false")
            return text.lower() == "true"
        if kind is int:
            if not re.fullmatch(r"[+-]?\d+", text):
                raise refuse("a whole number")
            if len(text.lstrip("+-").lstrip("0")) > 19:  # before int(): past 4300 digits it raises
                raise refuse(_INT64)
            value = int(text)
        elif kind is float:
            try:
                number = float(text)
            except ValueError:
                raise refuse("a number") from None
            if not math.isfinite(number):
                raise refuse("a finite number")
            return number
        else:
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
        if not -(2**63) <= value < 2**63:
            raise refuse(_INT64)
    elif kind is float:
        if not _is_number(value):
            raise refuse("a number")
        if not _finite(value):
            raise refuse("a finite number")
        value = float(value)
    elif kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise refuse("a list")
    elif not isinstance(value, kind):
        raise refuse(f"a {kind.__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Profiles: notebooks/profiles/<name>.yaml (read by `profiles`)


def load_profile(name: str, profile: str, folder: Path | None = None) -> dict:
    """Parameter overrides of notebook `name` at `profile` (notebooks/profiles/<name>.yaml)."""
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    path = (folder or notebooks_dir()) / "profiles" / f"{_check_name(name)}.yaml"
    if not os.path.lexists(path):
        return {}
    return read_profiles(path).get(profile, {})
