"""Cross-compiling the kernel without a GPU (NVRTC): resources within each target's limits, header
changes tracked, compile errors quoted with their source lines."""

import dataclasses
import shutil

import pytest

from kdtree.kernel import (
    ARCH_LIMITS,
    SOURCE,
    KernelCompileError,
    KernelConfig,
    compile_report,
    nvrtc_compile,
    nvrtc_ptx,
    parse_ptxas,
    source_files,
    source_hash,
)

pytest.importorskip("cuda.bindings", reason="NVRTC not installed (pip install -e '.[nvrtc]')")


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_kernel_fits_the_target_without_spills(arch):
    reports = {r.name: r for r in compile_report(arch)}
    assert set(reports) == {"verify_mla_fwd", "verify_mla_merge"}
    fwd = reports["verify_mla_fwd"]
    assert fwd.ok, fwd.line()
    assert fwd.spill_loads == fwd.spill_stores == 0
    assert fwd.static_smem + fwd.dynamic_smem <= ARCH_LIMITS[arch]["smem_per_block"]
    # dynamic_smem is the config's: the compile itself proves the kernel uses exactly that (VMLA_SMEM_BYTES)


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_a_wrong_shared_memory_size_fails_the_compile(arch):
    """The source checks the size the host launches with against its own (a static_assert on VMLA_SMEM_BYTES)."""

    class MiscountedConfig(KernelConfig):
        @property
        def smem_bytes(self) -> int:
            return super().smem_bytes + 16

    config = KernelConfig.for_arch(arch)
    wrong = MiscountedConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    with pytest.raises(KernelCompileError, match="VMLA_SMEM_BYTES"):
        nvrtc_compile(arch, wrong)


def test_every_candidate_configuration_fits_without_spills():
    """sm_90 also runs the 32-row configuration (small batches): it must fit there as well."""
    for arch in ("sm_120", "sm_90"):
        for config in KernelConfig.candidates(arch):
            (fwd,) = [r for r in compile_report(arch, config) if r.name == "verify_mla_fwd"]
            assert fwd.ok and fwd.bm == config.bm, fwd.line()


@pytest.mark.parametrize("switches", [(("VMLA_FAST_MASK", 0),)], ids=["per-key-mask"])
def test_optional_switches_compile_and_fit(switches):
    """Switches off by default (the per-key mask, the bit-equality reference) still compile, without spills,
    everywhere."""
    for arch in ("sm_120", "sm_90"):
        for config in KernelConfig.candidates(arch):
            (fwd,) = [r for r in compile_report(arch, dataclasses.replace(config, extra=switches)) if r.name == "verify_mla_fwd"]
            assert fwd.ok, fwd.line()


def test_64_rows_with_q_in_registers_fit_sm120_without_spills():
    """The 64-row mma.sync configuration within sm_120's limits (`KernelConfig.rows64_in_registers`): its shared
    memory (4 stages of 16 keys, Q staged over them, unpadded swizzled partial scores) under the 101,376 B, and no
    spills on sm_120. (Its sm_90 build, which an H200 runs it as, spills up to 40 B: docs/kernel-design.md.)"""
    config = KernelConfig.rows64_in_registers()
    assert config.smem_bytes <= ARCH_LIMITS["sm_120"]["smem_per_block"] < dataclasses.replace(config, extra=()).smem_bytes
    (fwd,) = [r for r in compile_report("sm_120", config) if r.name == "verify_mla_fwd"]
    assert fwd.ok and fwd.spill_stores == fwd.spill_loads == 0 and fwd.bm == 64, fwd.line()


def test_sm120_configuration_is_under_the_99kb_cliff():
    assert KernelConfig.for_arch("sm_120").smem_bytes <= 101_376
    assert KernelConfig.for_arch("sm_90").smem_bytes > 101_376  # the Hopper config uses its larger shared memory


def test_limits_are_enforced():
    too_big = KernelConfig(stages=3)  # 3 stages of 32 pool rows do not fit sm_120
    (fwd,) = [r for r in compile_report("sm_120", too_big) if r.name == "verify_mla_fwd"]
    assert not fwd.ok and "shared memory" in fwd.problems[0]


def test_ptxas_report_parsing():
    log = (
        "ptxas info    : Compiling entry function 'verify_mla_fwd' for 'sm_120'\n"
        "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem\n"
    )
    (r,) = parse_ptxas(log, "sm_120", KernelConfig())
    assert (r.registers, r.stack_bytes, r.spill_stores, r.spill_loads, r.static_smem) == (255, 8, 12, 16, 1024)
    assert not r.ok and "spills" in r.problems[0]


def test_serialised_wgmma_is_a_failure():
    """ptxas's note that it serialised a function's wgmma (C7520: a wgmma under a branch it cannot prove
    warpgroup-uniform) fails that function's report, and only that function's."""
    entry = (
        "ptxas info    : Compiling entry function '{}' for 'sm_90a'\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 200 registers, used 1 barriers\n"
    )
    note = (
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "program dependence on compiler-inserted WG.AR in divergent path in the function 'verify_mla_fwd'\n"
    )
    config = KernelConfig.for_arch("sm_90")
    fwd, merge = parse_ptxas(note + entry.format("verify_mla_fwd") + entry.format("verify_mla_merge"), "sm_90a", config)
    assert not fwd.ok and fwd.problems == ["wgmma serialised by ptxas (C7520)"] and "C7520" in fwd.line()
    assert merge.ok
    (clean,) = parse_ptxas(entry.format("verify_mla_fwd"), "sm_90a", config)
    assert clean.ok


