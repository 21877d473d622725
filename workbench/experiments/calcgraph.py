"""Experiments for the CalcGraph notebook ("CalcGraph: taming the high costs of deep learning
using models", 2022).

Each function measures on the chosen device and returns a pandas DataFrame; plot functions
are pure (`plot_x(df) -> Figure`). What is reproduced:

- Section 3.2: a training step's peak memory predicted before it runs, against
  `MemoryMeter`'s measured peak (`prediction_error`), and the largest batch for a budget with
  zero trial runs against trial-based finders run for real under a budget guard
  (`max_batch_peers`: accelerate, Lightning power/binsearch, a trial bisection).
- Fig 9: accuracy over rounds, heap-bound training vs plain PyTorch, same seed
  (`accuracy_curves`).
- Fig 10: memory and time per round of a single model (`single_model_cost`).
- Fig 11: total time for N models x R rounds, model switching vs building each model anew
  (`multi_model_times`), and one switch against one fresh build (`switch_latency`).
- Fig 12: models that fit in parallel in a budget, planned vs found by trials
  (`parallel_models`).
"""

from __future__ import annotations

import copy
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.calcgraph import BudgetGuard, Heap, compile, make_optimizer, training_program
from workbench.calcgraph.many import StackedGroup, max_parallel_models
from workbench.data import load_digits, load_mnist, normalize, synthetic_images
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models import MLP, resnet18

__all__ = [
    "MODELS", "PEERS", "small_cnn", "load_data", "prediction_error", "accuracy_curves", "single_model_cost",
    "switch_latency", "multi_model_times", "parallel_models", "max_batch_peers", "plot_prediction_error",
    "plot_accuracy", "plot_single_model", "plot_multi_model", "plot_parallel", "plot_peers",
]


