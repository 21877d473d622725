"""The fp16 probe: its decision from injected times (no wall-clock asserts), its record, the cache, CUDA untimed."""

import pytest
import torch

import workbench.dtype_probe as dp
from workbench.dtype_probe import SLOW_FACTOR, Fp16Probe, fp16_decision, probe_fp16


def _times(conv=1.0, linear=1.0, bf16=1e-3):
    """Seconds per kernel and dtype with fp16 at ``conv`` / ``linear`` x bf16's time."""
    return {"conv3x3": {"fp32": 2 * bf16, "bf16": bf16, "fp16": conv * bf16},
            "linear": {"fp32": 2 * bf16, "bf16": bf16, "fp16": linear * bf16}}


@pytest.mark.parametrize("conv, linear, fast", [
    (1.0, 1.0, True),            # fp16 kernels of its own: bf16's speed
    (0.5, 2.0, True),            # a loaded machine's noise either way
    (SLOW_FACTOR, 1.0, True),    # at the threshold: not over it
    (SLOW_FACTOR * 1.01, 1.0, False),
    (240.0, 1.2, False),         # the Intel Sapphire Rapids convolution (5.5 s vs 23 ms)
    (20.0, 13.0, False),         # the AMD Zen 4 measured by this probe
    (1.0, 15.0, False),          # either kernel slow is slow
])
def test_decision_reads_the_fp16_over_bf16_ratio(conv, linear, fast):
    got, reason = fp16_decision(_times(conv, linear), cpu="Some CPU")
    assert got is fast
    assert reason.startswith("Some CPU: ") and ("fast here" if fast else "slow here") in reason
    assert f"conv3x3 {conv:.1f}x" in reason and "1.00 ms" in reason
    if not fast:
        assert ("conv3x3" in reason.split("slow here")[1]) is (conv > SLOW_FACTOR)


def test_decision_factor_and_bad_input():
    assert fp16_decision(_times(conv=6.0), factor=8.0)[0] and not fp16_decision(_times(conv=6.0))[0]
    with pytest.raises(ValueError, match="factor=1"):
        fp16_decision(_times(), factor=1)
    with pytest.raises(ValueError, match="'bf16' and 'fp16'"):
        fp16_decision({"conv3x3": {"fp32": 1.0, "bf16": 1.0}})
    with pytest.raises(ValueError, match="'bf16' and 'fp16'"):
        fp16_decision({})


def test_record_from_injected_times():
    probe = Fp16Probe.from_seconds(_times(conv=200.0, linear=3.0), cpu="Intel Xeon", factor=4.0)
    assert not probe.fp16_fast and probe.device == "cpu" and probe.ratios == pytest.approx(
        {"conv3x3": 200.0, "linear": 3.0})
    assert probe.summary == "fp16 / bf16 time: conv3x3 200x, linear 3.0x"
    frame = probe.frame()
    assert list(frame["kernel"]) == ["conv3x3", "linear"] and not frame["fp16_fast"].any()
    assert frame["fp16_over_bf16"].tolist() == pytest.approx([200.0, 3.0]) and (frame["reason"] == probe.reason).all()
    untimed = Fp16Probe("cuda:0", "host", True, "CUDA").frame()
    assert len(untimed) == 1 and untimed["fp16_s"].isna().all() and untimed["fp16_fast"].all()


def test_probe_decides_from_what_it_timed_and_caches_per_device(monkeypatch):
    monkeypatch.setattr(dp, "_CACHE", {})
    calls = []

    def fake_time(device, rounds, budget_s):
        calls.append((device.type, torch.get_num_threads()))
        return _times(conv=50.0, linear=9.0)

    monkeypatch.setattr(dp, "_time", fake_time)
    threads = torch.get_num_threads()
    probe = probe_fp16("cpu")
    assert not probe.fp16_fast and "slow here" in probe.reason and probe.cpu in probe.reason
    assert calls == [("cpu", 1)] and torch.get_num_threads() == threads  # timed on one thread, restored
    assert probe_fp16() is probe and len(calls) == 1  # cached
    assert probe_fp16(refresh=True) is not probe and len(calls) == 2
    with pytest.raises(ValueError, match="rounds=0"):
        probe_fp16(rounds=0, refresh=True)


def test_cuda_is_fast_and_not_timed(monkeypatch):
    monkeypatch.setattr(dp, "_CACHE", {})
    monkeypatch.setattr(dp, "_time", lambda *a: pytest.fail("CUDA is not timed"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    probe = probe_fp16("cuda:0")
    assert probe.fp16_fast and probe.seconds == {} and probe.reason.startswith("NVIDIA H200: CUDA")


def test_the_real_probe_times_every_kernel_and_dtype(monkeypatch):
    monkeypatch.setattr(dp, "_CACHE", {})
    state = torch.random.get_rng_state()
    probe = probe_fp16("cpu", rounds=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert set(probe.seconds) == {k for k, _ in dp.KERNELS}
    assert all(t > 0 for s in probe.seconds.values() for t in s.values())
    assert probe.fp16_fast == fp16_decision(probe.seconds, cpu=probe.cpu)[0]