@pytest.fixture
def kernel_copy(tmp_path):
    for p in source_files():
        shutil.copy(p, tmp_path / p.name)
    return tmp_path / SOURCE.name


def test_header_changes_change_the_source_hash(kernel_copy):
    before = source_hash(kernel_copy)
    header = kernel_copy.parent / "verify_mla_config.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert source_hash(kernel_copy) != before


def test_every_body_header_is_a_source_file():
    """The body headers are included under #if (one body a build): the source hash still covers every one."""
    names = {p.name for p in source_files()}
    bodies = {p.name for p in SOURCE.parent.glob("verify_mla_body_*.cuh")}
    assert len(bodies) == 5 and bodies | {"verify_mla_wgmma_common.cuh"} <= names


def test_compile_errors_quote_the_offending_line(kernel_copy):
    text = kernel_copy.read_text().replace("const int b = rt_request[rt];", "const int b = rt_request[rt] +;", 1)
    kernel_copy.write_text(text)
    with pytest.raises(KernelCompileError) as e:
        nvrtc_compile("sm_120", source=kernel_copy)
    msg = str(e.value)
    assert "verify_mla.cu(" in msg and "error" in msg
    assert "| " in msg and "rt_request[rt] +;" in msg  # the source line, quoted under the error


@pytest.mark.parametrize(
    "stages,pipe,split",
    [(2, 0, False), (3, 0, False), (3, 1, False), (4, 0, True)],
    ids=["dims_split-2-stages", "dims_split-3-stages", "dims_split-pipelined", "split_keys"],
)
def test_wgmma_variants_compile_and_fit(stages, pipe, split):
    """The Hopper segment's loop variants (the default split_keys splits the keys of a 64-key step, 4 stages;
    dims_split, the warpgroups splitting a tile's dims, unpipelined or pipelined) compile for sm_90a without spills
    and within its shared memory; `smem_bytes` is what the launch asks for."""
    config = dataclasses.replace(KernelConfig.for_arch("sm_90"), stages=stages, wg_pipe=pipe, split_keys=split)
    (fwd,) = [r for r in compile_report("sm_90", config) if r.name == "verify_mla_fwd"]
    assert fwd.ok and fwd.arch == "sm_90a", fwd.line()  # compiled: its shared memory is config.smem_bytes


@pytest.mark.parametrize(
    "extra",
    [
        (("VMLA_TRACE", 132),),
        tuple((f"VMLA_SKIP_{k}", 1) for k in ("QK", "PV", "SOFTMAX", "EXCHANGE", "LOAD")),
        (("VMLA_PHASES", 1),),
    ],
    ids=["trace", "skips", "phases"],
)
def test_wgmma_experiment_builds_compile(extra):
    """The timing builds tools/trace_case.py, tools/variants.py and tools/phase_profile.py ask for (block
    timelines, parts of each tile left out, cycles a step by phase) still compile for sm_90a, without spills."""
    config = dataclasses.replace(KernelConfig.for_arch("sm_90"), extra=extra)
    (fwd,) = [r for r in compile_report("sm_90", config) if r.name == "verify_mla_fwd"]
    assert fwd.ok and fwd.arch == "sm_90a" and fwd.spill_stores == 0, fwd.line()


def test_mma_repeat_issues_every_mma_twice_in_sm120s_limits():
    """tools/variants.py --mma-repeat 2 (VMLA_MMA_REPEAT, the tensor rate of a part with half the H200's per
    SM-cycle): the sm_120 configuration's forward kernel asks for exactly twice the MMAs, still without spills in
    101,376 B; the default build asks for one each."""
    config = KernelConfig.for_arch("sm_120")
    counts = {}
    for repeat in (1, 2):
        built = config.with_defines([f"VMLA_MMA_REPEAT={repeat}"])
        counts[repeat] = nvrtc_ptx("sm_120", built).count("mma.sync.aligned")
        (fwd,) = [r for r in compile_report("sm_120", built) if r.name == "verify_mla_fwd"]
        assert fwd.ok and fwd.spill_stores == 0, fwd.line()
    assert counts[1] > 0 and counts[2] == 2 * counts[1]
    assert nvrtc_ptx("sm_120", config).count("mma.sync.aligned") == counts[1]


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
@pytest.mark.parametrize("extra", [(), ("-DVMLA_MMA_REPEAT=2", "-DVMLA_CEILING_CHAINS=2")], ids=["bench", "repeated"])
def test_mma_ceiling_microkernels_compile_without_spills(arch, extra):
    """kdtree bench's mma.sync ceilings (kernels/mma_ceiling.cu), and one of the builds tools/variants.py
    --mma-ceilings asks for (every MMA twice, 2 accumulators a warp): both entry points, registers only, no local
    memory."""
    from kdtree.ceilings import KERNELS, SOURCE

    _, log = nvrtc_compile(arch, KernelConfig(), extra, source=SOURCE)
    reports = {r.name: r for r in parse_ptxas(log, arch, KernelConfig())}
    assert set(reports) == set(KERNELS)
    for r in reports.values():
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0 and r.registers <= 64, r.line()


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_gather_ceiling_microkernels_compile_without_spills(arch):
    """kdtree bench's gather ceilings (kernels/gather_ceiling.cu): every entry point GATHERS names, no local memory."""
    from kdtree.ceilings import GATHER_SOURCE, GATHERS

    _, log = nvrtc_compile(arch, KernelConfig(), source=GATHER_SOURCE)
    reports = {r.name: r for r in parse_ptxas(log, arch, KernelConfig())}
    assert set(reports) == {f"gather_{stages}" for stages, _ in GATHERS.values()}
    for r in reports.values():
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0 and r.registers <= 64, r.line()
