"""Exploration probes of modules other helpers own (`optim`, `calcgraph`, `advisor`, `vbs`), family `library`,
names marked `[owner]`: run late, against each helper's branch, and reported (see explore.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from explore import cases, cli, cli_refusal, probe, refusal, works

NAN = math.nan


def _linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


OPTIM_BAD = {
    "lr nan": ({"lr": NAN}, "nan"), "lr -1": ({"lr": -1.0}, "-1"), "lr '1e-3'": ({"lr": "1e-3"}, "'1e-3'"),
    "betas of one": ({"betas": (0.9,)}, "(0.9,)"), "beta 1.5": ({"betas": (1.5, 0.999)}, "1.5"),
    "eps -1": ({"eps": -1.0}, "-1"), "weight_decay nan": ({"weight_decay": NAN}, "nan"),
}


@cases("library", "[optim] PackedAdamW refuses", OPTIM_BAD)
def optim_bad(sb, case):
    from workbench.optim import PackedAdamW

    kwargs, needle = case
    return refusal(lambda: PackedAdamW(_linear().to(torch.bfloat16).parameters(), extra_bits=8, **kwargs), needle)


@probe("library", "[optim] PackedAdamW on channels_last bf16 parameters", timeout=180)
def optim_channels_last(sb):
    from workbench.optim import PackedAdamW

    conv = nn.Conv2d(4, 4, 3).to(torch.bfloat16).to(memory_format=torch.channels_last)

    def step():
        opt = PackedAdamW(conv.parameters(), lr=1e-3, extra_bits=8)
        conv(torch.randn(1, 4, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)).sum().backward()
        opt.step()
        return True
    return works(step)


@probe("library", "[optim] step_in_backward updates a parameter unfrozen later", timeout=180)
def optim_unfrozen(sb):
    from workbench.optim import PackedAdamW, step_in_backward

    model = _linear().to(torch.bfloat16)
    model[0].weight.requires_grad_(False)
    opt = PackedAdamW(model.parameters(), lr=0.1, extra_bits=8)
    handle = step_in_backward(model, opt)
    model[0].weight.requires_grad_(True)
    before = model[0].weight.detach().clone()

    def run():
        model(torch.randn(3, 4, dtype=torch.bfloat16)).sum().backward()
        return not torch.equal(before, model[0].weight.detach())

    result = refusal(run, "requires_grad", types=(ValueError, RuntimeError))
    handle.remove() if hasattr(handle, "remove") else None
    if result[0] == "nonsense" and "returned True" in result[1]:
        return "ok", "updated"
    return result


@cases("library", "[optim] load_state_dict with a bad sr_seed", {"1.5": 1.5, "'a'": "a", "-1": -1})
def optim_sr_seed(sb, seed):
    from workbench.optim import PackedAdamW

    opt = PackedAdamW(_linear().to(torch.bfloat16).parameters(), lr=1e-3, extra_bits=7, stochastic_rounding=True,
                      seed=3)
    state = opt.state_dict()
    state.setdefault("sr_seed", None)
    state["sr_seed"] = seed
    before = {k: str(v) for k, v in opt.state_dict().items()}
    outcome = refusal(lambda: opt.load_state_dict(state), repr(seed))
    if outcome[0] == "refused" and {k: str(v) for k, v in opt.state_dict().items()} != before:
        return "nonsense", "refused after replacing part of the state"
    return outcome


CALCGRAPH_BAD = {"calibrate 'no'": ({"calibrate": "no"}, "'no'"),
                 "input_dtype int64 for a Linear": ({"input_dtype": torch.int64}, "int64"),
                 "lr nan": ({"lr": NAN}, "nan"), "device tpu": ({"device": "tpu"}, "'tpu'")}


@cases("library", "[calcgraph] plan_training refuses", CALCGRAPH_BAD, timeout=60)
def calcgraph_bad(sb, case):
    from workbench.calcgraph import plan_training

    kwargs, needle = case
    kwargs = {"calibrate": False, **kwargs}
    return refusal(lambda: plan_training(_linear, [4], **kwargs), needle)


ADVISE = {"factory raises SystemExit(0)": ("exit0", "SystemExit"), "factory returns None": ("none", "None"),
          "factory raises KeyError": ("keyerror", "KeyError")}


@cases("library", "[advisor] workbench advise with a factory that", ADVISE, timeout=60)
def advise(sb, case):
    kind, needle = case
    module = sb.root / "probe_factories.py"
    module.write_text("import torch\n"
                      "def exit0():\n    raise SystemExit(0)\n"
                      "def none():\n    return None\n"
                      "def keyerror():\n    raise KeyError('x')\n")
    import sys
    sys.path.insert(0, str(sb.root))
    return cli_refusal(cli(["advise", f"probe_factories:{kind}", "--batch", "2x4", "--budget", "1GB"]), needle)


VBS_BAD = {"memory nan": ({"memory": NAN, "batch": 4}, "nan"), "memory -1": ({"memory": -1, "batch": 4}, "-1"),
           "batch 0": ({"memory": 10**7, "batch": 0}, "0"), "batch 2.5": ({"memory": 10**7, "batch": 2.5}, "2.5")}


@cases("library", "[vbs] plan refuses", VBS_BAD, timeout=60)
def vbs_bad(sb, case):
    from workbench import vbs

    kwargs, needle = case
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    layers = vbs.measure_layers(cnn, torch.randn(1, 4, 4), 4, repeats=1, min_run_time=0.0)
    return refusal(lambda: vbs.plan(layers, **kwargs), needle)
