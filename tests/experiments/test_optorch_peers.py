"""The peer beside our planner: torch's activation-memory budget (retained bytes, the comparison table)."""

from __future__ import annotations

import matplotlib
import pandas as pd
import torch
from matplotlib.figure import Figure

from workbench.experiments.optorch import (
    autoencoder, hook_retained_bytes, meter_retained_bytes, peer_comparison, plot_peer,
)

matplotlib.use("Agg")


def test_retained_bytes_agree_on_eager() -> None:
    net = autoencoder((16, 8, 4, 8, 16))
    x = torch.randn(32, 16)

    def step():
        out = net(x)
        return out.square().mean(), out
    hooks, loss = hook_retained_bytes(step, [*net.parameters(), x])
    loss.backward()
    meter, peak = meter_retained_bytes(step, torch.device("cpu"))
    assert abs(hooks - meter) <= 16 and peak >= meter  # the loss scalar is all that differs


def _peer_frame() -> pd.DataFrame:
    return pd.DataFrame({
        "method": ["ours (optimal plan)", "ours (optimal plan)", "torch.compile (inductor) activation_memory_budget",
                   "torch.compile (inductor) activation_memory_budget"],
        "fraction": [1.0, 0.5, 1.0, 0.5], "retained_bytes": [100, 60, 100, 30],
        "retained_ratio": [1.0, 0.6, 1.0, 0.3], "time_ratio": [1.0, 1.2, 0.8, 0.9],
        "time_ratio_lo": [0.9, 1.1, 0.7, 0.8], "time_ratio_hi": [1.1, 1.3, 0.9, 1.0]})


def test_peer_comparison_sets_ours_against_torch_per_fraction() -> None:
    out = peer_comparison(_peer_frame()).set_index("fraction")
    assert list(out.index) == [1.0, 0.5]
    assert out.retained_ratio[0.5] == 2.0 and out.time_ratio[1.0] == 1.0 / 0.8
    assert out.time_ratio_lo[0.5] == 1.1 / 1.0 and out.time_ratio_hi[0.5] == 1.3 / 0.8
    assert peer_comparison(pd.DataFrame()).empty and peer_comparison(None).empty


def test_peer_plot() -> None:
    assert isinstance(plot_peer(_peer_frame()), Figure)
