"""Is fp16 training fast on this device? A short probe, timed once per process.

Issue 48 (part 3, "Sensible dtypes on a CPU"). A CPU without fast fp16 kernels trains in fp16 tens to
hundreds of times slower than in bf16, which moves the same bytes: on an Intel Xeon Sapphire Rapids (AMX-BF16,
no AMX-FP16) a 32-channel 3x3 convolution at batch 16, 32 x 32 took 27 ms forward and 5.5 s forward+backward
in fp16, against 23 ms for both in bf16 (50 ms in fp32); the packed-bit notebook's fp16 memory table took 527
of its 809 s there. On an AMD EPYC Zen 4 (AVX512-BF16, no fp16 arithmetic) the same convolution's fp16
forward+backward is 30-40x bf16's, and a ResNet-18 x0.5 training step ~30x. On CUDA fp16 runs on tensor cores.

`probe_fp16` times forward+backward of one 3x3 convolution and one linear layer in fp32, bf16 and fp16
(interleaved rounds, the fastest of each: 0.2 s in all on the AMD Zen 4; about 1 s estimated on the Intel
CPU from its convolution's figure, as the rounds stop once ``budget_s`` has passed),
and `fp16_decision` reads the times: fp16 is slow where either kernel's fp16 time is over `SLOW_FACTOR` x
bf16's. On CUDA nothing is timed: fp16 is fast. The result is cached per device for the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F

from workbench.devices import cpu_features

__all__ = ["KERNELS", "SLOW_FACTOR", "Fp16Probe", "fp16_decision", "probe_fp16"]

# NOTE: 4x. Where fp16 has kernels of its own (CUDA, a CPU with fp16 matrix units) it moves bf16's bytes at
# about bf16's speed: a ratio near 1 (0.5-2 with a loaded machine's noise). Where it has none the ratio
# measured 13-23x on this probe's kernels on an AMD Zen 4 (30x for a whole ResNet-18 step) and ~240x for
# the Intel convolution above. 4x sits a factor 2 above the noise's top and 3x or more below the slow
# machines' lowest ratio, so neither kind of CPU is a borderline call; and a section 4x slower than its bf16
# twin turns one minute into several, which is what the issue asks not to spend unannounced.
SLOW_FACTOR = 4.0
#: The kernels timed: (name, what it is). The convolution is Table 3's ResNet-18 x0.5 first stage at a
#: quarter of its batch and of its image's area; the linear layer an MLP layer of the Fig 2 / accuracy models.
KERNELS = (("conv3x3", "3x3 convolution, 32 -> 32 channels, batch 4, 16 x 16"),
           ("linear", "linear layer 512 -> 512, batch 32"))
DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))


def fp16_decision(seconds: Mapping[str, Mapping[str, float]], *, factor: float = SLOW_FACTOR,
                  cpu: str = "") -> tuple[bool, str]:
    """(fp16 is fast, why) from forward+backward seconds per kernel and dtype (``{"conv3x3": {"bf16": s,
    "fp16": s, ...}, ...}``): slow where any kernel's fp16 time is over ``factor`` x its bf16 time."""
    if factor <= 1:
        raise ValueError(f"factor={factor} must be > 1 (fp16 slower than bf16 by more than this is slow)")
    if not seconds or any({"bf16", "fp16"} - set(s) for s in seconds.values()):
        raise ValueError(f"seconds must give 'bf16' and 'fp16' times for each kernel, got {dict(seconds)}")
    ratios = {k: s["fp16"] / s["bf16"] for k, s in seconds.items()}
    slow = [k for k, r in ratios.items() if r > factor]
    times = ", ".join(f"{k} {r:.1f}x ({seconds[k]['fp16'] * 1e3:.2f} vs {seconds[k]['bf16'] * 1e3:.2f} ms)"
                      for k, r in ratios.items())
    where = f"{cpu}: " if cpu else ""
    verdict = (f"fp16 is slow here (over {factor:g}x bf16 for {', '.join(slow)})" if slow
               else f"fp16 is fast here (within {factor:g}x bf16)")
    return not slow, f"{where}fp16 forward+backward / bf16's: {times}; {verdict}"


