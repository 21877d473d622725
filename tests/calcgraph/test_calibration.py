"""CalcGraph's plan calibrated against the allocator (issue 18): real kernels' workspaces and scratch that
fake tensors cannot see, judged by `AllocatorMeter` (which shares no counting rule with the plan)."""

import pytest
import torch
from torch import nn

from workbench.calcgraph import CALIBRATED_ZONE, ZONES, CompiledGraph, plan_training, training_program
from workbench.measure import AllocatorMeter


class LSTMNet(nn.Module):
    """Two LSTM layers and a linear head on the last step (oneDNN's RNN kernel on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def bn_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


LSTM_SHAPE, CNN_SHAPE = (12, 16), (3, 16, 16)


@pytest.fixture(scope="module")
def lstm():
    return plan_training(LSTMNet, LSTM_SHAPE, calibrate=False), plan_training(LSTMNet, LSTM_SHAPE)


def test_fake_tensors_miss_the_lstm_workspace_and_calibration_finds_it(lstm, allocator_peak):
    plain, calibrated = lstm
    for b in (3, 12, 48):
        real = allocator_peak(LSTMNet, LSTM_SHAPE, b)
        assert plain.required_bytes(b) < 0.75 * real  # the review's finding: 30-77% under
        error = (calibrated.required_bytes(b) - real) / real
        assert -0.03 <= error <= 0.05, (b, error)
    assert calibrated.calibration is not None  # on CPU the default plan is calibrated
    assert (calibrated.calibration_error["error"].abs() < 0.02).all()


def test_a_variant_of_the_program_takes_its_calibration_call_by_call(lstm):
    """Issue 37: the step-in-backward variant of the LSTM's program, planned with the plain program's calibration
    carried over (`calibrated_like`, no real step of its own), counts the oneDNN workspace that its fake tensors
    miss, at batches no calibration ran (it ran 1, 2, 4, 8, 16, 32 and 64)."""
    _, calibrated = lstm

    def variant(size, tracker):
        training_program(LSTMNet, LSTM_SHAPE, size, annotate=tracker, in_backward=True)

    graph = CompiledGraph(variant, device="cpu", trace_sizes=(2, 3))
    carried = graph.calibrated_like(calibrated)
    assert graph.calibration is None and carried.calibration is not None  # a calibrated copy
    for b in (12, 48):
        with AllocatorMeter("cpu") as meter:
            training_program(LSTMNet, LSTM_SHAPE, b, in_backward=True)
        assert graph.required_bytes(b) < 0.75 * meter.peak_bytes
        error = (carried.required_bytes(b) - meter.peak_bytes) / meter.peak_bytes
        assert -0.02 <= error <= 0.05, (b, error)
    with pytest.raises(ValueError, match="traced at one batch, got 3, 4"):  # the calls' shapes differ
        CompiledGraph(variant, device="cpu", trace_sizes=(2, 4)).calibrated_like(calibrated)


def test_lstm_max_batch_fits_the_budget_under_the_allocator(lstm, allocator_peak):
    _, graph = lstm
    budget = float(2**20)
    assert graph.default_margin >= 0.02
    b = graph.max_batch_size(budget)
    assert b >= 1
    assert graph.required_bytes(b) <= budget * (1 - graph.default_margin) < graph.required_bytes(b + 1)
    assert allocator_peak(LSTMNet, LSTM_SHAPE, b) <= budget
    with pytest.warns(UserWarning, match="not calibrated"):
        plain_answer = lstm[0].max_batch_size(budget)
    assert plain_answer > b and allocator_peak(LSTMNet, LSTM_SHAPE, plain_answer) > budget  # why it was needed


def test_calibrated_bytes_are_their_own_zone_and_steps_are_reported(lstm):
    plain, graph = lstm
    zones = graph.zone_bytes(16).set_index("zone")
    assert list(zones.index) == [*ZONES, CALIBRATED_ZONE]
    assert zones.loc[CALIBRATED_ZONE, "bytes_at_peak"] > 0
    assert zones["bytes_at_peak"].sum() == graph.required_bytes(16)
    assert list(plain.zone_bytes(16)["zone"]) == list(ZONES)  # an uncalibrated plan keeps the paper's four
    assert plain.default_margin == 0.0
    steps = graph.step_peaks(16)
    assert set(steps) == {"build", "first_step", "steady_state"}
    assert max(steps.values()) == graph.required_bytes(16)
    assert steps["steady_state"] >= steps["first_step"]  # Adam's state is allocated in the first step


def test_batchnorm_scratch_is_calibrated(allocator_peak):
    plain = plan_training(bn_cnn, CNN_SHAPE, calibrate=False)
    graph = plan_training(bn_cnn, CNN_SHAPE)
    for b in (1, 8, 48):
        real = allocator_peak(bn_cnn, CNN_SHAPE, b)
        assert plain.required_bytes(b) < 0.9 * real
        assert abs(graph.required_bytes(b) - real) / real <= 0.02, b


def test_calibration_skips_a_batch_the_model_refuses():
    def bn1d():
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    graph = plan_training(bn1d, (8,), calibrate=False).calibrate(sizes=(1, 2, 4), check=(8,), refine=0)
    assert list(graph.calibration.sizes) == [2, 4, 8] and "more than 1 value" in graph.calibration.skipped[1]
    with pytest.raises(ValueError, match=">= 2 distinct"):
        graph.calibrate(sizes=(2,))
    with pytest.raises(ValueError, match="real runs at >= 2"):
        graph.calibrate(sizes=(1, 2))
    assert torch.device("cpu") == graph.device


def test_a_check_that_misses_joins_the_calibration_and_twice_it_is_checked(lstm):
    plain, _ = lstm
    graph = plan_training(LSTMNet, LSTM_SHAPE, calibrate=False).calibrate(
        sizes=(2, 3), check=(4,), tolerance=(0.0, 0.0), refine=2)
    table = graph.calibration_error
    missed = table[table["error"] != 0]
    assert list(table["refined"].unique()) == list(range(table["refined"].max() + 1))
    for _, row in missed[missed["refined"] < 2].iterrows():  # a miss joins the sizes, twice it is checked next
        assert row["batch_size"] in graph.calibration.sizes
        assert (table[table["refined"] == row["refined"] + 1]["batch_size"] == 2 * row["batch_size"]).any()
    last = table[table["refined"] == table["refined"].max()]
    judged = {int(s) for s in last.iloc[0]["calibrated_at"].split(", ")}
    assert set(graph.calibration.sizes) == judged | set(last["batch_size"])  # every check joins the final fit
    assert set(graph.calibrated_batches) == set(graph.calibration.sizes)
    assert plain.calibration is None


@pytest.mark.parametrize(("keyword", "value", "match"), [
    ("tolerance", (0.01, 0.05), "tolerance"), ("tolerance", (-0.02, float("inf")), "tolerance"),
    ("refine", -1, "refine"), ("refine", 1.5, "refine"), ("sizes", (4,), ">= 2 distinct"),
])
def test_calibration_refuses_bad_settings(lstm, keyword, value, match):
    graph = plan_training(LSTMNet, LSTM_SHAPE, calibrate=False)
    with pytest.raises(ValueError, match=match):
        graph.calibrate(**{keyword: value})


def test_a_profiler_without_the_device_s_allocator_events_leaves_the_default_plan_uncalibrated_and_says_so(
        monkeypatch):
    # CUDA calibration reads the caching allocator's events through the profiler: had a torch recorded none, every
    # default CUDA plan would fail; it is said and left uncalibrated instead (an explicit calibrate=True raises)
    import workbench.calcgraph.calibrate as calibration
    from workbench.calcgraph import plan_training

    monkeypatch.setattr(calibration, "allocator_trace", lambda profiler, device: [])

    def mlp():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    with pytest.warns(UserWarning, match="recorded no allocator event on cpu.*not calibrated"):
        assert plan_training(mlp, (8,)).calibration is None
    with pytest.raises(calibration.NoAllocatorEvents, match="allocated [0-9]+ bytes"):
        plan_training(mlp, (8,), calibrate=True)


def test_a_calibration_run_marks_every_call_but_views():
    """A view allocates nothing: its call is left unmarked for the profiler (its scratch 0), every other is marked."""
    from workbench.calcgraph.tracker import CALL_PREFIX, _trace
    from workbench.measure import allocator_events

    with allocator_events() as profiler:
        trace = _trace(lambda tracker: training_program(LSTMNet, LSTM_SHAPE, 4, annotate=tracker), fake=False,
                       profiled=True)
    marked = {int(e.name()[len(CALL_PREFIX):]) for e in profiler.profiler.kineto_results.events()
              if e.name().startswith(CALL_PREFIX)}

    def is_view(name: str) -> bool:
        op, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, op, None)
        return packet is not None and getattr(packet, overload).is_view
    views = {i for i, (name, _) in enumerate(trace.calls) if is_view(name)}
    assert views and marked == set(range(len(trace.calls))) - views
