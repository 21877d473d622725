"""Many models (Fig 11): the table of cells run and skipped, one switch vs one build, the explorer."""

from workbench.experiments import calcgraph as cgx


def test_multi_model_times_runs_and_skips_cells(one_thread):
    data = cgx.load_data(16, 8, source="digits")
    many = cgx.multi_model_times(data, n_models=[1, 3], rounds=[1, 2], batch_size=16, max_steps=4)
    assert list(zip(many["models"], many["rounds"], many["run"], strict=True)) == [
        (1, 1, True), (1, 2, True), (3, 1, True), (3, 2, False)]
    ran = many[many["run"]]
    assert (ran["speedup"] > 0).all() and (ran["speedup_min"] <= ran["speedup_max"]).all()
    assert (many["complexity"] == many["models"] * many["rounds"]).all()


def test_switch_latency_and_explorer(one_thread):
    latency = cgx.switch_latency(repeats=2)
    assert list(latency["operation"]) == ["switch (save + load)", "build model + optimizer"]
    data = cgx.load_data(16, 8, source="digits")
    text, losses = cgx.explore_train_many(data, n_models=2, rounds=2, budget_bytes=4 * 2**20, batch_size=16)
    assert "models at once" in text and losses.shape == (2, 2)
    text, losses = cgx.explore_train_many(data, n_models=2, rounds=1, budget_bytes=1000, batch_size=16)
    assert losses is None and "budget" in text
