"""The advisor notebook's suite on a device (workbench.experiments.advisor.on_device), what the GPU run's `memory`
part starts after CalcGraph's zoo: the suite at the notebook's gpu profile, cheapest model first."""

from workbench.experiments.advisor import on_device


def test_the_advisor_suite_runs_at_its_notebook_s_gpu_profile_cheapest_model_first():
    p = on_device._advisor_parameters("gpu")
    assert p["device"] == "cuda" and p["batch_size"] == 32 and 0 < p["budget_quantile"] < 1
    assert p["packed_bits"] == [8] and p["run_candidates"] == 8  # what fits the part's minutes
    assert set(p["models"]) <= set(on_device.ADVISOR_ORDER)


def test_the_advisor_suite_plans_and_runs_what_its_profile_says(monkeypatch):
    # the 2026-11-27 H100 call ran out of minutes inside its first model with every candidate planned and run
    smoke = on_device._advisor_parameters("smoke")
    monkeypatch.setattr(on_device, "_advisor_parameters", lambda profile: {**smoke, "packed_bits": [8],
                                                                            "run_candidates": 3})
    table, decisions = on_device.advisor_on_device("cpu", "smoke")
    assert len(table) == 3 and table["measured_peak_bytes"].notna().all()  # 3 run, of 24 planned (k = 8 only)
    assert not table["config"].str.contains(r"\+(?:0|16)\b").any()
    assert decisions["model"].tolist() == ["mlp"]
