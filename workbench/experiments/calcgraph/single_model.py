"""One model, heap-bound vs plain PyTorch: accuracy (Fig 9) and memory and time (Fig 10) of
"CalcGraph: taming the high costs of deep learning using models" (2022), Sections 4.2 and 4.3.

The heap-bound model is the same PyTorch model whose parameters, gradients and Adam state live in a
`Heap`'s contiguous zones; forward, backward and the optimizer step are PyTorch's own, so with the
same seed the two train bit-identically: Fig 9's "same initial values give the same curves" holds
here by construction (a check, not evidence). Fig 10 compares peak tensor memory and time per round.
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.calcgraph import CompiledGraph, Heap, make_optimizer
from workbench.measure import MemoryMeter

from .workload import paper_mlp, paper_mlp_plan

__all__ = ["FRAMEWORKS", "accuracy_curves", "max_accuracy_difference", "single_model_cost", "train_rounds"]

FRAMEWORKS = ("calcgraph heap", "pytorch")


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_rounds(data: dict, rounds: int, batch_size: int, *, graph: CompiledGraph | None = None, seed: int,
                 lr: float, evaluate: bool = True) -> tuple[list[dict], nn.Module]:
    """Train the paper's MLP for `rounds` rounds (one pass over the training set each); with a
    compiled `graph` (persistent gradients) bound to a `Heap`, else plain PyTorch. Rows per round:
    seconds (and train/test accuracy when `evaluate`)."""
    dev = data["x_train"].device
    torch.manual_seed(seed)
    model = paper_mlp().to(dev)
    opt = make_optimizer("adam", model.parameters(), lr=lr, device=dev)
    bound = Heap(graph, device=dev).bind(model, opt) if graph is not None else None
    x, y = data["x_train"], data["y_train"]
    rows = []
    for r in range(rounds):
        start = time.perf_counter()
        for i in range(0, len(x), batch_size):
            if bound is not None:
                bound.zero_grad()
            else:
                opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[i:i + batch_size]), y[i:i + batch_size]).backward()
            opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        row = {"round": r + 1, "seconds": time.perf_counter() - start}
        if evaluate:
            row.update(train_accuracy=_accuracy(model, x, y),
                       test_accuracy=_accuracy(model, data["x_test"], data["y_test"]))
        rows.append(row)
    return rows, model


def _heap_graph(lr: float, dev) -> CompiledGraph:
    return paper_mlp_plan(lr=lr, device=dev, persistent_grads=True)


def accuracy_curves(data: dict, *, rounds: int, batch_size: int, seed: int = 0, lr: float = 1e-2,
                    progress: bool = False) -> pd.DataFrame:
    """Fig 9: train/test accuracy per round, heap-bound (CalcGraph) vs plain PyTorch, same seed.

    `max_abs_weight_diff` compares the two trained models' parameters; `data`, `n_train` and
    `batch_size` say what was trained on."""
    frames, models = [], {}
    graph = _heap_graph(lr, data["x_train"].device)
    for framework in tqdm(FRAMEWORKS, disable=not progress, leave=False):
        rows, models[framework] = train_rounds(data, rounds, batch_size, seed=seed, lr=lr,
                                               graph=graph if framework != "pytorch" else None)
        frames.append(pd.DataFrame(rows).assign(framework=framework))
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(models["calcgraph heap"].parameters(),
                                                           models["pytorch"].parameters(), strict=True))
    return pd.concat(frames, ignore_index=True).assign(
        max_abs_weight_diff=diff, data=data["name"], n_train=len(data["x_train"]), batch_size=batch_size)


def max_accuracy_difference(accuracy: pd.DataFrame) -> float:
    """Largest |accuracy difference| (train or test, any round) between heap-bound and plain PyTorch."""
    wide = accuracy.pivot(index="round", columns="framework", values=["train_accuracy", "test_accuracy"])
    return float(max((wide[col]["calcgraph heap"] - wide[col]["pytorch"]).abs().max()
                     for col in ("train_accuracy", "test_accuracy")))


def single_model_cost(data: dict, *, rounds: int, batch_size: int, repeats: int = 3, seed: int = 0,
                      lr: float = 1e-2, progress: bool = False) -> pd.DataFrame:
    """Fig 10: peak memory (predicted before running, and measured over build + `rounds` rounds)
    and time per round, heap-bound vs plain PyTorch; the heap's zones vs PyTorch-managed bytes.

    The data set is resident before the measured region, so the prediction leaves the batch's
    own tensors out (`inputs=False`); both plans are compiled before the region.
    """
    dev = data["x_train"].device
    graphs = {"calcgraph heap": _heap_graph(lr, dev), "pytorch": paper_mlp_plan(lr=lr, device=dev)}
    rows = []
    for framework, graph in graphs.items():
        with MemoryMeter(dev) as meter:
            train_rounds(data, rounds, batch_size, graph=graph if framework != "pytorch" else None, seed=seed,
                         lr=lr, evaluate=False)
        rows.append({"framework": framework, "predicted_peak_bytes": graph.required_bytes(batch_size, inputs=False),
                     "measured_peak_bytes": meter.peak_bytes,
                     "persistent_bytes": graphs["calcgraph heap"].persistent_bytes()})
    # NOTE: per-round time is taken inside the training loop, so the heap variant's one-off
    # compile and bind (the paper's precompilation, excluded there too) is not in it.
    per_round = {f: [] for f in FRAMEWORKS}
    for _ in tqdm(range(repeats), disable=not progress, leave=False):
        for f, graph in graphs.items():
            rows_r, _ = train_rounds(data, rounds, batch_size, graph=graph if f != "pytorch" else None, seed=seed,
                                     lr=lr, evaluate=False)
            per_round[f] += [r["seconds"] for r in rows_r[1:] or rows_r]
    frame = pd.DataFrame(rows)
    frame["round_median_s"] = [statistics.median(per_round[f]) for f in frame["framework"]]
    frame["round_min_s"] = [min(per_round[f]) for f in frame["framework"]]
    frame["round_max_s"] = [max(per_round[f]) for f in frame["framework"]]
    frame["pytorch_managed_bytes"] = frame["measured_peak_bytes"] - frame["persistent_bytes"]
    frame["data"], frame["n_train"], frame["batch_size"], frame["rounds"] = (
        data["name"], len(data["x_train"]), batch_size, rounds)
    return frame
