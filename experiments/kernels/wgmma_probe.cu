// The rate of the Hopper body's QK on the present GPU (sm_90a; experiments/wgmma_probe.py): a chain of 36 k16 steps
// (576 dims) of wgmma m64nNk16 into one accumulator, fenced, committed and waited for as a tile's QK is, by one
// or both warpgroups of a block at once. B is N keys in shared memory in the kernel's layout (9 atoms of 64
// dims, 128-byte swizzle); A is Q, from shared memory the same way (PROBE_A_SMEM 1, as the kernel reads it) or
// from registers (0: what Q's shared-memory reads cost). N is PROBE_N: 32, the kernel's tiles, or 64. Each
// thread writes the sum of its accumulators (nothing is optimised away), thread 0 of each warpgroup its clocks.
#include <cuda_bf16.h>

#include "../../kernels/verify_mla_wgmma_ptx.cuh"

#ifndef PROBE_N
#define PROBE_N 32
#endif
#ifndef PROBE_A_SMEM
#define PROBE_A_SMEM 1
#endif

namespace probe {
using namespace vmla_wg;
constexpr int N = PROBE_N, KSTEPS = 36, ROWS = 64;  // a thread's fp32 accumulators: d[N / 8][4]
static_assert(N == 32 || N == 64, "PROBE_N: 32 or 64");

// The accumulators d[N / 8][4] as asm operands (PROBE_D8(i): n8 tiles i and i + 1).
#define PROBE_D8(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3]), \
  "+f"(d[i + 1][0]), "+f"(d[i + 1][1]), "+f"(d[i + 1][2]), "+f"(d[i + 1][3])
#define PROBE_D16 PROBE_D8(0), PROBE_D8(2)
#define PROBE_D32 PROBE_D16, PROBE_D8(4), PROBE_D8(6)

// d += A B^T over one k16 step: A by descriptor (shared memory) or as 4 registers, B by descriptor (both K-major).
// From shared memory it is the kernel's own QK step (wgmma_qk, wgmma_qk64).
#if PROBE_N == 32
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db) { wgmma_qk(d, da, db, 1); }
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : PROBE_D16
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif
#if PROBE_N == 64
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db) { wgmma_qk64(d, da, db, 1); }
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : PROBE_D32
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif
#undef PROBE_D32
#undef PROBE_D16
#undef PROBE_D8
}  // namespace probe

// Shared memory: Q (64 rows) then K (N rows), each 9 swizzled atoms of 64 dims; 1024-byte aligned.
extern "C" __global__ void __launch_bounds__(256) wgmma_qk_probe(float* out, long long* clocks, int chains, int warpgroups) {
  using namespace probe;
  extern __shared__ __align__(1024) unsigned char smem[];
  __nv_bfloat16* q = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* k = q + 9 * ROWS * 64;
  for (int i = threadIdx.x; i < 9 * (ROWS + N) * 64; i += blockDim.x)
    q[i] = __float2bfloat16(((i * 37 + 11) % 64 - 32) * (1.f / 256.f));  // small values: no overflow over the chains
  fence_async_smem();
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg >= warpgroups) return;
  float d[N / 8][4] = {};
  const uint64_t dq = desc(q, 16, 1024), dk = desc(k, 16, 1024);
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ ((threadIdx.x + i) & 7u);  // bf16 pairs near 2^-7
  const long long t0 = clock64();
  for (int c = 0; c < chains; ++c) {
    wg_fence();
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const int atom = s / 4, kbytes = (s % 4) * 32;
      const uint64_t db = dk + ((atom * N * 128 + kbytes) >> 4);
#if PROBE_A_SMEM
      mma_ss(d, dq + ((atom * ROWS * 128 + kbytes) >> 4), db);
#else
      mma_rs(d, a, db);
#endif
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e]));
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 8; ++i) s += d[i][0] + d[i][1] + d[i][2] + d[i][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) clocks[blockIdx.x * 2 + wg] = t1 - t0;
}
