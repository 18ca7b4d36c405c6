// The bf16 mma.sync rate of the present GPU, the ceiling of the code path sm_120 runs (docs/kernel-design.md,
// "The two numbers"): mma_raw issues m16n8k16 MMAs on operands held in registers, CHAINS independent
// accumulators a warp (8 by default: enough that the tensor pipe never waits on a result); mma_ldmatrix feeds every MMA
// through ldmatrix from shared memory, as a real tile does (per k32 step of a warp: 2 A loads, 4 B loads, 8 MMAs). Each
// thread writes the sum of its accumulators, so nothing is optimised away.
#include <cuda_bf16.h>

#include "verify_mla_ptx.cuh"

#ifndef VMLA_CEILING_CHAINS
#define VMLA_CEILING_CHAINS 8  // mma_raw's independent accumulators a warp (fewer: how many chains the pipe needs)
#endif
constexpr int CHAINS = VMLA_CEILING_CHAINS;
constexpr int THREADS = 256;

extern "C" __global__ void __launch_bounds__(THREADS) mma_raw(float* out, int iters) {
  const unsigned lane = threadIdx.x % 32;
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ ((lane + i) & 7u);  // bf16 pairs near 1.0
  const uint32_t b0 = 0x3c003c00u ^ (lane & 3u), b1 = b0 ^ 1u;         // near 2^-7
  float acc[CHAINS][4];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) vmla::mma_bf16(acc[c], a, b0, b1);
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(THREADS) mma_ldmatrix(float* out, int iters) {
  constexpr int K = 32, PAD = 8;                           // a k32 step; rows padded by 16 B (conflict-free ldmatrix)
  __shared__ __align__(16) __nv_bfloat16 sa[64][K + PAD];  // A: 64 rows (4 m16 tiles) x k32
  __shared__ __align__(16) __nv_bfloat16 sb[32][K + PAD];  // B: 32 keys (4 n8 tiles) x k32
  for (int i = threadIdx.x; i < 64 * (K + PAD); i += THREADS)
    sa[i / (K + PAD)][i % (K + PAD)] = __float2bfloat16(1.f + (i % 7) * 1e-3f);
  for (int i = threadIdx.x; i < 32 * (K + PAD); i += THREADS)
    sb[i / (K + PAD)][i % (K + PAD)] = __float2bfloat16(0.0078125f * (1.f + (i % 5) * 1e-3f));
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int m0 = (warp % 4) * 16;
  float acc[4][4];
#pragma unroll
  for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  for (int it = 0; it < iters; ++it) {
    __syncwarp();  // the tile may have changed (as in a real loop): ptxas must load it again, not reuse registers
    uint32_t af[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) vmla::ldmatrix_x4(af[kk], &sa[m0 + lane % 16][kk * 16 + (lane / 16) * 8]);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      uint32_t bf[4];  // keys n*8.., k 0-7, 8-15, 16-23, 24-31
      vmla::ldmatrix_x4(bf, &sb[n * 8 + lane % 8][(lane / 8) * 8]);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) vmla::mma_bf16(acc[n], af[kk], bf[2 * kk], bf[2 * kk + 1]);
    }
  }
  float s = 0.f;
#pragma unroll
  for (int n = 0; n < 4; ++n) s += acc[n][0] + acc[n][1] + acc[n][2] + acc[n][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
