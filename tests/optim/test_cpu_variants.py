"""The CPU kernel's build variants and the choice among them kept per CPU (``workbench.optim.cpu_variants``), and the
tuning run that measures them (``workbench.optim.tune_cpu_kernel``) with fake timings: names, flags, candidates,
the choice rule, the JSON file's round trip and what ``cpu_kernel`` loads from it. Nothing here builds or times.
"""

import json

import pandas as pd
import pytest

from workbench.optim import cpu_kernel, cpu_variants, tune_cpu_kernel
from workbench.optim.cpu_variants import (ENV_VARIANT, Variant, build_flags, candidates, choose, default_variant,
                                          load_choice, parse_variant, save_choice, scores, unusable_reason)

ZEN4 = frozenset("avx2 fma f16c avx512f avx512dq avx512vl avx512bw avx512vbmi avx512_bf16 3dnowprefetch".split())
AVX2_ONLY = frozenset("avx2 fma f16c".split())
BASE = Variant(isa="avx512", vbmi=True, bf16=True)


def test_names_round_trip_and_short_forms_take_the_defaults():
    assert BASE.name == "avx512+vbmi+bf16-pf32nta-fma" and BASE.slug == "avx512_vbmi_bf16_pf32nta_fma"
    for v in candidates(BASE, ZEN4, "AVX512"):
        assert parse_variant(v.name, BASE) == v
    assert parse_variant("avx2", BASE) == Variant(isa="avx2")
    assert parse_variant("avx512", BASE) == Variant()  # extras only when named
    assert parse_variant("default-pf0-div", BASE) == Variant(isa="avx512", vbmi=True, bf16=True, prefetch=0,
                                                             divide="div")
    assert parse_variant("pf16t0", BASE) == Variant(isa="avx512", vbmi=True, bf16=True, prefetch=16, hint="t0")
    assert parse_variant("pf10", BASE).prefetch == 10  # digits are not taken for a hint
    for bad in ("", "avx9", "avx2+vbmi", "avx512+sse", "pf", "pfx", "pf8q", "fast"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad, BASE)
    with pytest.raises(ValueError, match="prefetch"):
        Variant(prefetch=-1)


def test_flags_follow_the_knobs():
    flags = build_flags(BASE)
    assert "-DCPU_CAPABILITY_AVX512" in flags and "-mavx512vbmi" in flags and "-mavx512bf16" in flags
    assert "-ffp-contract=off" in flags and "-DWB_PREFETCH_BLOCKS=32" in flags and "-DWB_DIVIDE_PLAIN=0" in flags
    plain = build_flags(parse_variant("avx2-pf0-div", BASE))
    assert "-DCPU_CAPABILITY_AVX2" in plain and not any("avx512" in f for f in plain)
    assert "-DWB_PREFETCH_BLOCKS=0" in plain and "-DWB_DIVIDE_PLAIN=1" in plain
    assert "-mprfchw" in build_flags(parse_variant("pf32w", BASE)) and "-DWB_PREFETCH_HINT=2" in build_flags(
        parse_variant("pf32w", BASE))
    assert not any(f.startswith("-m") for f in build_flags(Variant(isa="generic")))
    # every build its own name in torch's cache
    names = {cpu_variants.extension_name(v) for v in candidates(BASE, ZEN4, "AVX512")}
    assert len(names) == len(candidates(BASE, ZEN4, "AVX512"))


def test_default_and_candidates_follow_the_cpu():
    assert default_variant("AVX512", ZEN4) == BASE
    assert default_variant("AVX512", ZEN4 - {"avx512vbmi"}) == Variant(bf16=True)
    assert default_variant("AVX2", ZEN4) == Variant(isa="avx2")
    assert default_variant("DEFAULT", ZEN4).isa == "generic"
    names = [v.name for v in candidates(BASE, ZEN4, "AVX512")]
    assert names[0] == BASE.name and len(names) == len(set(names)) == 10
    assert {"avx512+bf16-pf32nta-fma", "avx512-pf32nta-fma", "avx2-pf32nta-fma", "avx512+vbmi+bf16-pf0-fma",
            "avx512+vbmi+bf16-pf32w-fma", "avx512+vbmi+bf16-pf32nta-div"} <= set(names)
    assert not any("generic" in n for n in names)
    # an AVX2 CPU: no AVX512 build, no prefetchw without the flag
    small = [v.name for v in candidates(None, AVX2_ONLY, "AVX2")]
    assert small[0] == "avx2-pf32nta-fma" and not any("avx512" in n or "pf32w" in n for n in small)
    assert "lacks" in unusable_reason(BASE, AVX2_ONLY, "AVX2")
    assert "scalar" in unusable_reason(Variant(isa="generic"), ZEN4, "AVX512")
    assert "vector" in unusable_reason(BASE, ZEN4, "DEFAULT")
    assert unusable_reason(Variant(isa="generic"), ZEN4, "DEFAULT") is None


