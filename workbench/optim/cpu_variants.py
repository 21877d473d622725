"""The build variants of the hand-written CPU packed step (``cpu_kernel``), and the choice among them kept per CPU.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (the fused packed step);
which build of it runs fastest differs by CPU (issue 48: 1.03-1.11x of torch's fused AdamW on an AMD EPYC Zen 4,
0.65-0.70x on an Intel Xeon Sapphire Rapids with the same build).

A :class:`Variant` is one build of ``csrc/packed_step.cpp``, its knobs preprocessor defines and compiler flags
(:func:`build_flags`), its name a part of the build's name in torch's extension cache (``cpu_kernel.extension_name``):

- ``isa``: ``avx512`` (with ``+vbmi``, the byte-permute assembly of bf16 master values in packed_io.h, and
  ``+bf16``, vcvtneps2bf16 for bf16 moments, where the CPU has them), ``avx2``, or ``generic`` (the fallback);
- ``prefetch``: blocks ahead each stream is prefetched (0: off) and the hint (``nta``, ``t0``, ``w``: prefetchw);
- ``divide``: ``fma`` (the division by sqrt(1 - beta2**t) as a multiply and an FMA correction) or ``div`` (vdivps).

Every variant gives the eager step's bits (``tests/optim/test_cpu_kernel.py`` checks them). Names read
``avx512+vbmi+bf16-pf32nta-fma``; a shorter text (``avx2``, ``avx512-pf0``, ``default``) takes the default of each
knob it leaves out (:func:`parse_variant`), as ``WORKBENCH_CPU_KERNEL_VARIANT`` does.

The choice (``workbench.optim.tune_cpu_kernel`` measures it) is a JSON file in torch's extension cache beside the
builds, keyed by the CPU model and a digest of the kernel's sources (:func:`choice_path`); :func:`choose` picks the
variant from paired ratios against torch, and keeps the default unless another is faster by a margin.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHOICE_MARGIN", "ENV_VARIANT", "Variant", "build_flags", "candidates", "choice_path", "choose", "combined",
           "cpu_flags", "cpu_model", "default_variant", "extension_name", "extensions_root", "finalists",
           "knob_group", "load_choice", "parse_variant", "save_choice", "scores", "source_digest", "unusable_reason"]

CSRC = Path(__file__).resolve().parent / "csrc"
#: The environment variable that forces a variant (a name or its short form, see :func:`parse_variant`).
ENV_VARIANT = "WORKBENCH_CPU_KERNEL_VARIANT"
#: A measured variant replaces the default only when its score is this much higher (noise, not a speed-up).
CHOICE_MARGIN = 0.02

ISAS = ("avx512", "avx2", "generic")
HINTS = {"nta": 0, "t0": 1, "w": 2}  # WB_PREFETCH_HINT
DIVIDES = ("fma", "div")
# NOTE: -ffp-contract=off: no fused multiply-add the source does not write, so each multiply and add rounds
# once, as the eager step's separate torch ops do. The vector width follows the ISA as ATen's own kernels do.
_ARCH_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
# the /proc/cpuinfo flags each ISA and extra needs
_NEEDS = {"avx512": {"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma", "f16c"}, "avx2": {"avx2", "fma", "f16c"},
          "generic": set(), "vbmi": {"avx512vbmi"}, "bf16": {"avx512_bf16"}, "w": {"3dnowprefetch"}}
_PREFETCH_DEFAULT, _HINT_DEFAULT = 32, "nta"


@dataclass(frozen=True)
class Variant:
    """One build of the kernel (see the module docstring for the knobs)."""

    isa: str = "avx512"
    vbmi: bool = False
    bf16: bool = False
    prefetch: int = _PREFETCH_DEFAULT
    hint: str = _HINT_DEFAULT
    divide: str = "fma"

    def __post_init__(self) -> None:
        if self.isa not in ISAS:
            raise ValueError(f"isa={self.isa!r}: one of {ISAS}")
        if (self.vbmi or self.bf16) and self.isa != "avx512":
            raise ValueError(f"+vbmi / +bf16 are AVX512 extensions; isa={self.isa!r}")
        if not 0 <= self.prefetch <= 1024:
            raise ValueError(f"prefetch={self.prefetch}: blocks ahead in 0 (off) .. 1024")
        if self.hint not in HINTS:
            raise ValueError(f"hint={self.hint!r}: one of {tuple(HINTS)}")
        if self.divide not in DIVIDES:
            raise ValueError(f"divide={self.divide!r}: one of {DIVIDES}")

    @property
    def name(self) -> str:
        isa = self.isa + ("+vbmi" if self.vbmi else "") + ("+bf16" if self.bf16 else "")
        prefetch = f"pf{self.prefetch}{self.hint}" if self.prefetch else "pf0"
        return f"{isa}-{prefetch}-{self.divide}"

    @property
    def slug(self) -> str:
        """The name as an identifier (the build's name and op namespace take it)."""
        return self.name.replace("+", "_").replace("-", "_")

    def needs(self) -> set[str]:
        """The CPU flags (as /proc/cpuinfo lists them) a machine needs to run this build."""
        out = set(_NEEDS[self.isa])
        for extra in ("vbmi", "bf16"):
            if getattr(self, extra):
                out |= _NEEDS[extra]
        if self.prefetch and self.hint == "w":
            out |= _NEEDS["w"]
        return out

    def missing(self, flags: frozenset[str] | None = None) -> set[str]:
        """The flags this build needs that the CPU (``flags``, by default this machine's) lacks; empty when it
        runs here. Without /proc/cpuinfo nothing can be checked: nothing is missing."""
        have = cpu_flags() if flags is None else flags
        return self.needs() - have if have else set()


def _torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def unusable_reason(variant: Variant, flags: frozenset[str] | None = None, capability: str | None = None) -> str | None:
    """Why ``variant`` cannot run here (None when it can): CPU flags it needs that the CPU (``flags``, by default
    this machine's) lacks, or a build whose kernels are not of the kind ATen runs (``capability``, by default
    torch's): a vector build (AVX2, AVX512) where ATen runs scalar kernels, a generic one where it runs vector ones.

    NOTE: with bf16 moments ATen's AVX2/AVX512 kernels and its scalar ones round the eager step differently, and
    each build follows one kind (checked: every vector build equals the eager step under ATEN_CPU_CAPABILITY=avx2
    and avx512, the generic build under default only), so the generic build is only the fallback of a CPU
    without AVX2.
    """
    if missing := variant.missing(flags):
        return f"the build {variant.name} needs CPU flags this CPU lacks: {sorted(missing)}"
    cap = (_torch_capability() if capability is None else capability).upper()
    vector_aten = cap in ("AVX2", "AVX512")
    if (variant.isa == "generic") == vector_aten:
        kind = "scalar" if variant.isa == "generic" else "vector (AVX2/AVX512)"
        return (f"the build {variant.name} gives the eager step's bits where ATen runs {kind} kernels; torch's CPU "
                f"capability here is {cap} (ATEN_CPU_CAPABILITY sets it)")
    return None


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU model as /proc/cpuinfo names it, with its family and model numbers (a hypervisor may show a bare
    'AMD EPYC'); the machine's architecture where there is no /proc/cpuinfo."""
    info = _cpuinfo()
    if not info:
        import platform

        return platform.processor() or platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def default_variant(capability: str | None = None, flags: frozenset[str] | None = None) -> Variant:
    """The build used where no choice was measured: the ISA of torch's CPU capability (as ATen's own kernels),
    on AVX512 with the byte permutes and the bf16 conversion where the CPU has them; prefetch 32 blocks ahead
    (nta), the FMA division. ``capability`` defaults to torch's, ``flags`` to this machine's."""
    capability = _torch_capability() if capability is None else capability
    isa = {"AVX512": "avx512", "AVX2": "avx2"}.get(capability.upper(), "generic")
    have = cpu_flags() if flags is None else flags
    extras = isa == "avx512"
    return Variant(isa=isa, vbmi=extras and "avx512vbmi" in have, bf16=extras and "avx512_bf16" in have)


def parse_variant(text: str, default: Variant | None = None) -> Variant:
    """A variant from its name (``avx512+vbmi+bf16-pf32nta-fma``) or a shorter text: the ISA first (``avx512``,
    ``avx512+bf16``, ``avx2``, ``generic``; ``default`` keeps ``default``'s), then in any order ``pf<N>[hint]``
    and ``fma`` / ``div``; each knob left out is ``default``'s (by default :func:`default_variant`), extras
    included only when named (``avx512`` alone has none)."""
    base = default_variant() if default is None else default
    parts = [p for p in text.strip().lower().split("-") if p]
    if not parts:
        raise ValueError(f"variant {text!r}: empty; e.g. 'avx2', 'avx512-pf0', {base.name!r}")
    fields: dict[str, Any] = {}
    if parts[0] == "default":
        parts = parts[1:]
    elif parts[0].split("+")[0] in ISAS:
        isa, *extras = parts.pop(0).split("+")
        if set(extras) - {"vbmi", "bf16"}:
            raise ValueError(f"variant {text!r}: extras {extras} (AVX512 takes +vbmi, +bf16)")
        fields.update(isa=isa, vbmi="vbmi" in extras, bf16="bf16" in extras)
    for part in parts:
        prefetch = re.fullmatch(rf"pf(\d+)({'|'.join(HINTS)})?", part)
        if part in DIVIDES:
            fields["divide"] = part
        elif prefetch:
            fields["prefetch"] = int(prefetch[1])
            fields["hint"] = prefetch[2] or _HINT_DEFAULT
        else:
            raise ValueError(f"variant {text!r}: {part!r} is none of: an ISA {ISAS} first (AVX512 with +vbmi, "
                             f"+bf16), pf<blocks>[{'|'.join(HINTS)}], {' or '.join(DIVIDES)}")
    try:
        return dataclasses.replace(base, **fields)
    except ValueError as e:
        raise ValueError(f"variant {text!r}: {e}") from None


def build_flags(variant: Variant) -> list[str]:
    """The C++ compiler flags of a variant's build (the defines packed_step.cpp reads, the ISA's flags)."""
    # NOTE: hidden visibility: torch loads each build's library into the global symbol scope (RTLD_GLOBAL), and the
    # inline helpers and ATen's vector templates of two variants (other ISA flags, one mangled name) must not bind
    # to each other's code (an AVX512 build exported them as weak symbols)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             *_ARCH_FLAGS[variant.isa]]
    flags += ["-mavx512vbmi"] if variant.vbmi else []
    flags += ["-mavx512bf16"] if variant.bf16 else []
    flags += ["-mprfchw"] if variant.prefetch and variant.hint == "w" else []
    return flags + [f"-DWB_PREFETCH_BLOCKS={variant.prefetch}", f"-DWB_PREFETCH_HINT={HINTS[variant.hint]}",
                    f"-DWB_DIVIDE_PLAIN={int(variant.divide == 'div')}"]


def extension_name(variant: Variant) -> str:
    """The build's name in torch's extension cache (and its op namespace): the variant and a digest of the
    sources, the flags, torch's version and the compiler, so two checkouts with different kernels never share (and
    keep rebuilding) one build, and a build found under this name was made from these (``cpu_kernel.load_variant``
    loads it without asking ninja)."""
    import torch

    digest = hashlib.sha256(source_digest().encode())
    digest.update(" ".join(build_flags(variant)).encode())
    digest.update(f"\0{torch.__version__}\0{os.environ.get('CXX', 'c++')}".encode())
    return f"workbench_packed_step_{variant.slug}_{digest.hexdigest()[:10]}"


def extensions_root() -> Path:
    """torch's extension cache directory (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/<py>_<acc>``),
    found as the parent of the default build's folder."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(extension_name(default_variant()), False)).parent


def source_digest() -> str:
    """A digest of the kernel's sources (packed_step.cpp and the headers it includes)."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("packed_*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def candidates(base: Variant | None = None, flags: frozenset[str] | None = None,
               capability: str | None = None) -> list[Variant]:
    """The variants a tuning run measures, ``base`` (by default :func:`default_variant`) first, then each with
    one knob changed: the ISA builds (AVX512 without the byte permutes, without any extra, AVX2), prefetch off,
    16 and 64 blocks ahead, the t0 and w hints, and the divider; those the CPU cannot run are left out.

    NOTE: measured on the 2-core AMD EPYC (Zen 4), 4M parameters in 8 tensors, 1 thread, load 1.2, the PackedAdamW
    step against torch's fused AdamW (bf16+8 / bf16+16 / bf16+8 with bf16 moments): the default 1.06 / 0.95 /
    1.28, AVX2 0.62 / 0.60 / 0.34, AVX512 without extras 1.08 / 0.91 / 1.05, prefetch off 0.97 / 0.86 / 1.25; the
    other prefetch distances and hints and the divider within +-6% of the default (the noise of one run); the
    second round kept the default. On an Intel Sapphire Rapids the default measured 0.65-0.70x (issue 48).
    """
    base = default_variant(capability, flags) if base is None else base
    replace = functools.partial(dataclasses.replace, base)
    out = [base]
    if base.isa == "avx512":
        out += [replace(vbmi=False), replace(vbmi=False, bf16=False), replace(isa="avx2", vbmi=False, bf16=False)]
    out += [replace(prefetch=0), replace(prefetch=16), replace(prefetch=64)]
    out += [replace(hint=h) for h in HINTS if h != base.hint]
    out.append(replace(divide="div" if base.divide == "fma" else "fma"))
    unique = list(dict.fromkeys(out))
    return [v for v in unique if unusable_reason(v, flags, capability) is None]


