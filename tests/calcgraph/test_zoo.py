"""A held-out zoo (issues 18 and 37): CalcGraph's calibrated plan against `AllocatorMeter` on 17 small networks
at batches calibration never ran, 3 to 192 (CPU). Target: within 5% of the allocator everywhere and never under
by more than 2%. A case that misses is xfail(strict=True) with its measured error, never a looser target."""

import math

import pytest
import torch

from workbench.calcgraph import plan_training
from workbench.calcgraph.zoo import HELD_OUT_BATCHES, ZOO, accuracy_table, measure_case

SMALL, LARGE = HELD_OUT_BATCHES[:2], HELD_OUT_BATCHES[2:]
# (case, batch): measured error and why, for a case that misses (xfail strict)
MISSES: dict[tuple[str, int], str] = {}


@pytest.fixture(scope="module")
def graphs(one_thread_module):
    cache = {}

    def get(name):
        if name not in cache:
            case = ZOO[name]
            sample = case.sample if case.sample is not None else case.shape
            cache[name] = plan_training(case.build, sample, optimizer=case.optimizer, loss=case.loss,
                                        input_dtype=case.input_dtype)
        return cache[name]

    return get


def _params():
    for name in ZOO:
        for b in SMALL + LARGE:
            marks = [pytest.mark.large_batch] if b in LARGE else []
            if (name, b) in MISSES:
                marks.append(pytest.mark.xfail(strict=True, reason=MISSES[name, b]))
            yield pytest.param(name, b, marks=marks, id=f"{name}-{b}")


def test_zoo_has_the_named_architectures():
    assert len(ZOO) >= 12
    for name in ("transformer encoder", "lstm", "gru", "batchnorm 1d", "batchnorm 2d", "embedding + sdpa",
                 "dropout + in-place", "depthwise conv", "grouped conv", "upsampling", "bf16 mlp", "sgd momentum",
                 "adamw cnn", "checkpoint in forward", "mha self-attention", "tied decoder", "packed bilstm"):
        assert name in ZOO


@pytest.mark.parametrize(("name", "batch_size"), list(_params()))
def test_calibrated_plan_within_five_percent_of_the_allocator(graphs, name, batch_size):
    case, graph = ZOO[name], graphs(name)
    assert batch_size not in graph.calibrated_batches  # held out
    real = measure_case(case, batch_size).peak_bytes
    error = (graph.required_bytes(batch_size) - real) / real
    # NOTE: never under by more than 2%; not over by more than 5% but for what the alignment envelope adds
    # (`CompiledGraph.envelope_bytes`): at a batch that is not a power of two the plan takes the most that its runs
    # at that octave's worst alignment showed. It is 0 where kernels take the same at every alignment (every case
    # on an AMD Zen 4); on AMX (Intel) oneDNN's bf16 matmul pads odd batches, and an even batch may not pad.
    line = (graph.required_bytes(batch_size, envelope=False) - real) / real
    assert error >= -0.02 and line <= 0.05, (f"{name} at batch {batch_size}: {error:+.2%} against the allocator "
                                             f"({line:+.2%} without the alignment envelope)")


def test_accuracy_table_reports_both_plans_and_which_batches_are_held_out(one_thread_module):
    table = accuracy_table(["batchnorm 1d", "sgd momentum"], (1, 3, 8))
    assert list(table.columns) == ["model", "batch_size", "predicted", "allocator", "reserved", "error", "envelope",
                                   "uncalibrated_predicted", "uncalibrated_error", "margin", "held_out",
                                   "calibrated_at", "refused"]
    assert len(table) == 6
    refused = table[(table["model"] == "batchnorm 1d") & (table["batch_size"] == 1)].iloc[0]
    assert math.isnan(refused["allocator"]) and math.isnan(refused["error"])
    assert table["reserved"].isna().all() and table["refused"].isna().all()  # reserved: CUDA only
    rest = table.dropna(subset=["allocator"])
    assert (rest["error"] == (rest["predicted"] - rest["allocator"]) / rest["allocator"]).all()
    assert (rest["margin"] >= 0.02).all()
    assert list(table["held_out"]) == [False, True, False] * 2  # calibration runs 1 and 8, never 3
    assert (table["calibrated_at"].str.startswith("1, 2, 4, 8, 16")).all()
    with pytest.raises(ValueError, match="unknown zoo cases"):
        accuracy_table(["resnet1000"])


def test_a_case_refused_for_cudnn_s_rnn_kernels_is_planned_again_without_them(monkeypatch, one_thread):
    # on CUDA an LSTM's cuDNN kernels are refused (calcgraph.tracker); this CPU has none, so the convolution
    # stands for them, refused while cuDNN is enabled only: the refusal's way out, followed, plans it
    from workbench.calcgraph import Unplannable, tracker

    def refuse(op):
        if torch.backends.cudnn.enabled and op is torch.ops.aten.convolution.default:
            raise Unplannable("cannot plan an RNN layer run by cuDNN (stand-in)")

    monkeypatch.setattr(tracker, "_refuse_unplannable", refuse)
    table = accuracy_table(["depthwise conv"], (3,))
    assert table["model"].tolist() == ["depthwise conv", "depthwise conv (cuDNN off)"]
    first, again = table.iloc[0], table.iloc[1]
    assert "stand-in" in first["refused"] and math.isnan(first["error"])
    assert isinstance(again["refused"], float) and -0.02 <= again["error"] <= 0.05 and again["held_out"]


def test_a_factory_that_deep_copies_its_layers_is_planned_without_torch_s_warning():
    """Issue 43: nn.TransformerEncoder deep-copies its layer, and the plan's look at the factory (built under fake
    tensors) made torch warn of a fake tensor's data pointer, in red in the calcgraph notebook's zoo cell."""
    import warnings

    case = ZOO["transformer encoder"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan_training(case.build, case.shape, loss=case.loss, optimizer=case.optimizer, calibrate=False)
    assert not [str(w.message)[:120] for w in seen if "data pointer" in str(w.message)]