def small_cnn() -> nn.Sequential:
    """A CNN with pooling for 1x28x28 inputs: two conv-ReLU-maxpool stages and a classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


# name -> (factory, per-example input shape); ResNet-18 takes (width, image size) from the caller
MODELS: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...]]] = {
    "mlp": (lambda: MLP((784, 64, 64, 10), "sigmoid"), (1, 28, 28)),
    "cnn": (small_cnn, (1, 28, 28)),
}


def _model(name: str, *, resnet_width: int = 64, image_size: int = 32) -> tuple[Callable[[], nn.Module], tuple]:
    if name == "resnet18":
        return (lambda: resnet18(10, width=resnet_width)), (3, image_size, image_size)
    if name not in MODELS:
        raise ValueError(f"model must be one of {[*MODELS, 'resnet18']}, got {name!r}")
    return MODELS[name]


def load_data(n_train: int, n_test: int, *, source: str = "auto", seed: int = 0, device=None) -> dict:
    """MNIST-shaped (1x28x28) float data in [-1, 1]: real MNIST from `data/` when present
    (`auto`/`mnist`), else the real 8x8 digits upscaled (`digits`, at most 1797 images) or a
    seeded synthetic MNIST-shaped set (`synthetic`; `auto` picks it past 1797 images)."""
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train and n_test must be >= 1, got {n_train}, {n_test}")
    if source not in ("auto", "mnist", "digits", "synthetic"):
        raise ValueError(f"source must be auto, mnist, digits or synthetic, got {source!r}")
    train = test = None
    if source in ("auto", "mnist"):
        try:
            train, test = load_mnist()
            train, test = train.subset(min(n_train, len(train))), test.subset(min(n_test, len(test)))
        except (FileNotFoundError, OSError, ValueError):
            if source == "mnist":
                raise
    if train is None and (source == "digits" or (source == "auto" and n_train + n_test <= 1797)):
        full = load_digits(28)
        if n_train + n_test > len(full):
            raise ValueError(f"digits has {len(full)} images; asked for {n_train} + {n_test}")
        train, test = full.split(n_test / len(full), seed=seed)
        train = train.subset(min(n_train, len(train)))
    if train is None:
        full = synthetic_images(n_train + n_test, (1, 28, 28), 10, seed=seed)
        train, test = full.subset(n_train), _tail(full, n_test)
    dev = torch.device(device or "cpu")
    return {"x_train": normalize(train.images).to(dev), "y_train": train.labels.to(dev),
            "x_test": normalize(test.images).to(dev), "y_test": test.labels.to(dev), "name": train.name}


def _tail(imageset, n):
    from workbench.data import ImageSet

    return ImageSet(imageset.images[-n:], imageset.labels[-n:], imageset.num_classes, imageset.name)


# ---------------------------------------------------------------------------------------------
# Section 3.2: prediction against measurement


def prediction_error(
    models: Sequence[str], batch_sizes: Sequence[int], *, resnet_width: int = 64, image_size: int = 32,
    resnet_batch_sizes: Sequence[int] | None = None, device=None, progress: bool = False,
) -> pd.DataFrame:
    """Predicted (plan, fake tensors) vs measured (`MemoryMeter`, real run) peak bytes of the
    same program: build model and Adam, two training steps."""
    dev = torch.device(device or "cpu")
    rows = []
    for name in models:
        build, shape = _model(name, resnet_width=resnet_width, image_size=image_size)
        start = time.perf_counter()
        graph = compile(build, shape, device=dev)
        compile_s = time.perf_counter() - start
        sizes = resnet_batch_sizes if (name == "resnet18" and resnet_batch_sizes) else batch_sizes
        for b in tqdm(sizes, desc=name, disable=not progress, leave=False):
            predicted = graph.required_bytes(b)
            torch.manual_seed(0)
            start = time.perf_counter()
            measured = _measured(build, shape, b, dev)
            rows.append({"model": name, "batch_size": b, "predicted_bytes": predicted, "measured_bytes": measured,
                         "error": (predicted - measured) / measured, "affine": graph.affine,
                         "compile_s": compile_s, "measure_s": time.perf_counter() - start})
    return pd.DataFrame(rows)


def _measured(build, shape, batch_size, dev) -> int:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    with MemoryMeter(dev) as meter:
        training_program(build, shape, batch_size, device=dev)
    return meter.peak_bytes


# ---------------------------------------------------------------------------------------------
# Fig 9 and Fig 10: one model, heap-bound vs plain PyTorch


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _heap_graph(lr: float, dev):
    return compile(MODELS["mlp"][0], (1, 28, 28), lr=lr, device=dev, persistent_grads=True)


def _train(data: dict, rounds: int, batch_size: int, *, graph=None, seed: int, lr: float,
           evaluate: bool = True) -> tuple[list[dict], nn.Module]:
    """Train the paper's MLP for `rounds` rounds (one pass over the training set each); with a
    compiled `graph` (persistent gradients) bound to a `Heap`, else plain PyTorch."""
    dev = data["x_train"].device
    torch.manual_seed(seed)
    model = MODELS["mlp"][0]().to(dev)
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


def accuracy_curves(data: dict, *, rounds: int, batch_size: int, seed: int = 0, lr: float = 1e-2,
                    progress: bool = False) -> pd.DataFrame:
    """Fig 9: train/test accuracy per round, heap-bound (CalcGraph) vs plain PyTorch, same seed.
    `max_abs_weight_diff` (last rows) compares the two trained models' parameters."""
    frames, models = [], {}
    graph = _heap_graph(lr, data["x_train"].device)
    for framework in tqdm(("calcgraph heap", "pytorch"), disable=not progress, leave=False):
        rows, models[framework] = _train(data, rounds, batch_size, graph=graph if framework != "pytorch" else None,
                                         seed=seed, lr=lr)
        frames.append(pd.DataFrame(rows).assign(framework=framework))
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(models["calcgraph heap"].parameters(),
                                                           models["pytorch"].parameters(), strict=True))
    return pd.concat(frames, ignore_index=True).assign(max_abs_weight_diff=diff)


