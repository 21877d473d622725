"""AllocatorMeter, the independent measure: exact on plain allocations, and MemoryMeter's tensor count
validated against it on every model family (equal where no kernel keeps scratch, below it where one does),
over the same step run plainly: the program the meter counts must be the user's."""

import contextlib
import gc
import os

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.kineto import without_kineto_markers
from workbench.measure import AllocatorMeter, MemoryMeter, allocator_events, allocator_trace
from workbench.timing import kernel_seconds
from workbench.vbs import measure_layers


def _allocations(device="cpu"):
    a = torch.empty(2_500_000, dtype=torch.uint8, device=device)
    b = torch.empty(10_000_000, dtype=torch.uint8, device=device)
    del a
    c = torch.empty(1_000_000, dtype=torch.uint8, device=device)
    return b, c


def test_plain_allocations_are_counted_exactly_and_relative_to_entry():
    before = torch.empty(3_000_000, dtype=torch.uint8)  # allocated before entry, freed inside: not seen
    with AllocatorMeter("cpu") as meter:
        kept = _allocations()
        del before
    assert (meter.peak_bytes, meter.end_bytes) == (12_500_000, 11_000_000)
    assert meter.reserved_peak_bytes is None
    del kept


def test_a_free_of_an_older_block_at_an_address_an_earlier_meter_saw_is_not_counted():
    """c10's CPU reporter keeps the size of a block allocated under a profiler and freed outside one; a later
    block at the same address, allocated before entry and freed inside, was freed with that stale size."""
    reused = []
    # 256 MiB: above glibc's largest mmap threshold, so the block is unmapped on free and a block of the same size
    # mapped next takes its address back
    for size in (1_000, 100_000, 1_000_000, 10_000_000, 2**28):
        with AllocatorMeter("cpu"):
            seen = torch.empty(size, dtype=torch.uint8)
        address = seen.data_ptr()
        del seen  # outside any profiler: its size stays in the reporter's table
        before = torch.empty(size, dtype=torch.uint8)
        reused.append(before.data_ptr() == address)
        with AllocatorMeter("cpu") as meter:
            kept = torch.empty(size // 4, dtype=torch.uint8)
            del before
        assert (meter.peak_bytes, meter.end_bytes) == (size // 4, size // 4), size
        del kept
    if not any(reused):
        pytest.skip("this allocator reused no address: the stale size was never met")


def test_memory_meter_reports_both_counts_from_one_block():
    with MemoryMeter("cpu", allocator=True) as meter:
        kept = _allocations()
    assert meter.peak_bytes == meter.allocator_peak_bytes == 12_500_000
    del kept
    plain = MemoryMeter("cpu")
    with plain:
        pass
    assert plain.allocator_peak_bytes is None


def _step(model, x, opt, loss=None):
    def step():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        (loss(out) if loss is not None else out.float().pow(2).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


class SelfAttention(nn.Module):
    """`nn.MultiheadAttention` on its own input behind a projection, with a residual connection: three
    gradients and the residual's meet at `h`, and the in-projection adds its bias to a transposed input."""

    def __init__(self, need_weights: bool = True) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 10)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        h = self.proj(x)
        return self.head((h + self.attn(h, h, h, need_weights=self.need_weights)[0]).mean(1))


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 10)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.head(self.layer(self.proj(x)).mean(1))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 256, hidden: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(32, width), nn.Linear(width, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                                    for _ in range(depth))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class TiedLM(nn.Module):
    """Token embedding, one residual MLP block, output projection tied to the embedding."""

    def __init__(self, vocab: int = 512, width: int = 32) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.norm(h + self.mlp(h)) @ self.embed.weight.t()


def _next_token_loss(logits):
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1],
                                                                          dtype=torch.long))


