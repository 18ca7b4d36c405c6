"""The host-device contract of verify_mla_fwd and verify_mla_merge, without a GPU: the host's parameter structs
(kdtree.kernel.launch.FwdParams, MergeParams) against the device's (kernels/verify_mla_params.cuh), checked by
NVRTC compiling static_asserts of every size and offset the host has; and the kernels' parameter lists are those
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


def probe_source(structs: dict[str, type[ctypes.Structure]]) -> str:
    """A translation unit that compiles only where each device struct has the host struct's size, and every host
    member at the host's offset and of its size."""
    lines = ['#include "verify_mla_params.cuh"']
    for device, host in structs.items():
        lines.append(f'static_assert(sizeof({device}) == {ctypes.sizeof(host)}, "sizeof {device}");')
        for name, _ in host._fields_:
            field = getattr(host, name)
            lines.append(f'static_assert(__builtin_offsetof({device}, {name}) == {field.offset}, "offset of {device}::{name}");')
            lines.append(f'static_assert(sizeof({device}::{name}) == {field.size}, "size of {device}::{name}");')
    return "\n".join(lines) + "\n"


def nvrtc_compiles(source: str) -> tuple[bool, str]:
    """(NVRTC compiled `source` with kernels/ on the include path, its log)."""
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"params_probe.cu", 0, [], [])
    try:
        opts = ["-arch=sm_90", "-std=c++17", f"-I{KERNEL_DIR}", *(f"-I{d}" for d in _nvrtc_include_dirs())]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")


def test_the_host_structs_are_the_device_structs():
    ok, log = nvrtc_compiles(probe_source(STRUCTS))
    assert ok, log
    assert ctypes.sizeof(FwdParams) == 168 and ctypes.sizeof(MergeParams) == 40


def test_a_wrong_offset_fails_the_probe():
    """The probe is a check: a host struct with two members swapped, one missing or one too wide does not compile."""

    class Swapped(ctypes.Structure):
        _fields_ = [FwdParams._fields_[i] for i in (0, 1, 2, 3, 4, 5, 6, 8, 7, *range(9, len(FwdParams._fields_)))]

    class Short(ctypes.Structure):
        _fields_ = MergeParams._fields_[:-1]

    class Wide(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int64 if n == "num_heads" else t) for n, t in FwdParams._fields_]

    ok, log = nvrtc_compiles(probe_source({"vmla::FwdParams": Swapped}))
    assert not ok and "offset of vmla::FwdParams::num_heads" in log, log
    ok, log = nvrtc_compiles(probe_source({"vmla::MergeParams": Short}))
    assert not ok and "sizeof vmla::MergeParams" in log, log
    ok, log = nvrtc_compiles(probe_source({"vmla::FwdParams": Wide}))
    assert not ok and "size of vmla::FwdParams::num_heads" in log, log


@pytest.mark.parametrize("arch,config", [("sm_120", KernelConfig()), ("sm_90", KernelConfig.for_arch("sm_90"))])
def test_the_kernels_take_the_structs_members(arch, config):
    """Each kernel's PTX parameters are the struct's members in order: as many, each of its member's size (a
    parameter list and a struct built from the same list in the header)."""
    ptx = nvrtc_ptx(arch, config)
    for kernel, host in (("verify_mla_fwd", FwdParams), ("verify_mla_merge", MergeParams)):
        entry = re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S).group(1)
        sizes = [int(m) // 8 for m in re.findall(r"\.param \.[usfb](\d+) ", entry)]
        assert sizes == [getattr(host, n).size for n, _ in host._fields_], (kernel, entry)