def single_model_cost(data: dict, *, rounds: int, batch_size: int, repeats: int = 3, seed: int = 0,
                      lr: float = 1e-2, progress: bool = False) -> pd.DataFrame:
    """Fig 10: peak memory (predicted before running, and measured over build + `rounds` rounds)
    and time per round, heap-bound vs plain PyTorch; the heap's zones vs PyTorch-managed bytes.

    The data set is resident before the measured region, so the prediction leaves the batch's
    own tensors out (`inputs=False`); both plans are compiled before the region.
    """
    dev = data["x_train"].device
    graphs = {"calcgraph heap": _heap_graph(lr, dev),
              "pytorch": compile(MODELS["mlp"][0], (1, 28, 28), lr=lr, device=dev)}
    rows = []
    for framework, graph in graphs.items():
        with MemoryMeter(dev) as meter:
            _train(data, rounds, batch_size, graph=graph if framework != "pytorch" else None, seed=seed, lr=lr,
                   evaluate=False)
        rows.append({"framework": framework, "predicted_peak_bytes": graph.required_bytes(batch_size, inputs=False),
                     "measured_peak_bytes": meter.peak_bytes,
                     "persistent_bytes": graphs["calcgraph heap"].persistent_bytes()})
    # NOTE: per-round time is taken inside the training loop, so the heap variant's one-off
    # compile and bind (the paper's precompilation, excluded there too) is not in it.
    per_round = {"calcgraph heap": [], "pytorch": []}
    for _ in tqdm(range(repeats), disable=not progress, leave=False):
        for f, graph in graphs.items():
            rows_r, _ = _train(data, rounds, batch_size, graph=graph if f != "pytorch" else None, seed=seed, lr=lr,
                               evaluate=False)
            per_round[f] += [r["seconds"] for r in rows_r[1:] or rows_r]
    frame = pd.DataFrame(rows)
    frame["round_median_s"] = [statistics.median(per_round[f]) for f in frame["framework"]]
    frame["round_min_s"] = [min(per_round[f]) for f in frame["framework"]]
    frame["round_max_s"] = [max(per_round[f]) for f in frame["framework"]]
    frame["pytorch_managed_bytes"] = frame["measured_peak_bytes"] - frame["persistent_bytes"]
    return frame


# ---------------------------------------------------------------------------------------------
# Fig 11: many models, switching vs building anew


def switch_latency(*, repeats: int = 20, progress: bool = False) -> pd.DataFrame:
    """One model switch (save + load, one copy per zone) vs building a fresh MLP and Adam
    (including Adam's state, created lazily by a first step in plain PyTorch)."""
    build = MODELS["mlp"][0]
    model = build()
    opt = make_optimizer("adam", model.parameters())
    heap = Heap(compile(build, (1, 28, 28), persistent_grads=True)).bind(model, opt)
    other = heap.save()

    def switch():
        heap.save()
        heap.load(other)

    def fresh():
        m = build()
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
    build = MODELS["mlp"][0]
    kept = []
    for i in range(n_models):
        torch.manual_seed(seed + i)
        model = build().to(x.device)
        opt = make_optimizer("adam", model.parameters(), lr=lr, device=x.device)
        for _ in range(rounds):
            for s in range(0, len(x), batch_size):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[s:s + batch_size]), y[s:s + batch_size]).backward()
                opt.step()
        kept.append(model.state_dict())
    return kept