# NOTE: what the tensor count cannot see. "scratch": kernels' internal buffers (BatchNorm, oneDNN's LSTM, the
# backward of CPU flash attention, which `need_weights=False` runs), the blind spot an independent measure
# exists for. "numbers": Python numbers that C++ wraps into 8-byte tensors without dispatching an op, live at
# the peak: kept for backward where a product takes one (`q * scaling` in nn.MultiheadAttention), or Adam's
# bias corrections where its step is the peak (a small MLP). None: nothing.
FAMILIES = {  # model, input, loss (None: mean square), what the tensor count cannot see
    "mlp": (lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), (32, 64), None, "numbers"),
    "gru": (lambda: nn.GRU(16, 32, batch_first=True), (8, 10, 16), None, None),
    "transformer": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1),
                    (4, 16, 32), None, None),
    "cnn_batchnorm": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                            nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
                                            nn.Linear(16 * 32 * 32, 10)), (8, 3, 32, 32), None, "scratch"),
    "lstm": (lambda: nn.LSTM(16, 32, 2, batch_first=True), (8, 10, 16), None, "scratch"),
    # models as users write them, whose gradients meet (residuals, tied weights, self-attention)
    "mha self-attention": (SelfAttention, (16, 12, 16), None, "numbers"),
    "sdpa self-attention": (lambda: SelfAttention(need_weights=False), (16, 12, 16), None, "scratch"),
    "encoder layer": (EncoderLayer, (16, 12, 16), None, None),
    "residual mlp": (ResidualMLP, (64, 32), None, None),
    "tied lm": (TiedLM, "tokens", _next_token_loss, None),
}


def family_step(family: str):
    """A training step of `family` in its steady state (optimizer state allocated)."""
    build, shape, loss, _ = FAMILIES[family]
    model = build()
    x = torch.randint(0, 512, (4, 16)) if shape == "tokens" else torch.randn(shape)
    step = _step(model, x, torch.optim.Adam(model.parameters()), loss)
    step()
    return step


def counted_and_allocated(step) -> tuple[int, int]:
    """`step`'s peak counted by MemoryMeter, and the allocator's peak of the same step run plain (no dispatch
    mode), each after a collection."""
    gc.collect()
    with AllocatorMeter("cpu") as plain:
        step()
    gc.collect()
    with MemoryMeter("cpu") as meter:
        step()
    return meter.peak_bytes, plain.peak_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_count_against_the_allocator_of_a_plain_run(family, one_thread):
    """MemoryMeter's peak against the allocator's over the same step run without any dispatch mode: the
    user's program (a dispatch mode changes what torch runs, `workbench/inplace.py`)."""
    blind = FAMILIES[family][3]
    tensors, allocator = counted_and_allocated(family_step(family))
    assert tensors <= allocator, (tensors, allocator)  # the tracker never sees more than the allocator hands out
    if blind == "scratch":
        assert allocator > 1.05 * tensors, (tensors, allocator)
    elif blind == "numbers":
        assert 0 < allocator - tensors <= 16, (tensors, allocator)  # one or two of them
    else:
        assert tensors == allocator, (tensors, allocator)


def test_bad_device_and_a_running_profiler_are_refused():
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        AllocatorMeter("meta")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already running"):
            AllocatorMeter("cpu").__enter__()


@requires_cuda
def test_cuda_counts_allocated_and_reserved():
    with MemoryMeter("cuda", allocator=True) as meter:
        kept = _allocations("cuda")
    assert meter.allocator_peak_bytes == meter.peak_bytes >= 12_500_000
    assert meter.reserved_peak_bytes >= meter.peak_bytes
    del kept


def test_the_allocator_trace_holds_one_device_s_events():
    with allocator_events() as profiler:
        kept = torch.empty(1 << 20, dtype=torch.uint8)
    assert (pytest.approx(1 << 20, abs=4096) == sum(n for _, n in allocator_trace(profiler, "cpu")))
    assert allocator_trace(profiler, "cuda") == [] and allocator_trace(profiler, "cuda:1") == []
    del kept


