// The tree mask's bits for a thread's keys, as plain C++ (no CUDA types): verify_mla_common.cuh's visible_keys
// uses it (VMLA_MASK_FUNNEL), and tests/test_mask_bits.py compiles it for the host to check it against the mask
// read key by key.
#pragma once

#ifdef __CUDACC__
#define VMLA_HD __host__ __device__ __forceinline__
#else
#define VMLA_HD inline
#endif

namespace vmla_bits {
using u32 = unsigned int;
using u64 = unsigned long long;

// Bit c set where draft key j0 + c is in [ja, jb] (the live draft keys among a thread's keys from draft index j0,
// at most 32 of them, ja >= 0) and its bit is set in the row's mask words w0 = word ja / 32 and w1 = the next one
// (where jb reaches it, else 0): one funnel shift of the two words (keys ja, ja + 1, ... from bit 0), cut to the
// live keys and moved to key ja's place among the thread's. (A loop over the keys compiles to COLS predicated
// steps, if-converted, that every tile runs, prefix tiles too.)
VMLA_HD u32 draft_bits(int j0, int ja, int jb, u32 w0, u32 w1) {
  const u32 window = static_cast<u32>(((static_cast<u64>(w1) << 32) | w0) >> (ja & 31));
  const int n = jb - ja + 1;  // 1..32 live draft keys
  return (n >= 32 ? window : window & ((1u << n) - 1u)) << (ja - j0);
}
}  // namespace vmla_bits