def _heap_many(data, n_models, rounds, batch_size, lr, seed, heap, model, opt):
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
    pre-allocated heap vs building each model and optimizer anew; paired per repeat. Cells with
    more than `max_steps` training steps per variant are skipped (recorded as not run)."""
    dev = data["x_train"].device
    build = MODELS["mlp"][0]
    model = build().to(dev)
    opt = make_optimizer("adam", model.parameters(), lr=lr, device=dev)
    heap = Heap(compile(build, (1, 28, 28), lr=lr, device=dev, persistent_grads=True), device=dev).bind(model, opt)
    steps_per_round = -(-len(data["x_train"]) // batch_size)
    rows = []
    cells = [(n, r) for n in n_models for r in rounds]
    for n, r in tqdm(cells, desc="models x rounds", disable=not progress, leave=False):
        if n * r * steps_per_round > max_steps:
            rows.append({"models": n, "rounds": r, "complexity": n * r, "run": False})
            continue
        times = time_interleaved({
            "switching": lambda n=n, r=r: _heap_many(data, n, r, batch_size, lr, seed, heap, model, opt),
            "plain": lambda n=n, r=r: _plain_many(data, n, r, batch_size, lr, seed),
        }, warmup=0, repeats=repeats, device=dev, rotate=True)
        ratios = [p / s for p, s in zip(times["plain"], times["switching"], strict=True)]
        rows.append({"models": n, "rounds": r, "complexity": n * r, "run": True,
                     "switching_s": statistics.median(times["switching"]), "plain_s": statistics.median(times["plain"]),
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Fig 12: models in parallel


def _group_program(template, k, batch_size, mode, lr):
    """Real k-model training (two steps, all built inside) for the trial-based search."""
    x = torch.randn(batch_size, 1, 28, 28)
    y = torch.zeros(batch_size, dtype=torch.long)
    if mode == "vmap":
        group = StackedGroup(template, k, lr=lr)
        for _ in range(2):
            group.step(x, y)
        return
    slots = []
    for _ in range(k):
        m = copy.deepcopy(template)
        o = make_optimizer("adam", m.parameters(), lr=lr)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        slots.append((m, o))
    for _ in range(2):
        for m, o in slots:
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=False)


def _fits(program: Callable[[], None], budget: float) -> bool:
    guard = BudgetGuard(budget)
    try:
        with guard:
            program()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        guard.close()
        gc.collect()


def parallel_models(budgets: Sequence[float], *, batch_size: int, modes: Sequence[str] = ("loop", "vmap"),
                    lr: float = 1e-2, max_trials: int = 200, progress: bool = False) -> pd.DataFrame:
    """Fig 12: models of the paper's MLP that fit in a budget at once: planned by CalcGraph
    (zero trials) vs found by trials (k = 1, 2, ... until the budget guard raises)."""
    template = MODELS["mlp"][0]()
    rows = []
    for mode in modes:
        graph = None
        for budget in tqdm(budgets, desc=mode, disable=not progress, leave=False):
            start = time.perf_counter()
            plan = max_parallel_models(template, (1, 28, 28), budget, batch_size=batch_size, mode=mode, lr=lr,
                                       graph=graph)
            plan_s = time.perf_counter() - start
            graph = plan.graph
            start, k, trials = time.perf_counter(), 0, 0
            while trials < max_trials:
                trials += 1
                if not _fits(lambda k=k, mode=mode: _group_program(template, k + 1, batch_size, mode, lr), budget):
                    break
                k += 1
            rows.append({"mode": mode, "budget_bytes": budget, "planned_models": plan.models,
                         "plan_evaluations": plan.evaluations, "plan_s": plan_s, "trial_models": k,
                         "trials": trials, "trial_s": time.perf_counter() - start})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Beyond the paper: max batch for a budget, CalcGraph vs trial-based peers


def _peer_row(method, answer, trials, seconds, note=""):
    return {"method": method, "max_batch": answer, "trials": trials, "seconds": seconds, "note": note}


PEERS = ("accelerate", "lightning-power", "lightning-binsearch")


def max_batch_peers(model: str, budget_bytes: float, *, start_batch: int = 4096, margin: float = 0.0,
                    peers: Sequence[str] = PEERS, resnet_width: int = 64, image_size: int = 32,
                    progress: bool = False) -> pd.DataFrame:
    """Largest batch of one training program within `budget_bytes`: CalcGraph (plan only), a
    trial bisection under the budget guard (ground truth), accelerate's
    `find_executable_batch_size`, Lightning's `Tuner.scale_batch_size` (power, binsearch).
    A peer that is not installed is a row saying so; `peers` picks which of `PEERS` run."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"peers must be among {PEERS}, got {sorted(unknown)}")
    build, shape = _model(model, resnet_width=resnet_width, image_size=image_size)
    cap = budget_bytes * (1 - margin)
    rows = []
    start = time.perf_counter()
    graph = compile(build, shape)
    answer = graph.max_batch_size(budget_bytes, margin=margin)
    rows.append(_peer_row("calcgraph (plan)", answer, 0, time.perf_counter() - start,
                          f"{graph.last_search_evaluations} plan evaluations, compile included"))

    def runs(b: int) -> bool:
        torch.manual_seed(0)
        return _fits(lambda: training_program(build, shape, b), cap)

    steps = tqdm(total=1 + len(peers), desc="peers", disable=not progress, leave=False)
    trials = 0

    def counted(b: int) -> bool:
        nonlocal trials
        trials += 1
        return runs(b)

    from workbench.calcgraph import search_max

    start = time.perf_counter()
    truth, _ = search_max(counted, start_batch)
    rows.append(_peer_row("trial bisection (guard)", truth, trials, time.perf_counter() - start,
                          "doubling then bisection, each trial a real run"))
    steps.update()
    if "accelerate" in peers:
        rows.append(_accelerate(build, shape, cap, start_batch))
        steps.update()
    for mode in ("power", "binsearch"):
        if f"lightning-{mode}" in peers:
            rows.append(_lightning(build, shape, cap, mode, max_val=start_batch * 4))
            steps.update()
    steps.close()
    frame = pd.DataFrame(rows)
    frame["agrees_with_truth"] = frame["max_batch"] == truth
    frame["ratio_to_truth"] = frame["max_batch"] / truth if truth else np.nan
    return frame