@requires_cuda
def test_the_cuda_allocator_trace_is_what_max_memory_allocated_counts():
    # calibration on CUDA reads these events per op call: their running sum peaks where the allocator's does
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with allocator_events(device="cuda") as profiler:
        a = torch.empty(3_000_001, dtype=torch.uint8, device="cuda")
        b = torch.empty(5_000_000, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(1_000, dtype=torch.uint8, device="cuda")
    level = peak = 0
    for _, nbytes in allocator_trace(profiler, "cuda"):
        level += nbytes
        peak = max(peak, level)
    assert peak == torch.cuda.max_memory_allocated() - start and level == torch.cuda.memory_allocated() - start
    del b, c


def test_kineto_markers_stay_off_stderr(capfd):
    """kineto writes `USDT: ... profiler_start` / `profiler_stop` from C++ to fd 2 at every profiler start and
    stop (red stderr blocks in notebooks and reports); the meter's blocks write none of them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass
    raw = capfd.readouterr().err
    if "USDT:" not in raw:
        pytest.skip("this torch's kineto prints no start/stop markers: nothing to keep off stderr")
    with AllocatorMeter("cpu") as meter:
        kept = _allocations()
    with MemoryMeter("cpu", allocator=True):
        pass
    with allocator_events("calibration") as profiler:
        pass
    kernel_seconds(lambda: torch.ones(8).sum(), calls=1)  # the timing's profiler, and VBS's per-layer pass
    measure_layers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(4), 2, repeats=1,
                   min_run_time=0.0)
    assert meter.peak_bytes == 12_500_000 and profiler.profiler.kineto_results is not None
    err = capfd.readouterr().err
    assert "USDT:" not in err and "profiler_st" not in err, err
    del kept


def test_only_kineto_markers_are_held_back_from_stderr(capfd):
    """What else reaches fd 2 while the profiler starts or stops (a warning, another thread's error) is
    written back, in order; only kineto's marker lines are dropped."""
    marker = b"USDT:2026-11-26 15:28:12 12885:12885 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    with without_kineto_markers():
        os.write(2, b"first real line\n" + marker + b"ERROR: a real error, USDT: inside\n")
        os.write(2, marker.replace(b"start", b"stop") + b"no newline at the end")
    assert capfd.readouterr().err == "first real line\nERROR: a real error, USDT: inside\nno newline at the end"
    unseen = (b"[W1127 01:48:25.609280570 CPUAllocator.cpp:245] Memory block of unknown size was allocated before "
              b"the profiling started, profiler results will not include the deallocation event\n")
    with without_kineto_markers():
        os.write(2, b"kept\n" + unseen + b"[W1127 01:48:25.6 CPUAllocator.cpp:1] another warning\n")
    assert capfd.readouterr().err == "kept\n[W1127 01:48:25.6 CPUAllocator.cpp:1] another warning\n"
    with pytest.raises(ValueError, match="inside"), without_kineto_markers():
        os.write(2, b"before the error\n")
        raise ValueError("raised inside")
    assert capfd.readouterr().err == "before the error\n"  # fd 2 restored and flushed on the way out
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="calibration needs torch.profiler, which is already running"):
            with allocator_events("calibration"):
                pass


def test_the_allocator_events_are_the_allocators_and_the_callers_marks_only():
    """No op's range is recorded (`RecordScope.USER_SCOPE`): readers take the allocator's events and their own
    `record_function` marks (calibration's op calls, VBS's layer calls)."""
    with allocator_events() as profiler:
        with torch.profiler.record_function("workbench.test.mark"):
            kept = torch.ones(1 << 18, dtype=torch.uint8) * 2
    names = {e.name() for e in profiler.profiler.kineto_results.events()}
    assert "workbench.test.mark" in names and not any(n.startswith("aten::") for n in names), names
    assert sum(n for _, n in allocator_trace(profiler)) >= 1 << 18
    del kept


def test_a_cuda_device_s_allocator_events_keep_every_scope(monkeypatch):
    """CUDA's caching allocator events have not been seen on a GPU with the ops' ranges left out: there the profiler
    records every scope, as before."""
    import workbench.allocator as allocator

    asked = []
    monkeypatch.setattr(allocator, "quiet_profile", lambda *args, **kwargs: asked.append(kwargs["scopes"]) or
                        contextlib.nullcontext())
    for device in ("cuda", "cuda:1", "cpu"):
        with allocator_events(device=device):
            pass
    assert asked == [None, None, {torch._C._profiler.RecordScope.USER_SCOPE}]


def test_a_torch_whose_profiler_entry_point_takes_no_scopes_records_every_op(monkeypatch):
    enable = torch.autograd.profiler._enable_profiler
    monkeypatch.setattr(torch.autograd.profiler, "_enable_profiler", lambda config, activities: enable(config,
                                                                                                      activities))
    with allocator_events() as profiler:
        kept = torch.ones(1 << 18, dtype=torch.uint8) * 2
    assert any(e.name().startswith("aten::") for e in profiler.profiler.kineto_results.events())
    assert sum(n for _, n in allocator_trace(profiler)) >= 1 << 18
    assert torch.autograd.profiler._enable_profiler.__name__ == "<lambda>"  # handed back after the start
    del kept
