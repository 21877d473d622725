"""Many models, one after another: model switching vs building each model anew (Fig 11 of
"CalcGraph: taming the high costs of deep learning using models", 2022, Sections 3.3 and 4.4).

The paper trains N models x R rounds (a round is one step over its 10,000 images) and reports the
total time of CalcGraph, which switches models in and out of one pre-allocated heap, against
TensorFlow and PyTorch. Here the switching variant re-initialises the heap-bound model in place
(`Heap.reinit`) and saves each trained model to host storage; the plain variant builds each model
and optimizer anew, as PyTorch code does. Same seeds, same trained weights. The paper measured on
its GPU (GTX 1060, a transfer to the GPU each round): speed verdicts are for a GPU run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.calcgraph import Heap, make_optimizer, train_many
from workbench.measure import format_bytes, time_interleaved

from .workload import paper_mlp, paper_mlp_plan

__all__ = ["explore_train_many", "multi_model_times", "switch_latency"]


def switch_latency(*, repeats: int = 20, progress: bool = False) -> pd.DataFrame:
    """One model switch (save + load, one copy per zone) vs building a fresh MLP and Adam
    (including Adam's state, created lazily by a first step in plain PyTorch)."""
    model = paper_mlp()
    opt = make_optimizer("adam", model.parameters())
    heap = Heap(paper_mlp_plan(lr=1e-3, persistent_grads=True)).bind(model, opt)
    other = heap.save()

    def switch():
        heap.save()
        heap.load(other)

    def fresh():
        m = paper_mlp()
        o = make_optimizer("adam", m.parameters())
        for p in m.parameters():  # Adam's state as its first step creates it
            o.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}

    times = time_interleaved({"switch (save + load)": switch, "build model + optimizer": fresh},
                             warmup=2, repeats=repeats, progress=progress)
    return pd.DataFrame([{"operation": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
                         for k, v in times.items()])


def _plain_many(data, n_models, rounds, batch_size, lr, seed):
    x, y = data["x_train"], data["y_train"]
    kept = []
    for i in range(n_models):
        torch.manual_seed(seed + i)
        model = paper_mlp().to(x.device)
        opt = make_optimizer("adam", model.parameters(), lr=lr, device=x.device)
        for _ in range(rounds):
            for s in range(0, len(x), batch_size):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[s:s + batch_size]), y[s:s + batch_size]).backward()
                opt.step()
        kept.append(model.state_dict())
    return kept


def _heap_many(data, n_models, rounds, batch_size, seed, heap, model, opt):
    x, y = data["x_train"], data["y_train"]
    kept = []
    for i in range(n_models):
        heap.reinit(seed + i)
        for _ in range(rounds):
            for s in range(0, len(x), batch_size):
                heap.zero_grad()
                F.cross_entropy(model(x[s:s + batch_size]), y[s:s + batch_size]).backward()
                opt.step()
        kept.append(heap.save())
    return kept


def multi_model_times(data: dict, *, n_models: Sequence[int], rounds: Sequence[int], batch_size: int,
                      max_steps: int = 10**9, repeats: int = 1, seed: int = 0, lr: float = 1e-2,
                      progress: bool = False) -> pd.DataFrame:
    """Fig 11: total seconds to train N models x R rounds (sequentially), model switching in one
    pre-allocated heap vs building each model and optimizer anew; paired per repeat.

    `speedup` is plain / switching (median of the paired ratios, min and max beside it). Cells with
    more than `max_steps` training steps per variant are skipped (`run` False)."""
    dev = data["x_train"].device
    model = paper_mlp().to(dev)
    opt = make_optimizer("adam", model.parameters(), lr=lr, device=dev)
    heap = Heap(paper_mlp_plan(lr=lr, device=dev, persistent_grads=True), device=dev).bind(model, opt)
    steps_per_round = -(-len(data["x_train"]) // batch_size)
    rows = []
    cells = [(n, r) for n in n_models for r in rounds]
    for n, r in tqdm(cells, desc="models x rounds", disable=not progress, leave=False):
        if n * r * steps_per_round > max_steps:
            rows.append({"models": n, "rounds": r, "complexity": n * r, "run": False})
            continue
        times = time_interleaved({
            "switching": lambda n=n, r=r: _heap_many(data, n, r, batch_size, seed, heap, model, opt),
            "plain": lambda n=n, r=r: _plain_many(data, n, r, batch_size, lr, seed),
        }, warmup=0, repeats=repeats, device=dev, rotate=True)
        ratios = [p / s for p, s in zip(times["plain"], times["switching"], strict=True)]
        rows.append({"models": n, "rounds": r, "complexity": n * r, "run": True,
                     "switching_s": statistics.median(times["switching"]), "plain_s": statistics.median(times["plain"]),
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)})
    frame = pd.DataFrame(rows)
    frame["n_train"], frame["batch_size"], frame["data"] = len(data["x_train"]), batch_size, data["name"]
    return frame


def explore_train_many(data: dict, *, n_models: int, rounds: int, budget_bytes: float, batch_size: int,
                       lr: float = 1e-2, seed: int = 0) -> tuple[str, pd.DataFrame | None]:
    """Train `n_models` MLPs for `rounds` rounds within `budget_bytes` with `train_many` (for the
    notebook's interactive explorer): a one-line summary and the loss per round and model."""
    try:
        res = train_many(paper_mlp, (data["x_train"], data["y_train"]), memory_budget=budget_bytes, rounds=rounds,
                         n_models=n_models, batch_size=batch_size, lr=lr, seed=seed, progress=True)
    except ValueError as err:
        return str(err), None
    text = f"{res.plan.models} models at once ({format_bytes(res.plan.bytes_needed)} planned), {res.seconds:.2f} s"
    return text, res.history.pivot(index="round", columns="model", values="loss")
