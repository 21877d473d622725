"""The bf16 twins the packed-bit notebook's memory sections run where fp16 is slow on a CPU (issue 48): which
format twins which, the plan from an injected probe, and the memory runs that label what ran and why."""

import pytest
import torch

from workbench.dtype_probe import Fp16Probe
from workbench.experiments.packed_bit_optimizers import (
    analytic_bytes_per_param,
    device_memory_by_format,
    memory_by_format,
    parse_format,
    step_timeline,
)
from workbench.experiments.packed_bit_optimizers.dtypes import bf16_twin, plan_formats, sections_note, uses_fp16
from workbench.models import MLP
from workbench.optim.formats import storage_bits


def _probe(ratio):
    bf16 = 1e-3
    return Fp16Probe.from_seconds({"conv3x3": {"fp32": bf16, "bf16": bf16, "fp16": ratio * bf16},
                                   "linear": {"fp32": bf16, "bf16": bf16, "fp16": bf16}}, cpu="Test CPU")


SLOW, FAST = _probe(200.0), _probe(1.0)


def _mlp():
    return MLP(sizes=(64, 64, 10), activation="relu")


def _batches(n=2, batch=2, width=64):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, width, generator=gen), torch.randint(10, (batch,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("name, twin", [
    ("fp16", "bf16"), ("fp16+8", "bf16+8"), ("fp16+13 SR", "bf16+13 SR"), ("amp", "amp bf16"),
    ("fp32", "fp32"), ("bf16", "bf16"), ("bf16+16", "bf16+16"),
])
def test_each_fp16_format_has_a_bf16_twin_with_its_bytes(name, twin):
    fmt = parse_format(name)
    got = bf16_twin(fmt)
    assert got.name == twin and uses_fp16(fmt) is (name != twin) and not uses_fp16(got)
    assert (got.extra_bits, got.stochastic_rounding) == (fmt.extra_bits, fmt.stochastic_rounding)
    if fmt.packed:
        assert storage_bits(got.extra_bits, got.stochastic_rounding) == storage_bits(fmt.extra_bits,
                                                                                     fmt.stochastic_rounding)
    for opt in ("sgd", "adamw"):
        for sib in (False, True):
            assert analytic_bytes_per_param(got, optimizer=opt, in_backward=sib) == analytic_bytes_per_param(
                fmt, optimizer=opt, in_backward=sib)
    if name == "amp":
        assert (got.param_dtype, got.autocast) == (torch.float32, torch.bfloat16)


def test_plan_runs_twins_only_where_fp16_is_slow_on_a_cpu_and_asked_to():
    fmts = [parse_format(n) for n in ("fp32", "amp", "fp16+8")]
    slow = plan_formats(fmts, device="cpu", fp16_on_slow_cpu="bf16", fp16_probe=SLOW)
    assert [(a.name, r.name) for a, r, _ in slow] == [("fp32", "fp32"), ("amp", "amp bf16"), ("fp16+8", "bf16+8")]
    assert slow[0][2] == "" and all(n.startswith("bf16 twin, same bytes: fp16 slow here (fp16 / bf16 time: conv3x3 "
                                                 "200x") for _, _, n in slow[1:])
    forced = plan_formats(fmts, device="cpu", fp16_on_slow_cpu="fp16", fp16_probe=SLOW)
    assert [r.name for _, r, _ in forced] == ["fp32", "amp", "fp16+8"] and "fp16_on_slow_cpu='fp16'" in forced[2][2]
    fast = plan_formats(fmts, device="cpu", fp16_on_slow_cpu="bf16", fp16_probe=FAST)
    assert [r.name for _, r, _ in fast] == ["fp32", "amp", "fp16+8"] and fast[2][2].startswith("fp16: fast here")
    cuda = plan_formats(fmts, device="cuda", fp16_on_slow_cpu="bf16", fp16_probe=SLOW)  # CUDA: fp16 always
    assert [(r.name, n) for _, r, n in cuda] == [("fp32", ""), ("amp", ""), ("fp16+8", "")]
    with pytest.raises(ValueError, match=r"fp16_on_slow_cpu='fp8': allowed \['bf16', 'fp16'\]"):
        plan_formats(fmts, device="cpu", fp16_on_slow_cpu="fp8")


def test_plan_probes_only_where_the_choice_matters(monkeypatch):
    import workbench.experiments.packed_bit_optimizers.dtypes as dtypes

    probed = []
    monkeypatch.setattr(dtypes, "probe_fp16", lambda device: probed.append(device) or SLOW)
    fmts = [parse_format("fp16")]
    assert plan_formats(fmts, device="cpu")[0][2] == "" and not probed  # the library's default: fp16, unprobed
    assert plan_formats([parse_format("bf16+8")], device="cpu", fp16_on_slow_cpu="bf16")[0][2] == "" and not probed
    assert plan_formats(fmts, device="cpu", fp16_on_slow_cpu="bf16")[0][1].name == "bf16"
    assert probed == [torch.device("cpu")]


def test_memory_runs_the_twin_and_says_so_where_told_fp16_is_slow():
    formats = ["amp", "fp16", "fp16+8", "bf16+8"]
    twin = memory_by_format(_mlp, _batches(), formats=formats, fp16_on_slow_cpu="bf16", fp16_probe=SLOW,
                            progress=False)
    assert list(twin["format"]) == [f for f in formats for _ in (0, 1)]  # the paper's names, in order
    assert list(twin["ran_as"]) == [r for r in ("amp bf16", "bf16", "bf16+8", "bf16+8") for _ in (0, 1)]
    assert twin["dtype_note"].str.startswith("bf16 twin").tolist() == [True] * 6 + [False] * 2
    assert twin["ratio_vs_amp"].iloc[0] == 1.0  # the 'amp' row is still AMP's baseline
    # the twin measures what bf16+8 measures, row for row
    ours = twin[twin["format"] == "fp16+8"]["peak_bytes"].tolist()
    assert ours == twin[twin["format"] == "bf16+8"]["peak_bytes"].tolist()
    asked = memory_by_format(_mlp, _batches(), formats=formats, fp16_on_slow_cpu="bf16", fp16_probe=FAST,
                             progress=False)
    assert (asked["ran_as"] == asked["format"]).all() and asked["dtype_note"].iloc[0].startswith("fp16: fast here")
    # same bytes: plain fp16 and AMP peak as their twins (the packed step's chunk temporaries differ); the
    # process's first run with the step in backward holds 4 B more, whichever dtype it runs
    for name in ("amp", "fp16"):
        pairs = zip(asked[asked["format"] == name]["peak_bytes"], twin[twin["format"] == name]["peak_bytes"],
                    strict=True)
        assert all(abs(a - b) <= 4 for a, b in pairs)


def test_the_device_table_and_the_timeline_pass_the_choice_on():
    df = device_memory_by_format(_mlp, _batches(), formats=["fp32", "fp16+8"], in_backward=[True],
                                 fp16_on_slow_cpu="bf16", fp16_probe=SLOW, progress=False)
    assert list(zip(df["format"], df["ran_as"], strict=True)) == [("fp32", "fp32"), ("fp16+8", "bf16+8")]
    tl = step_timeline(_mlp, _batches(), formats=[("amp", False), ("fp16+8", True)], fp16_on_slow_cpu="bf16",
                       fp16_probe=SLOW)
    blocks = tl.drop_duplicates(["format", "ran_as"])
    assert list(zip(blocks["format"], blocks["ran_as"], strict=True)) == [("amp", "amp bf16"), ("fp16+8", "bf16+8")]


def test_the_notebook_says_which_sections_run_fp16():
    assert sections_note(FAST, "bf16") == "fp16 is fast here: every section runs the paper's fp16 formats."
    twins = sections_note(SLOW, "bf16")
    assert twins.startswith("fp16 is slow here: Fig 2 and Table 3 memory run each fp16 format's bf16 twin")
    assert "accuracy, the training-step times and the side-by-side table keep fp16" in twins and "200x" in twins
    assert "every section runs fp16 (fp16 takes conv3x3 200x, linear 1.0x" in sections_note(SLOW, "fp16")
    with pytest.raises(ValueError, match="allowed"):
        sections_note(SLOW, "bf")
