"""The notebooks' explore widgets as library functions: progress while they run, a figure drawn once
(closed in pyplot, so ipywidgets' interact does not draw it again) and marked at toy scale."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workbench import vbs  # noqa: E402
from workbench.experiments import optorch, tour  # noqa: E402
from workbench.experiments import variable_batch_size as vbs_exp  # noqa: E402
from workbench.experiments.tour import memory as tour_memory  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _marked(fig) -> bool:
    return any("toy scale" in t.get_text() for t in fig.texts)


def test_vbs_explore_budget_returns_the_methods_and_a_closed_marked_figure():
    b = np.arange(1, 5)
    size = np.array([48, 64, 32, 16]) * 1024
    tables = vbs.LayerProfile(1e-3 / b * np.ones((3, 1)), size[:-1, None] * b, size[1:, None] * b, np.zeros((3, 4)))
    table, fig = vbs_exp.explore_budget({"googlenet": tables}, network="googlenet", ratio=1.5, request=3,
                                        units_at_floor=24, verdicts=False)
    assert list(table.method) == ["vbs", "fbs", "greedy"] and fig.number not in plt.get_fignums()
    assert _marked(fig)
    _, fig = vbs_exp.explore_budget({"googlenet": tables}, network="googlenet", ratio=1.5, request=3,
                                    units_at_floor=24, verdicts=True)
    assert not _marked(fig)
    with pytest.raises(ValueError, match=r"network must be one of \['googlenet'\], got 'resnet50'"):
        vbs_exp.explore_budget({"googlenet": tables}, network="resnet50", ratio=1.5, request=3, units_at_floor=24,
                               verdicts=False)


class _Bar:
    """Records what the tour's progress bar is told."""

    made: list = []

    def __init__(self, *, total, disable, **kwargs):
        self.total, self.n, self.disable, self.postfix = total, 0, disable, []
        _Bar.made.append(self)

    def update(self, k: int = 1) -> None:
        self.n += k

    def set_postfix_str(self, text: str) -> None:
        self.postfix.append(text)

    def close(self) -> None:
        pass


def test_tour_step_moves_a_bar_through_every_step_and_the_widget_marks_its_figure(monkeypatch):
    monkeypatch.setattr(tour_memory, "tqdm", _Bar)
    _Bar.made.clear()
    record, fig, text = tour.explore_step("resnet18", stem="cifar", batch_size=1, image_size=16, device="cpu",
                                          verdicts=False)
    bar = _Bar.made[-1]
    assert not bar.disable and bar.total == 3 and bar.n == 3  # warm-up, one timed step, the traced step
    assert bar.postfix[:2] == ["warm-up", "timing"] and "memory trace" in bar.postfix
    assert record.peak_bytes.iloc[0] > 0 and text.startswith("peak ")
    assert _marked(fig) and fig.number not in plt.get_fignums()


def test_optorch_explore_sc_draws_once_and_marks():
    table, fig = optorch.explore_sc(model="resnet18", batch=2, image_size=16, width=0.0625, device="cpu",
                                    verdicts=False)
    assert list(table.columns) == ["variant", "peak_bytes", "predicted_peak_bytes", "prediction_error", "peak_ratio"]
    assert len(table) == 4 and _marked(fig) and fig.number not in plt.get_fignums()
