"""Device choice, the environment record and seeding."""

import pytest
import torch

from workbench.devices import ISA_FLAGS, cpu_features, environment, isa_summary, pick_device, seed_everything


def test_devices(monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert pick_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="not supported"):
        pick_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda")
    env = environment("cpu")
    assert {"torch", "device_name", "threads", "cpu_model", "git_commit"} <= set(env)
    seed_everything(3)
    a = torch.rand(3)
    seed_everything(3)
    assert torch.equal(a, torch.rand(3))


# /proc/cpuinfo of the two kinds of machine the reports are built on (one processor each, trimmed to the
# lines that matter): AMD EPYC Zen 4 (AVX-512 with BF16 and VBMI, no AMX, no AVX512-FP16) and Intel Xeon
# Sapphire Rapids (AVX-512 with VBMI, BF16 and FP16, and AMX).
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext lm pni pclmulqdq \
ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 smep bmi2 erms invpcid avx512f \
avx512dq rdseed adx avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl avx512_bf16 avx512vbmi \
avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm

"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ss ht syscall nx lm pni pclmulqdq ssse3 \
fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq \
rdseed adx avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni vaes \
vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid movdiri movdir64b serialize tsxldtrk amx_bf16 \
avx512_fp16 amx_tile amx_int8 avx_vnni avx512_bf16

"""


def test_cpu_features_read_both_kinds_of_machine(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    amd, intel = cpu_features(ZEN4), cpu_features(SAPPHIRE_RAPIDS)
    assert amd["cpu_model"] == "AMD EPYC 9654 96-Core Processor"
    assert intel["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert set(amd["cpu_flags"]) == set(intel["cpu_flags"]) == set(ISA_FLAGS)
    assert {f for f, on in amd["cpu_flags"].items() if not on} == {"amx_bf16", "amx_tile", "amx_int8",
                                                                   "avx512_fp16"}
    assert all(intel["cpu_flags"].values())
    for features in (amd, intel):  # torch's own choice is this machine's, whatever the text says
        assert features["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())
        assert features["onednn_max_cpu_isa"] is None
    cap = amd["cpu_capability"] if amd["cpu_capability"] != "AVX512" else None
    assert amd["cpu_isa"] == "AVX-512 BF16" + (f", torch {cap}" if cap else "")
    assert intel["cpu_isa"] == "AVX-512 BF16 FP16, AMX-BF16" + (f", torch {cap}" if cap else "")


def test_isa_summary_names_caps_and_what_it_cannot_read(monkeypatch):
    flags = cpu_features(SAPPHIRE_RAPIDS)["cpu_flags"]
    assert isa_summary({"cpu_flags": flags, "cpu_capability": "AVX512",
                        "onednn_max_cpu_isa": "AVX512_CORE_BF16"}) == (
        "AVX-512 BF16 FP16, AMX-BF16, oneDNN max AVX512_CORE_BF16")
    assert isa_summary({"cpu_flags": flags, "cpu_capability": "AVX2"}) == "AVX-512 BF16 FP16, AMX-BF16, torch AVX2"
    avx2 = {f: f in ("avx2", "fma", "f16c") for f in ISA_FLAGS}
    assert isa_summary({"cpu_flags": avx2, "cpu_capability": "AVX2"}) == "AVX2 FMA"
    assert isa_summary({"cpu_flags": None, "cpu_capability": "DEFAULT"}) == "ISA unknown, torch DEFAULT"
    assert isa_summary({}) == "ISA unknown"
    # no flags line (not x86, or not Linux): flags unknown, never all absent
    assert cpu_features("processor\t: 0\nFeatures\t: fp asimd\n")["cpu_flags"] is None
    assert cpu_features("")["cpu_flags"] is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_features(ZEN4)["onednn_max_cpu_isa"] == "AVX512_CORE_BF16"
    assert cpu_features(ZEN4)["cpu_isa"].endswith("oneDNN max AVX512_CORE_BF16")


def test_the_environment_record_names_this_machine():
    env = environment("cpu")
    assert {"cpu_model", "cpu_flags", "cpu_capability", "onednn_max_cpu_isa", "cpu_isa"} <= set(env)
    assert env["cpu_isa"] == isa_summary(env)
    assert env["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())
    try:
        line = next(x for x in open("/proc/cpuinfo").read().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        assert env["cpu_flags"] is None
    else:
        assert env["cpu_flags"]["avx2"] == ("avx2" in line.split())
