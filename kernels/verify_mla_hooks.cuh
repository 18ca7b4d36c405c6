// Timing and trace hooks of verify_mla.cu, off by default; nothing here is part of the algorithm.
#pragma once

// Timing experiments only (the output is wrong with any of these): VMLA_SKIP_LOAD (no pool-row copies),
// VMLA_SKIP_QK / VMLA_SKIP_PV (no tensor-core work in that phase), VMLA_SKIP_SOFTMAX (P = raw scores),
// VMLA_SKIP_EXCHANGE (the dims_split wgmma body: each warpgroup softmaxes its own partial scores; no barrier).
// tools/variants.py times them against the real kernel to see where the time goes.
// (each guards its phase with #ifndef VMLA_SKIP_<PHASE> where the phase is issued)

// VMLA_TRACE (timing experiments, tools/trace_case.py): thread 0 of each block stamps %globaltimer (ns) into
// vmla_trace[block][slot]: slot 0 the block's start, 31 its end, 1 + 5 s + e event e of its segment s (s < 6):
// 0 start, 1 Q and slot ids landed, 2 first tile landed, 3 tile loop done, 4 outputs written.
#ifndef VMLA_TRACE
#define VMLA_TRACE 0
#endif
#define VMLA_MARK_START 100
#define VMLA_MARK_END 101
#if VMLA_TRACE
extern "C" __device__ unsigned long long vmla_trace[VMLA_TRACE * 32];  // VMLA_TRACE = the grid size
__device__ __forceinline__ void trace_mark(int slot) {
  __shared__ int seg;  // the walk's segment count (thread 0's own: nobody else reads it)
  if (threadIdx.x != 0) return;
  if (slot < 0) {
    seg = slot == -1 ? 0 : seg + 1;
    return;
  }  // -1: first segment, -2: next segment
  const int at = slot == VMLA_MARK_START ? 0 : slot == VMLA_MARK_END ? 31 : 1 + 5 * seg + slot;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (at < 32) vmla_trace[blockIdx.x * 32 + at] = t;
}
#define VMLA_MARK(slot) trace_mark(slot)
#else
#define VMLA_MARK(slot) ((void)0)
#endif

// VMLA_PHASES (timing experiments, tools/phase_profile.py): thread 0 of each warpgroup of the split_keys loop sums
// the clock64 cycles of each phase of a step in shared memory and adds them to vmla_phases[warpgroup][phase] once a
// segment (phase 8: the steps counted): 0 the top (this step's tiles landed, the barrier; in a segment's first
// step also its first tiles' loads), 1 QK and the next tiles issued, 2 QK's wait, 3 the row maxima, 4 their
// trade's barrier, 5 exp, P and its P V issued, 6 P's trade barrier, 7 the other P V issued and waited.
#ifndef VMLA_PHASES
#define VMLA_PHASES 0
#endif
#if VMLA_PHASES
extern "C" __device__ unsigned long long vmla_phases[2][9];
struct PhaseClock {
  long long last;
  __device__ __forceinline__ static unsigned long long* sums() {
    __shared__ unsigned long long s[2][9];
    return s[threadIdx.x / 128];
  }
  __device__ __forceinline__ PhaseClock() : last(clock64()) {
    if (threadIdx.x % 128 == 0)
      for (int k = 0; k < 9; ++k) sums()[k] = 0;
  }
  __device__ __forceinline__ void mark(int phase) {
    if (threadIdx.x % 128 != 0) return;
    const long long now = clock64();
    sums()[phase] += static_cast<unsigned long long>(now - last);
    if (phase == 7) sums()[8] += 1;
    last = now;
  }
  __device__ __forceinline__ void flush() {
    if (threadIdx.x % 128 == 0)
      for (int k = 0; k < 9; ++k) atomicAdd(&vmla_phases[threadIdx.x / 128][k], sums()[k]);
  }
};
#define VMLA_PHASE_CLOCK PhaseClock phase_clock
#define VMLA_PHASE(k) phase_clock.mark(k)
#define VMLA_PHASE_FLUSH phase_clock.flush()
#else
#define VMLA_PHASE_CLOCK
#define VMLA_PHASE(k) ((void)0)
#define VMLA_PHASE_FLUSH ((void)0)
#endif
