"""What a parameter's comment declares besides its range, checked before any kernel starts.

Each declaration is `KEY: ...` in the comment on the parameter's line, ended by ';' or the comment's end:

    device = ""             # choices: "" | cpu | cuda | cuda:0..63; "" picks CUDA when present
    models = ["mlp"]        # choices: resnet50 | mlp | lstm   (each element, for a list)
    tf_d_model = 128        # range: 64..65536; multiple of: 64
    weights = [0.5, 0.5]    # range: 0..1; length: 2        (or length: LO..HI)
    image_size = 16         # range: 8..1024; input: batch_size x 3 x image_size x image_size x 4 bytes

`choices:` lists the allowed values separated by '|' (a string written in quotes is taken as it is, so `""` is the
empty string; a whole number matches a choice written as that number: `channels = 1  # range: 1..3; choices: 1 | 3`);
a choice holding `LO..HI` (whole numbers) stands for each whole number in that range written there (`cuda:0..63`,
`fp16+0..13 SR`). `input:` is the bytes of the tensor the notebook allocates first: factors
that are whole numbers or parameter names, multiplied; a value set whose input takes more than half of this
machine's memory is refused (the network's activations are many times its input), naming the parameters.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .results import UsageError

__all__ = ["Choice", "parse_choices", "parse_multiple", "parse_length", "parse_input", "machine_memory",
           "input_bytes", "show_bytes"]

_CHOICES = re.compile(r"\bchoices:([^;]*)")
_MULTIPLE = re.compile(r"\bmultiple of:\s*([^;\s]*)")
_LENGTH = re.compile(r"\blength:\s*(\d+)(?:\s*\.\.\s*(\d+))?(?![\w.])")
_INPUT = re.compile(r"\binput:([^;]*)")
_SPAN = re.compile(r"(\d+)\.\.(\d+)")
_WHOLE = r"(0|[1-9]\d*)"


@dataclass(frozen=True)
class Choice:
    """One allowed value as written; `spans` are the (LO, HI) of each `LO..HI` in it."""

    text: str
    pattern: re.Pattern
    spans: tuple[tuple[int, int], ...] = ()

    def matches(self, value) -> bool:
        if isinstance(value, int) and not isinstance(value, bool):  # a whole number as written (`choices: 1 | 3`)
            value = str(value)
        if not isinstance(value, str):
            return False
        found = self.pattern.fullmatch(value)
        return found is not None and all(lo <= int(g) <= hi
                                         for g, (lo, hi) in zip(found.groups(), self.spans, strict=True))

    @property
    def shown(self) -> str:
        return self.text if self.text and self.text.strip() == self.text and "|" not in self.text \
            else repr(self.text)


def _choice(token: str, where: str) -> Choice:
    token = token.strip()
    if len(token) >= 2 and token[0] == token[-1] and token[0] in "\"'":
        text = token[1:-1]
        return Choice(text, re.compile(re.escape(text)))
    if not token:
        raise UsageError(f"{where}: an empty choice; write the empty string as \"\"")
    parts, spans, at = [], [], 0
    for span in _SPAN.finditer(token):
        lo, hi = int(span.group(1)), int(span.group(2))
        if lo > hi:
            raise UsageError(f"{where}: the choice {token!r} holds {span.group(0)}, whose ends are the wrong way round")
        parts += [re.escape(token[at:span.start()]), _WHOLE]
        spans.append((lo, hi))
        at = span.end()
    parts.append(re.escape(token[at:]))
    return Choice(token, re.compile("".join(parts)), tuple(spans))


def parse_choices(comment: str, where: str) -> tuple[Choice, ...] | None:
    """The choices a comment declares (`choices: a | b | ""`), or None."""
    found = _CHOICES.search(comment)
    if found is None:
        return None
    if not found.group(1).strip():
        raise UsageError(f"{where}: the comment {comment!r} declares no choices; write 'choices: a | b'")
    return tuple(_choice(token, where) for token in found.group(1).split("|"))


def parse_multiple(comment: str, where: str) -> int | None:
    found = _MULTIPLE.search(comment)
    if found is None:
        return None
    if not found.group(1).isdigit() or int(found.group(1)) < 1:
        raise UsageError(f"{where}: the comment {comment!r} holds no valid 'multiple of: N' (N a whole number >= 1)")
    return int(found.group(1))


def parse_length(comment: str, where: str) -> tuple[int, int] | None:
    if "length:" not in comment:
        return None
    found = _LENGTH.search(comment)
    lo = hi = None if found is None else int(found.group(1))
    if found is not None and found.group(2) is not None:
        hi = int(found.group(2))
    if found is None or lo > hi:
        raise UsageError(f"{where}: the comment {comment!r} holds no valid length; write 'length: N' or "
                         f"'length: LO..HI' (whole numbers, LO <= HI)")
    return lo, hi


def parse_input(comment: str, where: str) -> tuple[int | str, ...] | None:
    """The factors of a declared input's bytes (`input: batch_size x 3 x 4 bytes`), or None."""
    found = _INPUT.search(comment)
    if found is None:
        return None
    text = found.group(1).strip()
    factors = tuple(f.strip() for f in text.removesuffix("bytes").split(" x ")) if text.endswith("bytes") else ()
    if not factors or not all(f.isdigit() or f.isidentifier() for f in factors):
        raise UsageError(f"{where}: the comment {comment!r} holds no valid input; write 'input: F x F x ... bytes' "
                         f"with whole numbers and parameter names (e.g. 'batch_size x 3 x 32 x 32 x 4 bytes')")
    return tuple(int(f) if f.isdigit() else f for f in factors)


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def input_bytes(factors, values: dict) -> int:
    total = 1
    for factor in factors:
        total *= factor if isinstance(factor, int) else int(values[factor])
    return total


def show_bytes(count: float) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"
