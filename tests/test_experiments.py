"""The experiments' own code (experiments/): their probe kernels still build as their scripts ask, and the L2 model
still runs, so a script in experiments/ can be re-run to check what its README says it found."""

import ast
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kdtree.kernel import KernelConfig, nvrtc_compile, parse_ptxas, plan
from kdtree.marshal import marshal
from kdtree.synth import SynthSpec, synthesize

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _has_nvrtc() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        return False


needs_nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="NVRTC not installed (pip install -e '.[nvrtc]')")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_120", "sm_90a"])
def test_gather_pair_probe_compiles_without_spills(arch):
    """experiments/gather_pair_probe.py's gathers (experiments/kernels/gather_pair_probe.cu): every mode at 2 and 4 stages builds,
    no local memory; on sm_120 ptxas flags the multicast form, the one that does not map to an instruction there."""
    _, log = nvrtc_compile(arch, KernelConfig(), source=EXPERIMENTS / "kernels" / "gather_pair_probe.cu")
    reports = {r.name: r for r in parse_ptxas(log, arch, KernelConfig())}
    assert set(reports) == {f"gather_{m}_{s}" for m in ("bulk", "pair_fwd", "pair_mc", "pair_cp") for s in (2, 4)}
    for r in reports.values():
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0 and r.registers <= 64, r.line()
    assert ("multicast::cluster" in log) == (arch == "sm_120")


def _pair_probe_builds() -> dict:
    """experiments/pair_verify_probe.py's PARTS (name -> -D switches), read from the script without importing it (it
    needs CuPy and a GPU), plus the default build."""
    tree = ast.parse((EXPERIMENTS / "pair_verify_probe.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PARTS"]
    return {"default": (), **ast.literal_eval(node.value)}


@needs_nvrtc
@pytest.mark.parametrize("name", list(_pair_probe_builds()))
def test_pair_verify_probe_builds_fit_sm120(name):
    """Every build experiments/pair_verify_probe.py times (experiments/kernels/pair_verify_probe.cu) compiles for sm_120 without
    spills, so what it measures on the H200 is code an RTX PRO 6000 could run; the source's static_assert holds
    each within sm_120's 101,376 B of shared memory unless the build says PROBE_OVER_LIMIT."""
    defines = _pair_probe_builds()[name]
    _, log = nvrtc_compile("sm_120", KernelConfig(), defines, source=EXPERIMENTS / "kernels" / "pair_verify_probe.cu")
    reports = {r.name: r for r in parse_ptxas(log, "sm_120", KernelConfig())}
    assert set(reports) == {"pair_verify", "pair_verify_smem_bytes"}
    r = reports["pair_verify"]
    assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, r.line()


@needs_nvrtc
@pytest.mark.parametrize("n,a_smem", [(32, 1), (32, 0), (64, 1), (64, 0)], ids=["n32-smem", "n32-regs", "n64-smem", "n64-regs"])
def test_wgmma_probe_compiles_unserialised(n, a_smem):
    """experiments/wgmma_probe.py's QK chains (experiments/kernels/wgmma_probe.cu) build for sm_90a in each shape, without
    spills, and ptxas keeps their wgmmas asynchronous (a serialised chain would time ptxas, not the tensor cores)."""
    config = KernelConfig.for_arch("sm_90")  # (the wgmma configuration: NVRTC targets sm_90a)
    source = EXPERIMENTS / "kernels" / "wgmma_probe.cu"
    _, log = nvrtc_compile("sm_90", config, (f"-DPROBE_N={n}", f"-DPROBE_A_SMEM={a_smem}"), source=source)
    (r,) = parse_ptxas(log, "sm_90a", config)
    assert r.name == "wgmma_qk_probe" and r.arch == "sm_90a", r.line()
    assert r.spill_stores == r.spill_loads == 0 and not r.problems, r.line()


def test_the_l2_model_counts_cold_misses_and_favours_the_kernels_order():
    """experiments/l2_model.py's LRU model of a plan's row reads: with a cache larger than the batch's rows only the
    first read of each row misses; with one that holds a fraction of them, the kernel's order (a block's last
    segment first) misses less than unit order on a batch whose blocks span two row tiles."""
    spec = importlib.util.spec_from_file_location("l2_model", EXPERIMENTS / "l2_model.py")
    l2_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(l2_model)
    cap = synthesize(SynthSpec(preset="kimi-k2-tp8", batch_size=8, prefix_lens=[2000], budget=64, seed=1), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    rows = len(np.unique(args.combined_kv_indices.numpy()))
    config = KernelConfig.for_arch("sm_90")
    kernel_order = plan(args, H, 132, config)
    unit_order = plan(args, H, 132, config.in_unit_order())
    assert (kernel_order.block_segments > 1).sum() > 50
    reads, misses = l2_model.dram_rows(kernel_order, args, rows + 1, 5.0)
    assert misses == rows and reads > 8 * rows  # each row read by every row tile of its request
    small = rows // 2
    assert l2_model.dram_rows(kernel_order, args, small, 5.0)[1] < 0.8 * l2_model.dram_rows(unit_order, args, small, 5.0)[1]


def test_the_ngram_cost_streams_last_every_step():
    """experiments/ngram_cost.py: each request's token stream holds the last put of its last step (STEPS steps
    accepting up to the draft's tokens each), so no put or match is cut short."""
    spec = importlib.util.spec_from_file_location("ngram_cost", EXPERIMENTS / "ngram_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for draft in (16, 64):
        for period in (1, 8):
            s = mod.stream(np.random.default_rng(0), period, draft)
            assert len(s) >= mod.DEPTH + mod.STEPS * draft and s[mod.DEPTH : mod.DEPTH + period] == s[-period:]
