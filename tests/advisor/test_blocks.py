"""Checkpoint candidates for models that are not layer sequences (issue 37): found through their repeated
blocks, checkpointed block by block with the same outputs and gradients as the plain model, planned from a
block profile, and the recomputed tensors counted as activations."""

import pytest
import torch
from torch import nn

from workbench.advisor import Config, advise
from workbench.advisor.blocks import BlockCheckpoints, checkpoint_blocks, find_blocks, profile_blocks
from workbench.advisor.configs import checkpoint_kind
from workbench.measure import AllocatorMeter


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x, *, scale: float = 1.0):
        return x + scale * self.ff(self.norm(x))


class Tower(nn.Module):
    """Not a sequence: an embedding, a loop over a ModuleList of blocks (with a keyword argument), a head."""

    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h.mean(1))


def test_the_blocks_are_the_repeated_class_holding_most_of_the_model():
    model = Tower()
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(nn.Linear(3, 3)) == [] and checkpoint_kind(lambda: nn.Linear(3, 3)) is None
    assert checkpoint_kind(Tower) == "blocks"
    assert checkpoint_kind(lambda: nn.Sequential(nn.Linear(3, 3), nn.ReLU())) == "layers"


@pytest.mark.parametrize("segments", [None, [(0, 1, False), (1, 3, True), (3, 4, False)]])
def test_checkpointed_blocks_give_the_plain_models_outputs_and_gradients(segments):
    torch.manual_seed(0)
    plain = Tower()
    ckpt = checkpoint_blocks(Tower(), segments)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(5, 6, 8)
    for model in (plain, ckpt):
        torch.manual_seed(1)  # the same dropout masks; checkpoint replays them in the recomputation
        model(x).square().sum().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_the_optimal_block_plan_frees_just_enough():
    profile = BlockCheckpoints(time_s=[1.0, 1.0, 2.0, 1.0], forward_s=6.0, saved=[100, 100, 100, 300],
                               inputs=[10, 10, 10, 10], others=50)
    assert profile.unchecked_peak == 650 and profile.uniform == [(i, i + 1, True) for i in range(4)]
    assert profile.optimal(650) == [(0, 4, False)]
    # the most bytes freed per second first: block 3 alone is back whole while backward recomputes it
    assert profile.activations([3]) == 50 + 300 + 300 and profile.activations([3, 0]) == 50 + 210 + 300
    assert profile.optimal(600) == [(0, 1, True), (1, 3, False), (3, 4, True)]
    assert profile.optimal(0) == profile.uniform  # nothing fits: every block
    assert profile.recompute_share([(0, 2, False), (2, 3, True), (3, 4, False)]) == pytest.approx(2 / 6)


def test_the_block_profile_times_each_block_and_counts_what_it_saves():
    profile = profile_blocks(Tower(), torch.randn(4, 6, 8), torch.randn(32, 6, 8))
    assert len(profile) == 4 and all(t > 0 for t in profile.time_s) and sum(profile.time_s) < profile.forward_s
    assert len(set(profile.time_s)) == 1  # identical blocks: their median, one time
    assert all(s > i > 0 for s, i in zip(profile.saved, profile.inputs, strict=True)) and profile.others > 0


def test_a_model_checkpointed_through_its_blocks_is_planned_and_its_recomputation_is_activations():
    x, y = torch.randn(64, 6, 8), torch.randint(0, 3, (64,))
    advice = advise(Tower, (x, y), memory_budget=2**40, calibrate=False, min_run_time=0.01,
                    candidates=[Config(checkpoint=c) for c in ("none", "uniform")])
    table = advice.table.set_index("config")
    assert not advice.notes or "no checkpoint" not in " ".join(advice.notes)
    plain, every = table.loc["fp32"], table.loc["fp32, checkpoint uniform"]
    assert every["predicted_peak_bytes"] < plain["predicted_peak_bytes"]
    assert every["activations"] > every["workspace"]  # the recomputed block's tensors are activations
    with AllocatorMeter() as meter:
        advice.program("fp32, checkpoint uniform")(64, None)
    assert abs(every["predicted_peak_bytes"] - meter.peak_bytes) <= 0.02 * meter.peak_bytes


def test_a_model_without_blocks_says_why_it_has_no_checkpoint_candidates():
    advice = advise(lambda: nn.Linear(8, 3), (torch.randn(4, 8), torch.randint(0, 3, (4,))), memory_budget=2**30,
                    calibrate=False, min_run_time=0.01, candidates=lambda c: c.precision == "fp32")
    assert (advice.table["checkpoint"] == "none").all()
    assert any("no checkpoint candidates" in note for note in advice.notes)


def test_a_densenets_layers_recompute_on_their_inputs_as_they_were():
    """A dense layer takes the block's list of features, which grows after the call: checkpointed through its
    blocks, the recomputation must see the list as it was (it saw 2 more channels and BatchNorm refused)."""
    from workbench.models.densenet import densenet_bc

    def run(checkpointed: bool):
        torch.manual_seed(0)
        net = densenet_bc(16, growth_rate=2)
        if checkpointed:
            checkpoint_blocks(net)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        net(x).square().sum().backward()
        return net

    plain, checkpointed = run(False), run(True)
    assert len(find_blocks(plain)) == 6
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for a, b in zip(plain.buffers(), checkpointed.buffers(), strict=True):  # running statistics advanced once
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_densenet_checkpointed_through_its_blocks_is_planned_within_the_band_at_held_out_batches(in_backward):
    """Issue 37: a DenseNet-BC with uniform block checkpoints, with and without step in backward, predicted within
    -2%..+5% of the allocator at batch 4 and at 12, which calibration (plain program, batches 2, 4, 8) never ran.
    Its peak is in a backward, beside other kernels' scratch than the plain program's peak: the plain
    program's correction added as one constant missed by -4.7% to -5.3% (1 thread; +12.5% at 2 threads)."""
    from workbench.advisor.plans import Plans
    from workbench.advisor.workload import Workload
    from workbench.models.densenet import densenet_bc

    def build() -> nn.Module:
        return densenet_bc(10, growth_rate=2)

    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    work = Workload.of(build, x, y, None, "adamw", 1e-3, torch.device("cpu"))
    candidate = Config(step_in_backward=in_backward, checkpoint="uniform")
    with torch.device("meta"):
        uniform = [(i, i + 1, True) for i in range(len(find_blocks(build())))]
    plans = Plans(work, [Config(), candidate], uniform=uniform)
    plans.calibrate(Config(), 4)
    plan = plans.plan(candidate)
    for size in (4, 12):
        with AllocatorMeter() as meter:
            work.program(candidate)(size, None)
        error = (plan.peak(size) - meter.peak_bytes) / meter.peak_bytes
        assert -0.02 <= error <= 0.05, (size, plan.peak(size), meter.peak_bytes)
