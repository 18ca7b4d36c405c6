// The rate at which the present GPU's SMs gather pool rows into shared memory, the loads' ceiling of both code
// paths (docs/kernel-design.md, "The two numbers"): one block of 256 threads an SM, as verify_mla_fwd runs,
// gathers 32-row tiles of 1,152-byte rows (576 bf16) by slot id with 16-byte cp.async (8 threads a row, 9
// copies each, the kernel's pattern) into a ring of STAGES stages, waits for each tile and passes a barrier, and
// does nothing else. Slot ids come from `slots` (random, so the pool's size decides whether rows come from L2
// or HBM). Each thread writes the XOR of one word of every tile it saw land, so nothing is optimised away.
#include <cuda_bf16.h>

#include "verify_mla_ptx.cuh"

namespace {
constexpr int THREADS = 256, ROWS = 32, DIM = 576, TPR = 8, COPIES = DIM / 8 / TPR;

template <int STAGES>
__device__ __forceinline__ void gather(const __nv_bfloat16* __restrict__ pool, const int* __restrict__ slots,
                                       int slot_mask, int tiles, unsigned* out) {
  extern __shared__ __align__(16) __nv_bfloat16 ring[];  // [STAGES][ROWS][DIM]
  const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
  const int first = blockIdx.x * tiles * ROWS;
  auto load = [&](int t) {
    const __nv_bfloat16* src = pool + static_cast<int64_t>(slots[(first + t * ROWS + r) & slot_mask]) * DIM;
    __nv_bfloat16* dst = ring + ((t % STAGES) * ROWS + r) * DIM;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) vmla::cp_async_16(dst + (j + i * TPR) * 8, src + (j + i * TPR) * 8, true);
  };
  unsigned seen = 0;
#pragma unroll 1
  for (int t = 0; t < STAGES - 1; ++t) {
    load(t);
    vmla::cp_async_commit();
  }
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    vmla::cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for all; every thread is past tile t - 1, whose stage is refilled now
    seen ^= reinterpret_cast<const unsigned*>(ring + ((t % STAGES) * ROWS + r) * DIM)[j];
    if (t + STAGES - 1 < tiles) load(t + STAGES - 1);
    vmla::cp_async_commit();
  }
  vmla::cp_async_wait_all();
  out[blockIdx.x * THREADS + threadIdx.x] = seen;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    gather_2(const __nv_bfloat16* pool, const int* slots, int slot_mask, int tiles, unsigned* out) {
  gather<2>(pool, slots, slot_mask, tiles, out);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    gather_4(const __nv_bfloat16* pool, const int* slots, int slot_mask, int tiles, unsigned* out) {
  gather<4>(pool, slots, slot_mask, tiles, out);
}
