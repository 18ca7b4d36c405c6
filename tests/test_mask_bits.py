"""kernels/verify_mla_bits.cuh's draft_bits (the funnel-shift form of a thread's tree-mask bits, VMLA_MASK_FUNNEL)
compiled for the host and checked against the mask read key by key, over every draft offset and live-key count a
thread of 4 to 32 keys meets, on random and patterned mask words. Skipped where there is no C++ compiler."""

import shutil
import subprocess

import pytest

from kdtree.kernel.config import KERNEL_DIR

HARNESS = r"""
#include <cstdio>
#include <random>
#include "verify_mla_bits.cuh"
using vmla_bits::u32;
int main() {
  std::mt19937 rng(7);
  long checked = 0;
  for (int pattern = 0; pattern < 40; ++pattern) {
    u32 mask[3];
    for (u32& w : mask) w = pattern == 0 ? 0xffffffffu : pattern == 1 ? 0x55555555u : pattern == 2 ? 0u : rng();
    for (int cols : {4, 8, 16, 32})
      for (int j0 = -cols + 1; j0 < 96 - cols; ++j0)  // the thread's first key, as a draft index
        for (int live = 0; live <= 96; ++live) {      // draft keys below k_end
          const int ja = j0 > 0 ? j0 : 0, jb = (j0 + cols < live ? j0 + cols : live) - 1;
          if (jb < ja) continue;
          const u32 w0 = mask[ja >> 5], w1 = (jb >> 5) != (ja >> 5) ? mask[jb >> 5] : 0u;
          u32 want = 0;
          for (int c = 0; c < cols; ++c) {
            const int j = j0 + c;
            if (j >= ja && j <= jb && ((mask[j >> 5] >> (j & 31)) & 1u)) want |= 1u << c;
          }
          const u32 got = vmla_bits::draft_bits(j0, ja, jb, w0, w1);
          if (got != want) {
            std::printf("mismatch cols %d j0 %d live %d: got %08x want %08x\n", cols, j0, live, got, want);
            return 1;
          }
          ++checked;
        }
  }
  std::printf("ok %ld\n", checked);
  return 0;
}
"""


def test_funnel_shift_bits_are_the_masks_bits(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    src, exe = tmp_path / "bits.cpp", tmp_path / "bits"
    src.write_text(HARNESS)
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{KERNEL_DIR}", str(src), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    assert int(r.stdout.split()[1]) > 100_000  # every case was checked, not none