# the knobs a tuning run varies together: the ISA with its extras, the prefetch with its hint
_GROUPS = {"isa": ("isa", "vbmi", "bf16"), "prefetch": ("prefetch", "hint"), "divide": ("divide",)}


def combined(base: Variant, best: Mapping[str, Variant]) -> Variant:
    """``base`` with each knob taken from the variant that won it (``best``: knob group -> variant)."""
    fields: dict[str, Any] = {}
    for group, variant in best.items():
        for name in _GROUPS[group]:
            fields[name] = getattr(variant, name)
    return dataclasses.replace(base, **fields)


def knob_group(base: Variant, variant: Variant) -> str | None:
    """The knob group in which ``variant`` differs from ``base`` (None: equal, or more than one group)."""
    differ = [g for g, names in _GROUPS.items() if any(getattr(base, n) != getattr(variant, n) for n in names)]
    return differ[0] if len(differ) == 1 else None


def scores(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Each variant's score: the geometric mean of its paired median ratios against torch over the cells
    (threads, format) it was measured in; variants missing a cell that another has are left out."""
    by_variant: dict[str, dict[tuple, float]] = {}
    for r in records:
        ratio = float(r["ratio"])
        if not ratio > 0 or not math.isfinite(ratio):
            raise ValueError(f"record {dict(r)}: ratio must be a positive finite number")
        by_variant.setdefault(str(r["variant"]), {})[(r.get("threads"), r.get("format"))] = ratio
    cells = set().union(*by_variant.values()) if by_variant else set()
    return {v: math.exp(sum(math.log(x) for x in cell.values()) / len(cell))
            for v, cell in by_variant.items() if set(cell) == cells}


def choose(records: Iterable[Mapping[str, Any]], default: str, *, margin: float = CHOICE_MARGIN) -> str:
    """The variant to build: the highest :func:`scores`, unless it beats ``default``'s score by less than
    ``margin`` (then ``default``: the difference is within the noise of a short measurement)."""
    if margin < 0:
        raise ValueError(f"margin={margin}: must be >= 0")
    s = scores(records)
    if not s:
        return default
    best = max(s, key=lambda v: (s[v], v == default))
    if default in s and s[best] < s[default] * (1 + margin):
        return default
    return best


def choice_path(root: str | os.PathLike | None = None, *, model: str | None = None,
                digest: str | None = None) -> Path:
    """Where the measured choice for this CPU model and these sources lives: a JSON file in torch's extension
    cache directory (``root``, by default the folder torch builds extensions into), beside the builds."""
    root = extensions_root() if root is None else root
    key = hashlib.sha256(f"{model or cpu_model()}\0{digest or source_digest()}".encode()).hexdigest()[:12]
    return Path(root) / f"workbench_packed_step_choice_{key}.json"


def save_choice(record: Mapping[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Write a tuning run's record (``chosen``, ``cpu``, ``source_digest``, ``torch``, ``measured_at``,
    ``records``...) to ``path`` (by default :func:`choice_path`), atomically; returns the path."""
    for key in ("chosen", "cpu", "source_digest"):
        if key not in record:
            raise ValueError(f"a choice record needs {key!r}; got keys {sorted(record)}")
    parse_variant(str(record["chosen"]))  # a name that cannot be built is refused before it is kept
    out = Path(path) if path is not None else choice_path(model=record["cpu"], digest=record["source_digest"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(record), indent=1, default=str))
    tmp.replace(out)
    return out


def load_choice(path: str | os.PathLike | None = None, *, model: str | None = None,
                digest: str | None = None) -> dict[str, Any] | None:
    """The kept record for this CPU model and these sources (None when none was measured, or when the file is
    unreadable or was measured for another CPU or other sources)."""
    model, digest = model or cpu_model(), digest or source_digest()
    file = Path(path) if path is not None else choice_path(model=model, digest=digest)
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("cpu") != model or record.get("source_digest") != digest:
        return None
    try:
        parse_variant(str(record.get("chosen")))
    except ValueError:
        return None
    return record


def finalists(records: Sequence[Mapping[str, Any]], base: Variant, *, top: int = 2) -> list[Variant]:
    """What a tuning run's second round measures again: ``base``, the ``top`` best of the first round, and
    ``base`` with every knob group's winner (when it is a variant not yet measured)."""
    s = scores(records)
    ranked = sorted(s, key=s.get, reverse=True)
    measured = {parse_variant(v, base) for v in s}
    best: dict[str, tuple[float, Variant]] = {}
    for name, score in s.items():
        v = parse_variant(name, base)
        group = knob_group(base, v)
        if group and score > best.get(group, (s.get(base.name, 0.0), base))[0]:
            best[group] = (score, v)
    out = [base] + [parse_variant(v, base) for v in ranked[:top]]
    mix = combined(base, {g: v for g, (_, v) in best.items()})
    if mix not in measured:
        out.append(mix)
    return list(dict.fromkeys(out))
