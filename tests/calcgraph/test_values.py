"""Values a plan needs under fake tensors (`workbench/calcgraph/values.py`): integer inputs and the integer ops
on them stay real, so a model that steers its shapes by its token ids plans at the user's batch; matrix
products refuse mixed dtypes as the real kernels do."""

import pytest
import torch
from torch import nn

from workbench.calcgraph import plan_training, training_program
from workbench.calcgraph.plan import _user_rows
from workbench.measure import AllocatorMeter, MemoryMeter


class Trimmed(nn.Module):
    """Cuts the padding (token 0) off its batch before embedding it: shapes follow the longest sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        longest = int((tokens != 0).sum(1).max())
        return self.head(self.embed(tokens[:, :longest]).relu().mean(1))


def padded(length: int, longest: int) -> torch.Tensor:
    tokens = torch.randint(1, 50, (4, length))
    tokens[:, longest:] = 0
    return tokens


def test_a_model_that_cuts_its_padding_plans_at_the_users_lengths(one_thread):
    short, long = padded(64, 8), padded(64, 48)
    plans = {n: plan_training(Trimmed, batch, calibrate=False) for n, batch in (("short", short), ("long", long))}
    assert plans["short"].required_bytes(16) < plans["long"].required_bytes(16)  # values, not shapes, differ
    for name, batch in (("short", short), ("long", long)):
        with AllocatorMeter("cpu") as meter:
            training_program(Trimmed, (64,), 16, input_dtype=torch.long, make_batch=_user_rows(batch))
        error = (plans[name].required_bytes(16) - meter.peak_bytes) / meter.peak_bytes
        assert -0.02 <= error <= 0.05, (name, error)


def test_integer_factories_inside_forward_keep_their_values():
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(16, 8)

        def forward(self, x):
            steps = torch.arange(x.shape[1])  # a real tensor under fake tensors: its values index below
            assert int(steps[-1]) == x.shape[1] - 1
            return self.pos(steps).sum() + x.sum()

    graph = plan_training(Positions, (16,), loss=lambda out, _: out, calibrate=False)
    assert graph.affine


def test_a_matrix_product_of_mixed_dtypes_is_refused_as_the_real_kernel_refuses_it():
    with pytest.raises(ValueError, match=r"of torch.int32.*addmm.default needs one dtype"):
        plan_training(lambda: nn.Linear(4, 2), (4,), input_dtype=torch.int32, calibrate=False)


class EndToken(nn.Module):
    """Reads each sequence's hidden state at its end token, as transformers' T5 classifier does: a boolean mask
    of the token ids indexes the (fake) hidden states, a value that decides the result's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        hidden = self.embed(tokens).relu()
        return self.head(hidden[tokens == 1])


def test_a_boolean_mask_of_token_ids_indexes_as_in_the_real_run(one_thread):
    tokens = torch.randint(2, 50, (4, 12))
    tokens[:, -1] = 1  # one end token per sequence: the mask picks a row each, the result is [batch, 16]
    tokens[0, 3] = 1  # and one more in the first: five rows, which only the values say
    total = lambda out, _: out.sum()  # noqa: E731 - five rows against four sequences: no per-row target
    graph = plan_training(EndToken, tokens, loss=total, calibrate=False)
    with MemoryMeter("cpu") as meter:
        training_program(EndToken, (12,), 4, input_dtype=torch.long, make_batch=_user_rows(tokens), loss=total)
    assert graph.required_bytes(4) == meter.peak_bytes


@pytest.mark.parametrize("options", [dict(extra_bits=8), dict(extra_bits=5), dict(extra_bits=8, state_dtype=torch.int8),
                                     dict(extra_bits=8, fused=True), dict(extra_bits=5, fused=True)],
                         ids=["byte planes", "int32 words", "int8 moments", "fused planes", "fused words"])
def test_a_packed_optimizers_state_is_fake_under_a_plans_trace(options):
    """Its extra bits (uint8 planes, int32 words) and int8 moments are integer tensors: made by a factory of
    integers they ran for real (`with_known_values`), as large as the parameters on the planning host, and each
    kernel call converted them to fake again. Made like their parameter, they are fake."""
    from torch._subclasses import FakeTensor

    from workbench.calcgraph.tracker import _trace
    from workbench.optim import PackedAdamW

    made = []

    def optimizer(params):
        made.append(PackedAdamW(params, seed=0, **options))
        return made[-1]
    build = lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3)).to(torch.bfloat16)  # noqa: E731
    _trace(lambda annotate: training_program(build, (16,), 4, optimizer=optimizer, input_dtype=torch.bfloat16,
                                             annotate=annotate))
    states = [t for st in made[0].state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert states and all(isinstance(t, FakeTensor) for t in states), \
        [(t.dtype, tuple(t.shape)) for t in states if not isinstance(t, FakeTensor)]
    assert {t.dtype for t in states} >= ({torch.int8} if "state_dtype" in options else
                                         {torch.int32 if options["extra_bits"] == 5 else torch.uint8})