def _records(ratios: dict[str, list[float]], threads=(1, 2), formats=("bf16+8", "bf16+16")) -> list[dict]:
    """Fake measurements: ``ratios[variant]`` holds one ratio per (threads, format) cell."""
    cells = [(t, f) for t in threads for f in formats]
    return [{"variant": v, "threads": t, "format": f, "ratio": r}
            for v, rs in ratios.items() for (t, f), r in zip(cells, rs, strict=True)]


def test_the_choice_is_the_best_score_unless_within_the_margin_of_the_default():
    d, a, b = "avx512+vbmi+bf16-pf32nta-fma", "avx2-pf32nta-fma", "avx512+vbmi+bf16-pf0-fma"
    recs = _records({d: [1.0, 1.0, 1.0, 1.0], a: [1.2, 1.2, 0.9, 0.9], b: [1.01, 1.01, 1.02, 1.02]})
    s = scores(recs)
    assert s[d] == pytest.approx(1.0) and s[a] == pytest.approx((1.2 * 0.9) ** 0.5)
    assert choose(recs, d) == a  # 1.039 > 1.02
    assert choose(recs, d, margin=0.05) == d  # within 5%: keep the default
    assert choose(_records({d: [0.9] * 4, b: [0.91] * 4}), d) == d
    assert choose(_records({d: [0.5] * 4, b: [0.9] * 4}), d) == b
    # a variant missing a cell is not compared; the default unmeasured: the best
    partial = recs + [{"variant": "avx512-pf32nta-fma", "threads": 1, "format": "bf16+8", "ratio": 9.0}]
    assert "avx512-pf32nta-fma" not in scores(partial) and choose(partial, d) == a
    assert choose(_records({a: [1.0] * 4, b: [1.1] * 4}), d) == b
    assert choose([], d) == d
    with pytest.raises(ValueError, match="ratio"):
        scores([{"variant": d, "ratio": 0.0}])


def test_the_second_round_measures_the_default_the_best_and_each_knobs_winner_together():
    recs = _records({BASE.name: [1.0] * 4, "avx2-pf32nta-fma": [1.05] * 4,
                     "avx512+vbmi+bf16-pf0-fma": [1.1] * 4, "avx512+vbmi+bf16-pf32nta-div": [1.03] * 4,
                     "avx512+vbmi+bf16-pf16nta-fma": [0.95] * 4})
    names = [v.name for v in cpu_variants.finalists(recs, BASE)]
    assert names == [BASE.name, "avx512+vbmi+bf16-pf0-fma", "avx2-pf32nta-fma", "avx2-pf0-div"]


def _record(chosen: str, **extra) -> dict:
    return {"chosen": chosen, "cpu": cpu_variants.cpu_model(), "source_digest": cpu_variants.source_digest(),
            "torch": "2.13.0", "measured_at": "2025-01-01T00:00:00+00:00", **extra}


def test_the_choice_file_round_trips_and_is_keyed_by_cpu_and_sources(tmp_path):
    path = save_choice(_record("avx2-pf0-fma", scores={"avx2-pf0-fma": 1.1}), tmp_path / "choice.json")
    got = load_choice(path)
    assert got["chosen"] == "avx2-pf0-fma" and got["scores"] == {"avx2-pf0-fma": 1.1}
    assert load_choice(path, model="another CPU") is None  # measured on another CPU
    assert load_choice(path, digest="0" * 16) is None  # measured for other sources
    assert load_choice(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert load_choice(tmp_path / "bad.json") is None
    (tmp_path / "odd.json").write_text(json.dumps(_record("avx9")))
    assert load_choice(tmp_path / "odd.json") is None
    with pytest.raises(ValueError, match="chosen"):
        save_choice({"cpu": "x", "source_digest": "y"}, tmp_path / "x.json")
    with pytest.raises(ValueError, match="variant"):
        save_choice(_record("avx9"), tmp_path / "x.json")
    # the default path: in torch's extension cache, one file per (CPU model, sources)
    assert cpu_variants.choice_path(tmp_path, model="a", digest="d") != cpu_variants.choice_path(tmp_path, model="b",
                                                                                                digest="d")
    assert cpu_variants.choice_path(tmp_path).parent == tmp_path


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_VARIANT, raising=False)
    monkeypatch.delenv("WORKBENCH_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "_STATE", {"tried": False, "ok": False, "error": None, "variant": None,
                                               "source": None, "op": None})
    built = []
    monkeypatch.setattr(cpu_kernel, "load_variant", lambda v: built.append(cpu_kernel._variant_of(v).name) or
                        (lambda *a: None))
    return built


