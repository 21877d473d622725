"""The side-by-side table of the packed-bit notebook against torch, torchao, torch-optimi and bitsandbytes
(Memory Efficient Mixed Precision Optimizers, Lewandowski & Kosson)."""

import importlib

import pytest
import torch

from workbench.data import synthetic_images
from workbench.experiments.packed_bit_optimizers import peer_methods, peer_table
from workbench.models import MLP


def test_peer_methods_parse_and_reject():
    assert peer_methods("all")[0] == "torch fp32" and "ours bf16+16 (bf16 states)" in peer_methods("all")
    assert peer_methods(["all"]) == peer_methods("all")  # the notebook's list parameter
    assert peer_methods("torch bf16, ours bf16+8 (fp32 states)") == ["torch bf16", "ours bf16+8 (fp32 states)"]
    with pytest.raises(ValueError, match="unknown method"):
        peer_methods("torch fp64")


def test_peer_table_bytes_and_missing_peers(monkeypatch):
    real_import = importlib.import_module

    def no_optimi(name, *args):
        if name == "optimi":
            raise ImportError("No module named 'optimi'")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_optimi)  # what import_peer calls
    monkeypatch.setattr("workbench.experiments.packed_bit_optimizers.peak_memory.packed_option_available",
                        lambda option: False)
    data = synthetic_images(48, shape=(1, 4, 4), num_classes=3, seed=0)
    train_set, test_set = data.split(0.25, seed=0)

    def model_fn():
        return MLP(sizes=(16, 32, 3), activation="relu")

    methods = ["torch fp32", "torch bf16", "optimi bf16 + Kahan", "ours bf16+8 (fp32 states)",
               "ours bf16+8 (bf16 states)"]
    df = peer_table(model_fn, train_set, test_set, methods=methods, epochs=1, batch_size=8, seeds=[0, 1],
                    repeats=2, progress=False).set_index("method")
    assert not df.loc["optimi bf16 + Kahan", "available"]
    assert "not installed" in df.loc["optimi bf16 + Kahan", "note"]
    assert not df.loc["ours bf16+8 (bf16 states)", "available"]
    assert "not available in this build" in df.loc["ours bf16+8 (bf16 states)", "note"]
    params = int(df.loc["torch fp32", "params"])
    # AdamW: weights + grads + two moments (+ a 4-byte step counter per tensor)
    got = torch.tensor(df.loc[["torch fp32", "torch bf16"], "bytes_per_param"].to_numpy(dtype=float))
    torch.testing.assert_close(got, torch.tensor([16.0, 8.0], dtype=torch.float64), atol=4 * 4 / params * 4, rtol=0)
    ours = df.loc["ours bf16+8 (fp32 states)"]
    assert 13.0 <= ours["bytes_per_param"] < 13.0 + 13.0 * 31 * 4 / params  # 32-value alignment padding
    assert df.loc["torch fp32", "speed_vs_torch_fp32"] == 1.0 and df.loc["torch fp32", "seeds"] == 2
    assert df.loc[df["available"], "acc_mean"].between(0, 100).all()


_QUIET_IMPORTS = {
    "torchao": "from workbench.experiments.packed_bit_optimizers.peer_import import import_peer\n"
               "import_peer('torchao.optim').AdamW8bit\n",
    # transformers imports torchao with its T5 model: Table 2's cell printed the same lines (the cpu build at 5927592)
    "transformers": "from workbench.experiments.packed_bit_optimizers.table2 import T5Classifier, flan_t5_config\n"
                    "T5Classifier(flan_t5_config(64, 1))\n",
}


@pytest.mark.parametrize("library", sorted(_QUIET_IMPORTS))
def test_a_peer_imports_without_torch_s_log_lines(library):
    """Issue 43: importing torchao printed torch's pytree deprecation (and torchao's CUDA-library failures on a CPU
    build) in red in the packed notebook; a fresh interpreter imports it through `import_peer` without a line."""
    import subprocess
    import sys

    pytest.importorskip(library)
    done = subprocess.run([sys.executable, "-c", _QUIET_IMPORTS[library]], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "register_constant" not in done.stderr and "Failed to load" not in done.stderr, done.stderr
    if library == "torchao":
        plain = subprocess.run([sys.executable, "-c", "import torchao.optim"], capture_output=True, text=True,
                               timeout=300)
        assert "register_constant" in plain.stderr  # what it hides (fails once torch or torchao stop logging it)


def test_flashoptim_reads_cuda_only_on_a_cpu_and_its_cpu_path_runs():
    """Issue 46: FlashOptim's own format (int8 moments, 24-bit master, fused) is a row that says it needs CUDA, never a
    gap; the one path its constructor allows on a CPU (bf16 moments, no error bits, unfused) is measured beside it."""
    pytest.importorskip("flashoptim")
    from workbench.experiments.packed_bit_optimizers.peers import FLASH, FLASH_PLAIN

    data = synthetic_images(48, shape=(1, 4, 4), num_classes=3, seed=0)
    train_set, test_set = data.split(0.25, seed=0)
    df = peer_table(lambda: MLP(sizes=(16, 32, 3), activation="relu"), train_set, test_set,
                    methods=["torch fp32", FLASH, FLASH_PLAIN], epochs=1, batch_size=8, seeds=[0], repeats=2,
                    progress=False).set_index("method")
    assert not df.loc[FLASH, "available"] and df.loc[FLASH, "note"].startswith("unavailable: CUDA only")
    plain = df.loc[FLASH_PLAIN]
    assert plain["available"] and plain["version"] == "0.1.4"
    params = int(plain["params"])  # bf16 weights, gradients and two bf16 moments: 8 bytes a parameter
    assert 8.0 <= plain["bytes_per_param"] <= 8.0 + 64 / params and plain["speed_vs_torch_fp32"] > 0