def _accelerate(build, shape, cap, start_batch) -> dict:
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return _peer_row("accelerate find_executable_batch_size", None, None, None, "not installed")
    tried = []

    @find_executable_batch_size(starting_batch_size=start_batch)
    def run(batch_size):
        tried.append(batch_size)
        guard = BudgetGuard(cap)
        try:
            with guard:
                training_program(build, shape, batch_size)
        finally:
            guard.close()
        return batch_size

    start = time.perf_counter()
    answer = run()
    return _peer_row("accelerate find_executable_batch_size", answer, len(tried), time.perf_counter() - start,
                     f"start {start_batch}, x0.9 per failure")


def _lightning(build, shape, cap, mode, *, max_val) -> dict:
    name = f"lightning scale_batch_size ({mode})"
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return _peer_row(name, None, None, None, "not installed")
    import logging
    import warnings

    tried = []
    # NOTE: the data set (2 x max_val examples) is made before the guard: resident data, as the
    # batches Lightning collates from it are what the guard counts.
    data = torch.utils.data.TensorDataset(torch.randn(2 * max_val, *shape), torch.zeros(2 * max_val, dtype=torch.long))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build()
            self.batch_size = 2

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

        # the guard counts training steps only (batch included), not Lightning's restores
        def on_train_batch_start(self, batch, batch_idx):
            guard.reserve(sum(t.numel() * t.element_size() for t in batch))
            guard.active = True

        def on_train_batch_end(self, outputs, batch, batch_idx):
            guard.active = False

        def training_step(self, batch, _):
            if not tried or tried[-1] != self.batch_size:
                tried.append(self.batch_size)
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer("adam", self.parameters())

    module = Module()
    baseline = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    guard = BudgetGuard(cap, baseline=baseline, pause_on_refusal=True)
    guard.active = False
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
        start = time.perf_counter()
        try:
            with guard:
                answer = Tuner(trainer).scale_batch_size(module, mode=mode, steps_per_trial=2, init_val=2,
                                                         max_trials=25, margin=0.0, max_val=max_val)
        finally:
            guard.close()
        seconds = time.perf_counter() - start
    return _peer_row(name, answer, len(tried), seconds, "guard counts steps only; model and batch bytes added")


