"""Models in parallel (Fig 12): CalcGraph's plan, its own layout by trials, and plain PyTorch by trials."""

import pytest

from workbench.experiments import calcgraph as cgx


def test_parallel_models_counts_three_ways(one_thread):
    df = cgx.parallel_models([1.3 * 2**20, 4.0 * 2**20], batch_size=8, modes=["loop", "vmap"])
    assert list(df["mode"]) == ["loop", "loop", "vmap", "vmap"]
    # the plan agrees with its own layout run under the guard (same counting rule)
    assert (df["planned_models"] == df["trial_models"]).all()
    assert (df["pytorch_models"] >= 1).all() and (df["trials"] >= 2).all() and not df["capped"].any()
    loop = df[df["mode"] == "loop"]
    assert loop["planned_models"].is_monotonic_increasing
    capped = cgx.parallel_models([4.0 * 2**20], batch_size=8, modes=["loop"], max_models=2)
    assert capped["capped"].all() and capped["pytorch_models"].iloc[0] == 2
    with pytest.raises(ValueError, match="modes"):
        cgx.parallel_models([2**20], batch_size=8, modes=["threads"])


def test_programs_respect_the_guard():
    template = cgx.paper_mlp()
    assert cgx.fits_in_budget(lambda: cgx.pytorch_program(template, 1, 4, "loop", 1e-2), 2**22)
    assert not cgx.fits_in_budget(lambda: cgx.pytorch_program(template, 8, 4, "vmap", 1e-2), 2**20)
    assert not cgx.fits_in_budget(lambda: cgx.layout_program(template, 8, 4, "loop", 1e-2), 2**20)
