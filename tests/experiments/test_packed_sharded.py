"""Per-rank bytes per parameter under FSDP2 in a fake process group (issue 20;
``workbench.experiments.packed_bit_optimizers.sharded``): measured against the formula and CalcGraph's plan."""

import importlib.util
import math

import matplotlib.pyplot as plt
import pytest
import torch

from workbench.experiments.packed_bit_optimizers.sharded import (
    SHARDED_METHODS, formula_bytes, plot_sharded_bytes, sharded_bytes_per_param,
)
from workbench.models import MLP

# 128 x 64 weights: quantised by torchao on 1 and 2 ranks (8192, 4096 values); 63 rows: uneven shards, and
# 63 x 128 = 8064 values, no whole number of 256-value blocks: torchao keeps that state in fp32
WIDTHS = (64, 128, 63, 10)


@pytest.fixture(scope="module")
def table():
    return sharded_bytes_per_param([1, 2], widths=WIDTHS, batch_size=2)


def test_measured_bytes_are_the_formula_on_each_rank_shard(table):
    methods = [m for m in SHARDED_METHODS if m != "torchao AdamW8bit" or importlib.util.find_spec("torchao")]
    assert table["method"].tolist() == [m for m in methods for _ in (1, 2)]
    shapes = [tuple(p.shape) for p in MLP(WIDTHS, "relu").parameters()]
    for row in table.itertuples():
        want = formula_bytes(row.method, shapes, row.world_size)
        got = {"weight": row.weight_bytes, "grad": row.grad_bytes, "state": row.state_bytes}
        assert got == want, row.method
        torch.testing.assert_close(row.bytes_per_param, sum(want.values()) / row.params, rtol=0, atol=0)


def test_each_rank_holds_about_its_share(table):
    for method, part in table.groupby("method"):
        one, two = (part[part["world_size"] == w].iloc[0] for w in (1, 2))
        share = two["local_params"] / one["local_params"]
        # FSDP2 gives rank 0 ceil(rows / 2) of each weight and bias
        assert two["local_params"] == sum(-(-b // 2) * (a + 1) for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
        assert 0.5 <= share < 0.51
        if method != "torchao AdamW8bit":  # torchao's per-tensor code maps and steps do not shrink
            torch.testing.assert_close(two["state_bytes"] / one["state_bytes"], share, rtol=1e-3, atol=0)
        assert two["bytes_per_param"] < 0.55 * one["bytes_per_param"]


def test_packed_bf16_plus_8_is_13_bytes_a_parameter_against_16_for_torch_adamw(table):
    one = table[table["world_size"] == 1].set_index("method")
    torch.testing.assert_close(one.loc["PackedAdamW bf16+8", "bytes_per_param"], 13.0, rtol=0, atol=0)
    steps = 4 * (2 * (len(WIDTHS) - 1)) / one.loc["torch AdamW", "params"]  # a 4-byte fp32 step per tensor
    torch.testing.assert_close(one.loc["torch AdamW", "bytes_per_param"], 16.0 + steps, rtol=0, atol=1e-12)


def test_the_plan_predicts_the_same_shards(table):
    """The plan's zones leave out only what an optimizer makes from Python numbers (torch.tensor): a
    4-byte step per tensor and, for torchao, a 1 KiB code map per quantised moment."""
    tensors = 2 * (len(WIDTHS) - 1)
    for row in table.itertuples():
        missing = round((row.bytes_per_param - row.plan_bytes_per_param) * row.params)  # whole bytes
        allowed = tensors * (4 + (2 * 1024 if row.method == "torchao AdamW8bit" else 0))
        assert 0 <= missing <= allowed, (row.method, row.world_size, missing)


def test_plot_labels_measured_and_predicted(table):
    fig = plot_sharded_bytes(table, note="toy scale")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {f"{m}: {k}" for m in table["method"] for k in ("measured", "formula", "CalcGraph plan")} == set(labels)
    assert fig.axes[0].get_xlabel().startswith("world size") and "toy scale" in fig.get_suptitle()
    plt.close(fig)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"world_sizes=\[0\]: allowed"):
        sharded_bytes_per_param([0])
    with pytest.raises(ValueError, match=r"methods=\['Adam'\]: allowed"):
        sharded_bytes_per_param([1], methods=["Adam"])
    with pytest.raises(ValueError, match=r"widths=\[8\]: allowed"):
        sharded_bytes_per_param([1], widths=[8])
    with pytest.raises(ValueError, match="method='x'"):
        formula_bytes("x", [(2, 2)], 1)
    assert math.isclose(formula_bytes("PackedAdamW bf16+8", [(3, 2)], 2, rank=1)["state"], 9 * 2)
