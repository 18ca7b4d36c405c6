// PTX wrappers of the warpgroup MMAs (sm_90a) that the Hopper bodies (verify_mla_body_*.cuh) and their rate probe
// (wgmma_probe.cu) share: shared-memory matrix descriptors, fence, commit, wait, the proxy fence, the QK steps (N 32
// and 64).
#pragma once

#include "verify_mla_ptx.cuh"

namespace vmla_wg {
using vmla::smem_addr;

// Shared-memory matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle.
// (swizzle: 1 = 128-byte, 2 = 64-byte)
__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo, uint32_t sbo, uint64_t swizzle = 1) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (swizzle << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes (generic proxy) visible to the tensor cores' reads (async proxy); before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The QK step: s (+)= A B^T over one k16 step, A = 64 x 16 (desc), B = 32 x 16 (desc), both K-major (accumulate 0:
// s = A B^T).
__device__ __forceinline__ void wgmma_qk(float (&s)[4][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]),
        "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]),
        "+f"(s[3][2]), "+f"(s[3][3])
      : "l"(da), "l"(db), "r"(accumulate));
}

// The QK step at N 64 (the blocks64 body's): as wgmma_qk, B = 64 x 16.
__device__ __forceinline__ void wgmma_qk64(float (&s)[8][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]),
        "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]),
        "+f"(s[3][2]), "+f"(s[3][3]), "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]),
        "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]), "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]),
        "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
      : "l"(da), "l"(db), "r"(accumulate));
}

}  // namespace vmla_wg