# ---------------------------------------------------------------------------------------------
# Plots (pure)


def plot_prediction_error(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, part in df.groupby("model", sort=False):
        axes[0].plot(part["measured_bytes"] / 2**20, part["predicted_bytes"] / 2**20, "o", label=name)
        axes[1].plot(part["batch_size"], 100 * part["error"], "o-", label=name)
    lim = [0, df["measured_bytes"].max() / 2**20 * 1.05]
    axes[0].plot(lim, lim, "k--", lw=0.8, label="exact")
    axes[0].set_xlabel("measured peak (MiB, MemoryMeter)")
    axes[0].set_ylabel("predicted peak (MiB, plan)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("batch size")
    axes[1].set_ylabel("prediction error (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Memory known before execution: predicted vs measured peak of a training step")
    fig.tight_layout()
    return fig


def plot_accuracy(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, col, title in ((axes[0], "train_accuracy", "train"), (axes[1], "test_accuracy", "test")):
        for (name, part), style in zip(df.groupby("framework", sort=False), ("-", "--"), strict=False):
            ax.plot(part["round"], 100 * part[col], style, label=name)
        ax.set_xlabel("round")
        ax.set_title(f"{title} accuracy (Fig 9)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("accuracy (%)")
    fig.tight_layout()
    return fig


def plot_single_model(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(df))
    axes[0].bar(x - 0.2, df["predicted_peak_bytes"] / 2**20, 0.4, label="predicted before running")
    axes[0].bar(x + 0.2, df["measured_peak_bytes"] / 2**20, 0.4, label="measured")
    axes[0].set_ylabel("peak tensor memory (MiB)")
    err = [df["round_median_s"] - df["round_min_s"], df["round_max_s"] - df["round_median_s"]]
    axes[1].bar(x, 1e3 * df["round_median_s"], yerr=1e3 * np.array(err), capsize=4)
    axes[1].set_ylabel("time per round (ms, median, min-max)")
    for ax in axes:
        ax.set_xticks(x, df["framework"])
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.suptitle("Single model: memory (left) and time per round (right), Fig 10")
    fig.tight_layout()
    return fig


def plot_multi_model(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    ran = df[df["run"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.scatter(ran["complexity"], 1e3 * ran["plain_s"], marker="o", label="PyTorch: build each model anew")
    ax.scatter(ran["complexity"], 1e3 * ran["switching_s"], marker="x", label="CalcGraph heap: model switching")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("models x rounds")
    ax.set_ylabel("total time (ms)")
    ax.set_title("Many models (Fig 11)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_parallel(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{m}\n{b / 2**20:.1f} MiB" for m, b in zip(df["mode"], df["budget_bytes"], strict=True)]
    x = np.arange(len(df))
    ax.bar(x - 0.2, df["planned_models"], 0.4, label="planned (0 trials)")
    bars = ax.bar(x + 0.2, df["trial_models"], 0.4, label="trial search")
    for bar, t in zip(bars, df["trials"], strict=True):
        ax.annotate(f"{t} trials", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("models in parallel")
    ax.set_title("Models that fit in a budget (Fig 12)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_peers(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    ran = df[df["max_batch"].notna()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    y = np.arange(len(ran))
    axes[0].barh(y, ran["trials"].astype(float))
    axes[0].set_xlabel("trial runs")
    axes[1].barh(y, ran["seconds"].astype(float))
    axes[1].set_xlabel("wall time to the answer (s)")
    for ax in axes:
        ax.set_yticks(y, [f"{m} -> {int(b)}" for m, b in zip(ran["method"], ran["max_batch"], strict=True)])
        ax.grid(alpha=0.3, axis="x")
    axes[1].set_yticklabels([])
    fig.suptitle("Largest batch for a budget: plan vs trial-based finders")
    fig.tight_layout()
    return fig
