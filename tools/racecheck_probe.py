"""compute-sanitizer's racecheck on small, correct programs of two warpgroups shaped like the blocks64 body's
hand-overs (verify_segment_blocks64: one warpgroup writes shared words and arrives at a named barrier, the other
syncs on it and reads them), and on a real race as the control: which hazards it reports on code that has none
(docs/kernel-design.md, "racecheck on the 64-key-block body"). Each program runs under racecheck in its own
process; the report lines name the accesses by line of SOURCE (line 1 is the empty line the string opens with).

  handover       warpgroup 1 writes shared words, bar.arrive 1; warpgroup 0 bar.sync 1, reads them, bar.arrive 2;
                 warpgroup 1 bar.sync 2 before writing again (ordered by PTX's barrier semantics)
  handover_sync  the same loop, then __syncthreads, warpgroup 1 writes, __syncthreads, warpgroup 0 reads
  unsynced       warpgroup 1 writes, warpgroup 0 reads, no barrier between (a real race: the control)
  blocks64       the body's pattern: per iteration five one-way hand-overs (barriers 1-5, each arrived at by one
                 warpgroup and synced on by the other), warpgroup 0's scale read by warpgroup 1 and warpgroup 1's by
                 warpgroup 0; then its epilogue: __syncthreads, each warpgroup writes its row sums over the scales'
                 words, __syncthreads, threads 0-31 of each warpgroup read both
  blocks64_last  the same with the body's last iteration, which skips barriers 4 and 5 (no next block)

Usage: python3 tools/racecheck_probe.py   (needs a GPU, CuPy and compute-sanitizer; prints hazards per program)
"""

import re
import shutil
import subprocess
import sys

SOURCE = r"""
extern "C" __global__ void probe(float* out, int iters, int kind) {
  __shared__ float buf[64];
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  float acc = 0.f;
  if (kind >= 3) {  // blocks64, blocks64_last
    float* s0 = buf;
    float* s1 = buf + 32;
    for (int it = 0; it < iters; ++it) {
      if (wg == 0) {
        if (t < 32) s0[t] = it + t;
        asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
        if (t < 32) acc += s1[t];
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
        if (kind == 3 || it + 1 < iters) {  // (blocks64_last: the last iteration has no next block to wait for)
          asm volatile("bar.sync 4, 256;\n" ::: "memory");
          asm volatile("bar.arrive 5, 256;\n" ::: "memory");
        }
      } else {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if (t < 32) acc += s0[t], s1[t] = acc;
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
        if (kind == 3 || it + 1 < iters) {
          asm volatile("bar.arrive 4, 256;\n" ::: "memory");
          asm volatile("bar.sync 5, 256;\n" ::: "memory");
        }
      }
    }
    __syncthreads();
    if (t < 32) (wg == 0 ? s0 : s1)[t] = acc;
    __syncthreads();
    if (t < 32) acc = s0[t] + s1[t];
  } else if (kind == 2) {  // unsynced
    if (wg == 1 && t < 64) buf[t] = t;
    if (wg == 0 && t < 64) acc += buf[t];
  } else {
    for (int it = 0; it < iters; ++it) {
      if (wg == 1) {
        if (t < 64) buf[t] = it + t;
        asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if (t < 64) acc += buf[t];
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
    }
    if (kind == 1) {
      __syncthreads();
      if (wg == 1 && t < 64) buf[t] = acc + 1.f;
      __syncthreads();
      if (wg == 0 && t < 64) acc += buf[63 - t];
    }
  }
  out[blockIdx.x * blockDim.x + tid] = acc;
}
"""
KINDS = ("handover", "handover_sync", "unsynced", "blocks64", "blocks64_last")


def run(kind: int) -> None:
    import cupy

    fn = cupy.RawModule(code=SOURCE, options=("-lineinfo",)).get_function("probe")
    out = cupy.zeros(4 * 256, dtype=cupy.float32)
    fn((4,), (256,), (out, cupy.int32(8), cupy.int32(kind)))
    cupy.cuda.runtime.deviceSynchronize()


def main() -> None:
    if len(sys.argv) == 2:
        run(KINDS.index(sys.argv[1]))
        return
    if shutil.which("compute-sanitizer") is None:
        raise SystemExit("racecheck_probe.py: compute-sanitizer is not on PATH (it comes with the CUDA toolkit)")
    for name in KINDS:
        r = subprocess.run(
            ["compute-sanitizer", "--tool=racecheck", sys.executable, __file__, name], capture_output=True, text=True, timeout=300
        )
        text = r.stdout + r.stderr
        reports = re.findall(r"Race reported between (.*?)\n=*\s*and (.*?) \[(\d+) hazards\]", text)
        summary = re.search(r"RACECHECK SUMMARY: (.*)", text)
        print(f"{name:14s} rc {r.returncode}  {summary.group(1) if summary else 'no summary'}")
        if summary is None:  # the program did not run (no GPU, no CuPy, a compile error): say why
            print("    " + "\n    ".join(text.strip().splitlines()[-8:]))
        for a, b, n in reports:
            print(f"    {a.strip()}  /  {b.strip()}  x{n}")


if __name__ == "__main__":
    main()
