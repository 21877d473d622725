"""Largest batch for a memory budget: CalcGraph's plan against trial-based finders (beyond the paper).

"CalcGraph: taming the high costs of deep learning using models" (2022), Section 3.2 and Algorithm 1:
the largest batch for a memory size comes from the plan, with no trial run. The peers find it by
running real training steps until they stop failing: accelerate's `find_executable_batch_size`
(start high, x0.9 per failure) and Lightning's `Tuner.scale_batch_size` (power and binsearch modes),
beside a doubling-then-bisection search of our own (the ground truth). Every trial runs under a
`BudgetGuard`, which counts with the plan's own rule: the plan agreeing with the ground truth is a
consistency check, while the trial counts and times of the peers are the real comparison. A peer
that is not installed (the `[peers]` extra) is a row that says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.calcgraph import BudgetGuard, make_optimizer, plan_training, search_max, training_program

from .parallel import fits_in_budget
from .workload import model_factory

__all__ = ["PEERS", "max_batch_peers"]

PEERS = ("accelerate", "lightning-power", "lightning-binsearch")
PLAN = "calcgraph (plan)"
TRUTH = "trial bisection (guard)"


def _peer_row(method, answer, trials, seconds, note=""):
    return {"method": method, "max_batch": answer, "trials": trials, "seconds": seconds, "note": note}


def max_batch_peers(model: str, budget_bytes: float, *, start_batch: int = 4096, margin: float = 0.0,
                    peers: Sequence[str] = PEERS, resnet_width: float = 1.0, image_size: int = 32,
                    progress: bool = False) -> pd.DataFrame:
    """Largest batch of one training program within `budget_bytes`: CalcGraph (plan only), a
    trial bisection under the budget guard (ground truth), accelerate's
    `find_executable_batch_size`, Lightning's `Tuner.scale_batch_size` (power, binsearch).
    `peers` picks which of `PEERS` run."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"peers must be among {PEERS}, got {sorted(unknown)}")
    build, shape = model_factory(model, resnet_width=resnet_width, image_size=image_size)
    cap = budget_bytes * (1 - margin)
    rows = []
    start = time.perf_counter()
    graph = plan_training(build, shape, calibrate=False)  # the paper's zero-trial plan
    answer = graph.max_batch_size(budget_bytes, margin=margin)
    rows.append(_peer_row(PLAN, answer, 0, time.perf_counter() - start,
                          f"{graph.last_search_evaluations} plan evaluations, compile included"))
    steps = tqdm(total=1 + len(peers), desc="peers", disable=not progress, leave=False)
    trials = 0

    def runs(b: int) -> bool:
        nonlocal trials
        trials += 1
        torch.manual_seed(0)
        return fits_in_budget(lambda: training_program(build, shape, b), cap)

    start = time.perf_counter()
    truth, _ = search_max(runs, start_batch)
    rows.append(_peer_row(TRUTH, truth, trials, time.perf_counter() - start,
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
    frame["model"], frame["budget_bytes"] = model, budget_bytes
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
    import tempfile
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
