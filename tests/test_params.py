"""The host-device contract of verify_mla_fwd and verify_mla_merge, without a GPU: the host's parameter structs
(kdtree.kernel.launch.FwdParams, MergeParams) against the device's (kernels/verify_mla_params.cuh), read from the
PTX of a probe kernel that NVRTC compiles with the kernels' header: each struct's size and every member's offset
and size, which NVRTC folds to constants (no GPU runs it). `offsetof` is no option: NVRTC 13.0 (the one torch's
CUDA build pins) has neither `__builtin_offsetof` nor a <cstddef>. And the kernels' parameter lists are those
structs' (the lists in the header are expanded into both)."""

import ctypes
import re

import pytest

from kdtree.kernel import KernelConfig, nvrtc_ptx
from kdtree.kernel.config import KERNEL_DIR
from kdtree.kernel.launch import FwdParams, MergeParams
from kdtree.kernel.nvrtc import _nvrtc_include_dirs

pytest.importorskip("cuda.bindings", reason="NVRTC not installed (pip install -e '.[nvrtc]')")

STRUCTS = {"vmla::FwdParams": FwdParams, "vmla::MergeParams": MergeParams}


def probe_source(device: str, host: type[ctypes.Structure]) -> str:
    """A kernel that stores, through a volatile pointer (one store each, never merged), sizeof(`device`) and then
    the offset and size of each of the host's members in the device struct."""
    values = ["sizeof(p)"]
    for name, _ in host._fields_:
        values += [f"(const char*)&p.{name} - (const char*)&p", f"sizeof(p.{name})"]
    stores = "\n".join(f"  out[{i}] = {v};" for i, v in enumerate(values))
    return (
        '#include "verify_mla_params.cuh"\n'
        f'extern "C" __global__ void layout_probe({device} p, volatile unsigned long long* out) {{\n{stores}\n}}\n'
    )


def nvrtc_ptx_of(source: str) -> tuple[str | None, str]:
    """(the PTX of `source` compiled by NVRTC with kernels/ on the include path, or None; NVRTC's log)."""
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"params_probe.cu", 0, [], [])
    try:
        opts = ["-arch=sm_90", "-std=c++17", f"-I{KERNEL_DIR}", *(f"-I{d}" for d in _nvrtc_include_dirs())]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        ptx = None
        if res == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetPTXSize(prog)
            buf = b" " * n
            nvrtc.nvrtcGetPTX(prog, buf)
            ptx = buf.rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx, log.decode(errors="replace")


def stored_constants(ptx: str) -> list[int]:
    """The constants the probe stores, in the order of `out`: each 64-bit store's immediate, or the immediate
    last moved into its register. AssertionError (with the PTX) for a store of anything else."""
    regs: dict[str, int] = {}
    out: dict[int, int] = {}
    for line in ptx.splitlines():
        if m := re.search(r"mov\.[bu]64\s+(%rd\d+),\s*(\d+);", line):
            regs[m.group(1)] = int(m.group(2))
        elif m := re.search(r"st\.volatile\.global\.[bu]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", line):
            value = m.group(2)
            assert value.isdigit() or value in regs, f"probe stores {value}, not a constant:\n{ptx}"
            out[int(m.group(1) or 0) // 8] = int(value) if value.isdigit() else regs[value]
    assert sorted(out) == list(range(len(out))), f"probe's stores are not out[0..n):\n{ptx}"
    return [out[i] for i in range(len(out))]


def layout_mismatches(device: str, host: type[ctypes.Structure]) -> list[str]:
    """Where `device`'s layout (size, each member's offset and size) is not `host`'s: empty when they agree."""
    ptx, log = nvrtc_ptx_of(probe_source(device, host))
    assert ptx is not None, log
    size, *members = stored_constants(ptx)
    assert len(members) == 2 * len(host._fields_), f"the probe stored {len(members)} values for {len(host._fields_)} members"
    problems = [f"sizeof {device}: {size}, host {ctypes.sizeof(host)}"] if size != ctypes.sizeof(host) else []
    for (name, _), offset, nbytes in zip(host._fields_, members[0::2], members[1::2]):
        field = getattr(host, name)
        if offset != field.offset:
            problems.append(f"offset of {device}::{name}: {offset}, host {field.offset}")
        if nbytes != field.size:
            problems.append(f"size of {device}::{name}: {nbytes}, host {field.size}")
    return problems


def test_the_host_structs_are_the_device_structs():
    for device, host in STRUCTS.items():
        assert layout_mismatches(device, host) == [], device
    assert ctypes.sizeof(FwdParams) == 168 and ctypes.sizeof(MergeParams) == 40


def test_a_wrong_offset_fails_the_probe():
    """The probe is a check: a host struct with two members swapped, one missing or one too wide is refused."""

    class Swapped(ctypes.Structure):
        _fields_ = [FwdParams._fields_[i] for i in (0, 1, 2, 3, 4, 5, 6, 8, 7, *range(9, len(FwdParams._fields_)))]

    class Short(ctypes.Structure):
        _fields_ = MergeParams._fields_[:-1]

    class Wide(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int64 if n == "num_heads" else t) for n, t in FwdParams._fields_]

    assert any(p.startswith("offset of vmla::FwdParams::num_heads") for p in layout_mismatches("vmla::FwdParams", Swapped))
    assert any(p.startswith("sizeof vmla::MergeParams") for p in layout_mismatches("vmla::MergeParams", Short))
    assert any(p.startswith("size of vmla::FwdParams::num_heads") for p in layout_mismatches("vmla::FwdParams", Wide))


@pytest.mark.parametrize("arch,config", [("sm_120", KernelConfig()), ("sm_90", KernelConfig.for_arch("sm_90"))])
def test_the_kernels_take_the_structs_members(arch, config):
    """Each kernel's PTX parameters are the struct's members in order: as many, each of its member's size (a
    parameter list and a struct built from the same list in the header)."""
    ptx = nvrtc_ptx(arch, config)
    for kernel, host in (("verify_mla_fwd", FwdParams), ("verify_mla_merge", MergeParams)):
        entry = re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S).group(1)
        sizes = [int(m) // 8 for m in re.findall(r"\.param \.[usfb](\d+) ", entry)]
        assert sizes == [getattr(host, n).size for n, _ in host._fields_], (kernel, entry)