def test_available_loads_the_kept_choice_and_the_environment_overrides_it(monkeypatch, tmp_path):
    built = _fresh(monkeypatch, tmp_path)
    assert cpu_kernel.available() and cpu_kernel._STATE["source"] == "default"
    assert built == [default_variant().name]
    choice = "avx2-pf0-div"
    save_choice(_record(choice))  # beside the builds in $TORCH_EXTENSIONS_DIR
    assert (tmp_path / cpu_variants.choice_path().name).is_file()
    built = _fresh(monkeypatch, tmp_path)
    if unusable_reason(parse_variant(choice)):
        pytest.skip(f"this CPU cannot run {choice}")
    assert cpu_kernel.available() and built == [choice] and cpu_kernel.variant() == choice
    assert cpu_kernel._STATE["source"] == "measured"
    built = _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv(ENV_VARIANT, "avx2")
    assert cpu_kernel.available() and built == ["avx2-pf32nta-fma"] and cpu_kernel._STATE["source"] == "env"
    built = _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("WORKBENCH_CPU_KERNEL", "0")
    assert not cpu_kernel.available() and built == []


def test_a_tuning_run_measures_twice_chooses_and_keeps_its_choice(monkeypatch, tmp_path):
    """tune() with fake measurements: the first round's candidates, the second round's finalists, the choice from
    the second round, the record kept with every row and loaded back."""
    _fresh(monkeypatch, tmp_path)
    base = default_variant()
    first = candidates(base)
    fast = first[-1]  # the last candidate: fastest in both rounds
    rounds = []

    def fake_measure(variants, *, threads, numel, n_tensors, repeats, progress):
        variants = list(variants)
        rounds.append(([v.name for v in variants], threads, repeats))
        rows = [{"variant": v.name, "format": f, "threads": threads, "ratio": 1.2 if v == fast else 1.0,
                 "ratio_p25": 0.9, "ratio_p75": 1.3, "ratio_best": 1.0, "steps_per_s": 100.0,
                 "torch_steps_per_s": 100.0, "load_before": 0.5, "load_after": 0.7}
                for v in variants for f in ("bf16+8", "bf16+16")]
        return pd.DataFrame(rows).assign(cpu=cpu_variants.cpu_model())

    monkeypatch.setattr(tune_cpu_kernel, "measure_variants", fake_measure)
    broken = first[1]  # a build that fails is left out with a warning, the others measured

    def load(v):
        if v == broken:
            raise RuntimeError("no such flag")

    monkeypatch.setattr(cpu_kernel, "load_variant", load)
    used = []
    monkeypatch.setattr(cpu_kernel, "use_variant", lambda v: used.append(v))
    with pytest.warns(RuntimeWarning, match="left out"):
        df, record = tune_cpu_kernel.tune(threads=(1, 2), repeats=5)
    assert [r[1] for r in rounds] == [1, 2, 1, 2] and rounds[0][0] == [v.name for v in first if v != broken]
    assert rounds[2][0][:2] == [base.name, fast.name] and rounds[2][2] == 10  # finalists, twice the repeats
    assert record["chosen"] == fast.name and used == [fast.name]
    assert set(df["stage"]) == {1, 2} and len(record["records"]) == len(df)
    kept = load_choice()
    assert kept["chosen"] == fast.name and kept["default"] == base.name and kept["threads"] == [1, 2]
    assert kept["scores"][fast.name] == pytest.approx(1.2) and kept["torch"] and kept["measured_at"]
    tune_cpu_kernel.print_table(df, record)  # the printed table takes the record as kept

    # variants named: one round, the default kept where none is faster by the margin
    rounds.clear()
    fast = None
    _, record = tune_cpu_kernel.tune(threads=(1,), repeats=3, variants=[base.name, "pf16"], save=False)
    assert len(rounds) == 1 and record["chosen"] == base.name and "path" not in record
