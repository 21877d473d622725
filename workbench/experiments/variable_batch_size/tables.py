"""The per-layer tables of the paper's four networks (Figs 1 and 2 of Choudhury et al.).

"Variable batch size across layers for efficient prediction on CNNs", Section II: Fig 1 is the
per-image time of ResNet-50 against the batch size, Fig 2 the memory each layer needs at batch 1
(input + output activation + working space, "from 1.07MB to 10.7MB"). Both come from the tables
`workbench.vbs.measure_layers` measures (Table I: time, in, out, ws per layer and batch size);
`layer_kinds` says what each layer group is (its first operation: Conv2d, MaxPool2d, Linear, ...),
so that Fig 2's rows can be read at the layers the paper names (conv1, res2a_branch2a: the first
1x1 convolution of the first bottleneck, `layer1_0.body` here) and over its convolution layers.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench import vbs
from workbench.devices import seed_everything
from workbench.models import build

__all__ = ["NETWORKS", "LABELS", "PAPER_IMAGE_SIZE", "build_network", "measure_networks", "time_vs_batch",
           "layer_kinds", "layer_memory", "tables_frame"]

NETWORKS = ("googlenet", "resnet50", "squeezenet1_0", "mobilenet_v1")
LABELS = {"googlenet": "GoogLeNet", "resnet50": "ResNet-50", "squeezenet1_0": "SqueezeNet-v1.0",
          "mobilenet_v1": "MobileNet-v1"}
PAPER_IMAGE_SIZE = 224  # Section IV: ImageNet networks at 3x224x224


def build_network(name: str, *, width: float = 1.0) -> nn.Module:
    """One of NETWORKS as the paper ran it: ImageNet stem, 1000 classes, eval mode (`width` is a
    channel multiplier; 224x224 inputs work, smaller ones too)."""
    if name not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}, got {name!r}")
    return build(name, width=width, num_classes=1000, stem="imagenet").eval()


def measure_networks(
    names, *, image_size: int, width: float, max_batch: int, repeats: int = 3, statistic: str = "median",
    device: torch.device | str = "cpu", seed: int = 0, progress: bool = False,
) -> tuple[dict[str, nn.Module], dict[str, vbs.LayerProfile]]:
    """Build each network and measure its per-layer tables (bytes) at batch sizes 1..max_batch."""
    if image_size < 16 or max_batch < 1:
        raise ValueError(f"image_size must be >= 16 and max_batch >= 1, got {image_size}, {max_batch}")
    models, tables = {}, {}
    for name in tqdm(list(names), desc="measuring networks", disable=not progress):
        seed_everything(seed)
        models[name] = build_network(name, width=width).to(device)
        sample = torch.randn(3, image_size, image_size, device=device)
        tables[name] = vbs.measure_layers(models[name], sample, max_batch, repeats=repeats, statistic=statistic,
                                          device=device)
    return models, tables


def time_vs_batch(tables: dict[str, vbs.LayerProfile]) -> pd.DataFrame:
    """Fig 1: per-image time of the whole network with every layer at batch b (sum of the tables)."""
    rows = []
    for name, t in tables.items():
        total = t.uniform_time()
        rows += [{"network": name, "batch": b + 1, "time_per_image_s": float(total[b]),
                  "relative_to_batch_1": float(total[b] / total[0])} for b in range(t.max_batch)]
    return pd.DataFrame(rows)


def _kind(module: nn.Module) -> str:
    while isinstance(module, nn.Sequential) and len(module):
        module = module[0]
    return type(module).__name__


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """What each layer group of `model` is, by stage and branch-layer name: its first module's class
    ("Conv2d", "MaxPool2d", "Linear", ...; "GraphModule" for a region run as traced, "" for a group)."""
    kinds = {}
    for stage in vbs.stages_of(model):
        kinds[stage.name] = "" if stage.is_branch else _kind(stage.module)
        for branch in stage.branches:
            kinds.update({name: _kind(layer) for name, layer in branch})
    return kinds


def layer_memory(tables: vbs.LayerProfile, *, network: str = "", batch: int = 1,
                 kinds: dict[str, str] | None = None) -> pd.DataFrame:
    """Fig 2: memory to process each layer group at `batch`, input + output + workspace (bytes),
    with each group's `kind` (`layer_kinds`) where `kinds` is given.

    Layers inside a branch group (a special layer) are rows of their own, as in the paper's
    figure (e.g. "res2a_branch2a"): the first layer of a branch reads the group's input, so its
    `in` is that input's size (the tables hold 0 there, the input being reserved by the group).
    """
    if not 1 <= batch <= tables.max_batch:
        raise ValueError(f"batch must be in 1..{tables.max_batch}, got {batch}")
    b, unit, rows = batch - 1, tables.unit_bytes, []

    def row(name: str, inp: int, out: int, ws: int, group: str) -> dict:
        return {"network": network, "name": name, "group": group, "in_bytes": inp * unit, "out_bytes": out * unit,
                "ws_bytes": ws * unit, "total_bytes": (inp + out + ws) * unit}

    for i, name in enumerate(tables.names):
        if not tables.is_special(i):
            rows.append(row(name, int(tables.inp[i, b]), int(tables.out[i, b]), int(tables.ws[i, b]), ""))
            continue
        for part in tables.branches[i]:
            for k, sub in enumerate(part.names):
                inp = int(tables.inp[i, b]) if k == 0 else int(part.inp[k, b])
                rows.append(row(sub, inp, int(part.out[k, b]), int(part.ws[k, b]), name))
    frame = pd.DataFrame(rows)
    frame.insert(1, "layer", range(len(frame)))
    if kinds is not None:
        frame.insert(3, "kind", frame.name.map(kinds).fillna(""))
    return frame


def tables_frame(tables: dict[str, vbs.LayerProfile]) -> pd.DataFrame:
    """The main-path tables of every network, one row per (network, layer, batch)."""
    return pd.concat([t.to_frame().assign(network=name) for name, t in tables.items()], ignore_index=True)
