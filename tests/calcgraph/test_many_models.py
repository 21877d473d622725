"""Many models in one budget (Sections 3.3, 4.4 and 4.5 of "CalcGraph: taming the high costs of deep
learning using models", 2022): `train_many` trains what one-by-one training would, within the plan."""

import pytest
import torch

from workbench.calcgraph import max_parallel_models, plan_parallel_training, train_many
from workbench.models import MLP


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_train_many_matches_models_trained_one_by_one(mode, plain):
    x, y = torch.randn(32, 1, 28, 28), torch.randint(10, (32,))
    result = train_many(MLP, (x, y), memory_budget=3.0e6, rounds=2, n_models=3, mode=mode, seed=20)
    assert 1 <= result.plan.models and result.plan.bytes_needed <= 3.0e6
    assert len(result.history) == 3 * 2
    tol = {"rtol": 0, "atol": 0} if mode == "loop" else {"rtol": 1e-4, "atol": 1e-5}
    for i in range(3):
        ref = plain(20 + i, x, y, 2)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(result.states[i][name], value, **tol)


def test_vmap_plan_gives_the_largest_number_of_models_that_fits():
    # NOTE: not affine in k (the allocation sequence at k = 1 differs from k = 2): the plan traces each k
    graph = plan_parallel_training(MLP(), (1, 28, 28), 8)
    plan = max_parallel_models(MLP(), (1, 28, 28), 4.0e6, batch_size=8, mode="vmap", graph=graph)
    assert graph.required_bytes(plan.models) <= 4.0e6 < graph.required_bytes(plan.models + 1)
    with pytest.raises(ValueError, match="mode"):
        max_parallel_models(MLP(), (1, 28, 28), 4.0e6, batch_size=8, mode="threads")
