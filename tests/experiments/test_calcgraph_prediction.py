"""Memory known before execution (Sections 3.2, 4.3): the prediction table says what measured it, and
the CalcHeap's static layout at batch 10,000 is the paper's quantity."""

from workbench.experiments import calcgraph as cgx


def test_prediction_table_names_its_meter(one_thread):
    df = cgx.prediction_error(["mlp", "cnn"], [1, 3])
    assert list(df["model"]) == ["mlp", "mlp", "cnn", "cnn"]
    assert set(df["meter"]) == {"live-storage tracker"} and df["affine"].all()
    assert (df["error"].abs() < 0.01).all()
    assert cgx.meter_name("cuda:0") == "cuda allocator" and cgx.meter_name("cpu") == "live-storage tracker"
    # beside the tracker, the independent measure: AllocatorMeter's count of the same run
    assert set(df["allocator"]) == {"cpu allocator (torch.profiler)"}
    assert (df["allocator_bytes"] > 0).all()
    assert (df["allocator_error"] == (df["predicted_bytes"] - df["allocator_bytes"]) / df["allocator_bytes"]).all()


def test_calcheap_layout_is_the_static_size_at_batch_10000():
    heap = cgx.calcheap_layout()
    assert list(heap["zone"]) == ["forward", "gradient", "optimizer", "workspace"]
    assert (heap["batch_size"] == cgx.PAPER_HEAP_BATCH).all()
    assert (heap["static_bytes"] >= heap["peak_bytes"]).all()
    forward = heap.set_index("zone").loc["forward", "static_bytes"]
    assert forward >= 10_000 * 784 * 4  # the batch of 10,000 images is in the heap
    params = sum(p.numel() * 4 for p in cgx.paper_mlp().parameters())
    assert heap.set_index("zone").loc["gradient", "static_bytes"] == params


def test_explain_max_batch():
    assert "largest batch" in cgx.explain_max_batch("mlp", 2 * 2**20)
    assert "batch size 1 needs" in cgx.explain_max_batch("mlp", 1000)
