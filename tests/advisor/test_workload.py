"""What the user passes besides the model (issue 37): targets and losses that fail are named, a model instance
is refused with what to pass instead, every real step takes rows of the user's own batch (real token ids, not
zeros), and a batch given as shapes draws ids the model's embedding accepts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.advisor import Config
from workbench.advisor.workload import Workload, check_factory, check_loss


class Tagger(nn.Module):
    """Token ids -> per-token classes: integer inputs and per-position targets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids):
        return self.head(self.emb(ids))


def sequence_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def test_a_model_instance_is_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="got a Tagger instance: pass a function that builds the model") as error:
        check_factory(Tagger())
    assert len(str(error.value)) < 300  # not the model's repr


def test_a_factory_that_exits_is_named():
    def quits():
        raise SystemExit(0)
    with pytest.raises(ValueError, match="model_fn .*quits failed to build the model: SystemExit"):
        check_factory(quits)


@pytest.mark.parametrize(("targets", "loss", "match"), [
    (torch.zeros(4, 6, dtype=torch.long), None, r"the default loss \(cross-entropy\) refused the model's output "
                                               r"\(per example \[6, 5\] float32\) and the targets \(per example \[6\] "
                                               r"int64\)"),
    (torch.zeros(4, 7, dtype=torch.long), sequence_loss, r"loss_fn sequence_loss refused .* targets \(per example "
                                                         r"\[7\] int64\)"),
    (torch.zeros(4, 6, dtype=torch.long), lambda out, y: out.sum(-1), "must return a floating scalar loss"),
])
def test_a_loss_that_refuses_the_targets_is_named_with_both_shapes(targets, loss, match):
    with pytest.raises(ValueError, match=match):
        check_loss(Tagger, torch.zeros(4, 6, dtype=torch.long), targets, loss)


def test_a_forward_that_fails_is_left_to_the_trace_which_names_the_layer():
    assert check_loss(lambda: nn.Linear(3, 2), torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), None) is None


def _workload(inputs, targets):
    return Workload.of(Tagger, inputs, targets, sequence_loss, "adamw", 1e-3, torch.device("cpu"))


def test_real_steps_take_rows_of_the_users_batch_fresh_each_time():
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(1, 50, (3, 6), generator=g), torch.randint(0, 5, (3, 6), generator=g)
    batch = _workload(ids, y).make_batch(Config())
    x1, y1 = batch(7, torch.device("cpu"))
    rows = torch.arange(7) % 3
    torch.testing.assert_close(x1, ids[rows], rtol=0, atol=0)
    torch.testing.assert_close(y1, y[rows], rtol=0, atol=0)
    x2, _ = batch(3, torch.device("cpu"))
    assert x2.data_ptr() != ids.data_ptr() and torch.equal(x2, ids)  # a copy, as the plan's fresh batch


def test_float_inputs_are_cast_for_bf16_weights():
    work = Workload.of(lambda: nn.Linear(4, 3), torch.randn(2, 4), torch.zeros(2, dtype=torch.long), None, "adamw",
                       1e-3, torch.device("cpu"))
    x, y = work.make_batch(Config("bf16", 8))(4, torch.device("cpu"))
    assert x.dtype == torch.bfloat16 and y.dtype == torch.long
    torch.testing.assert_close(x.float(), work.inputs[torch.arange(4) % 2].bfloat16().float())


def test_a_batch_given_as_shapes_draws_ids_below_the_embedding_and_targets_below_the_classes():
    meta = (torch.empty(64, 6, dtype=torch.long, device="meta"), torch.empty(64, 6, dtype=torch.long, device="meta"))
    work = _workload(*meta)
    assert (work.id_range, work.target_range) == (50, 5)
    x, y = work.make_batch(Config())(64, torch.device("cpu"))
    assert 0 <= x.min() and x.max() < 50 and len(x.unique()) > 10  # not all padding
    assert 0 <= y.min() and y.max() < 5 and len(y.unique()) > 1