@dataclass(frozen=True)
class Fp16Probe:
    """What the probe found on one device: ``fp16_fast`` and why (``reason``: the CPU model and the measured
    times), the seconds per kernel and dtype (empty where nothing was timed: CUDA)."""

    device: str
    cpu: str
    fp16_fast: bool
    reason: str
    factor: float = SLOW_FACTOR
    seconds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @classmethod
    def from_seconds(cls, seconds: Mapping[str, Mapping[str, float]], *, device: str = "cpu", cpu: str = "",
                     factor: float = SLOW_FACTOR) -> Fp16Probe:
        """The record `fp16_decision` gives for these times (tests inject times this way)."""
        fast, reason = fp16_decision(seconds, factor=factor, cpu=cpu)
        return cls(device, cpu, fast, reason, factor, {k: dict(v) for k, v in seconds.items()})

    @property
    def ratios(self) -> dict[str, float]:
        """fp16 seconds / bf16 seconds per kernel."""
        return {k: s["fp16"] / s["bf16"] for k, s in self.seconds.items()}

    @property
    def summary(self) -> str:
        """The ratios in a few words ('fp16 / bf16 time: conv3x3 23x, linear 13x'), for a table's note."""
        if not self.seconds:
            return self.reason
        return "fp16 / bf16 time: " + ", ".join(f"{k} {r:.0f}x" if r >= 10 else f"{k} {r:.1f}x"
                                                for k, r in self.ratios.items())

    def frame(self) -> pd.DataFrame:
        """One row per kernel timed (one row without times on CUDA), for a notebook's records."""
        what, untimed = dict(KERNELS), {"kernel": "none timed", "shape": ""}
        rows = [{"kernel": k, "shape": what.get(k, ""), **{f"{d}_s": s.get(d) for d, _ in DTYPES},
                 "fp16_over_bf16": s["fp16"] / s["bf16"]} for k, s in self.seconds.items()] or [untimed]
        columns = ["kernel", "shape", *(f"{d}_s" for d, _ in DTYPES), "fp16_over_bf16"]
        return pd.DataFrame(rows, columns=columns).assign(device=self.device, cpu=self.cpu, threshold=self.factor,
                                                          fp16_fast=self.fp16_fast, reason=self.reason)


def _kernel(name: str, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG alone

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    if name == "conv3x3":
        w, x = leaf(32, 32, 3, 3), leaf(4, 32, 16, 16)
        return lambda: F.conv2d(x, w, padding=1).float().sum().backward()
    w, x = leaf(512, 512), leaf(32, 512)
    return lambda: F.linear(x, w).float().sum().backward()


def _time(device: torch.device, rounds: int, budget_s: float) -> dict[str, dict[str, float]]:
    calls = {(k, d): _kernel(k, dt, device) for k, _ in KERNELS for d, dt in DTYPES}
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():  # warm-up: oneDNN builds its primitives on the first call
        fn()
    start = time.perf_counter()
    for _ in range(rounds):  # interleaved, so load from other processes hits every dtype alike
        for key, fn in calls.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[key] = min(best[key], time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {k: {d: best[(k, d)] for d, _ in DTYPES} for k, _ in KERNELS}


_CACHE: dict[tuple[str, float], Fp16Probe] = {}


def probe_fp16(device: torch.device | str | None = None, *, factor: float = SLOW_FACTOR, rounds: int = 3,
               budget_s: float = 1.0, refresh: bool = False) -> Fp16Probe:
    """Whether fp16 training is fast on ``device`` (default CPU); timed once per process and device.

    CUDA: fast, nothing timed. Elsewhere: `KERNELS` forward+backward in fp32, bf16 and fp16, ``rounds``
    interleaved rounds (fewer once ``budget_s`` has passed), the fastest round of each, on one intra-op
    thread; `fp16_decision` at ``factor``. ``refresh`` times again.
    """
    device = torch.device(device if device is not None else "cpu")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    key = (str(device), float(factor))
    if key in _CACHE and not refresh:
        return _CACHE[key]
    features = cpu_features()
    cpu = f"{features['cpu_model']} ({features['cpu_isa']})" if features.get("cpu_isa") else features["cpu_model"]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        probe = Fp16Probe(str(device), cpu, True, f"{name}: CUDA runs fp16 on tensor cores (not timed)", factor)
    else:
        # NOTE: one intra-op thread while timing: on a 2-core machine shared with other processes, OpenMP's
        # spinning threads made every dtype's call ~50-100 ms (ratio ~1, 'fast') where one thread measured
        # fp16 at 13-20x bf16. A kernel with no fp16 path is slow per element at any thread count.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            seconds = _time(device, rounds, budget_s)
        finally:
            torch.set_num_threads(threads)
        probe = Fp16Probe.from_seconds(seconds, device=str(device), cpu=cpu, factor=factor)
    _CACHE[key] = probe
    return probe
