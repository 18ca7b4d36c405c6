// PTX wrappers of the warpgroup MMAs (sm_90a) that the Hopper body (verify_mla_wgmma.cuh) and its rate probe
// (wgmma_probe.cu) share: shared-memory matrix descriptors, fence, commit, wait.
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
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

}  // namespace vmla_wg
