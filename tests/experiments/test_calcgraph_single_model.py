"""One model, heap-bound vs plain PyTorch (Figs 9 and 10): identical curves by construction, and the
memory and time table."""

from workbench.experiments import calcgraph as cgx


def test_heap_bound_and_plain_training_give_identical_curves(one_thread):
    data = cgx.load_data(48, 16, source="digits")
    acc = cgx.accuracy_curves(data, rounds=2, batch_size=16)
    assert list(acc["framework"].unique()) == list(cgx.FRAMEWORKS) and len(acc) == 4
    assert cgx.max_accuracy_difference(acc) == 0.0 and (acc["max_abs_weight_diff"] == 0.0).all()
    assert set(acc["data"]) == {"digits"} and (acc["n_train"] == 48).all()


def test_single_model_cost(one_thread):
    data = cgx.load_data(48, 16, source="digits")
    cost = cgx.single_model_cost(data, rounds=2, batch_size=16, repeats=1).set_index("framework")
    assert list(cost.index) == list(cgx.FRAMEWORKS)
    # the plan (data resident, batch views) predicts what the meter measures for plain PyTorch
    plain = cost.loc["pytorch"]
    assert abs(plain["predicted_peak_bytes"] - plain["measured_peak_bytes"]) <= 0.01 * plain["measured_peak_bytes"]
    assert (cost["round_min_s"] <= cost["round_median_s"]).all()
    assert (cost["round_median_s"] <= cost["round_max_s"]).all()
    assert (cost["rounds"] == 2).all()
