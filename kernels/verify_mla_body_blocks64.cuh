// The Hopper blocks64 body (VMLA_SPLIT_KEYS && VMLA_BLOCKS64; verify_mla_wgmma_common.cuh has the overview).
#pragma once

#include "verify_mla_wgmma_common.cuh"

namespace vmla_wg {

#if VMLA_SPLIT_KEYS && VMLA_BLOCKS64
// ---- blocks64: FlashMLA's schedule on 64-key blocks (VMLA_BLOCKS64) ----
// The four 32-key stages as two 64-key buffers (64-row atoms, 72 KB each): warpgroup g scores the blocks of
// buffer g over all 576 dims (wgmma m64n64k16: 4 KB of shared reads per 64 x 64 x 16, not 3 KB per 64 x 32 x 16)
// and each accumulates its 256 output columns over both blocks (m64n256k16), its own P from registers and the
// other's from shared memory (warpgroup 0's P in its buffer's rope atom, dead once its QK is done; warpgroup 1's
// in the P buffer). The running max passes 0 -> 1 -> 0 through shared memory (sM), with the scale each
// warpgroup applied (s0, s1): warpgroup 1 rescales once by s0 s1, warpgroup 0 by s0 and after its first P V by
// s1, and hands warpgroup 1 its P already moved onto warpgroup 1's max. A buffer's atoms 0-3 (V's left columns)
// are refilled by warpgroup 0 once its P V on them is done, atoms 4-8 by warpgroup 1 after its own, and the next
// QK waits for both halves (named barriers, one-way). A segment's blocks are padded to an even count (the last
// zero-filled and masked).
static_assert(VMLA_FEW_ROWS == 0, "the blocks64 body runs without the few-row segment (beside it, it spills)");
namespace blocks64 {
constexpr int BLK = 64, BAR_S0 = 1, BAR_S1 = 2, BAR_P0 = 3, BAR_K0R = 4, BAR_K1L = 5;
__device__ __forceinline__ void arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(NUM_THREADS) : "memory");
}
__device__ __forceinline__ void sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(NUM_THREADS) : "memory");
}

// A descriptor the compiler must treat as new at each use: otherwise it hoists the 36 QK (and 8 P V) descriptors
// out of the block loop and holds them in registers.
__device__ __forceinline__ uint64_t opaque(uint64_t d) {
  asm volatile("" : "+l"(d));
  return d;
}
// This thread's first row of its warpgroup's 64 (rows r_lo, r_lo + 8), read again from %tid.x where it is used
// (held across the block loop, it is the value ptxas spills at 255 registers).
__device__ __forceinline__ int row_lo() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return (t / 32) % 4 * 16 + t % 32 / 4;
}
// A 64-key buffer: stages 2 g and 2 g + 1 as [9 atoms][64 rows][64].
__device__ __forceinline__ __nv_bfloat16* buffer(Smem& sm, int g) { return &sm.kv[2 * g][0][0][0]; }
__device__ __forceinline__ __nv_bfloat16* atom(Smem& sm, int g, int a) { return buffer(sm, g) + a * BLK * 64; }

// All 36 k-steps of S = Q K^T of the block in buffer g (one commit group).
__device__ __forceinline__ void issue_qk(float (&s)[8][4], Smem& sm, int g) {
  const uint64_t dq = opaque(desc(&sm.q[0][0][0], 16, 1024)), dk = opaque(desc(buffer(sm, g), 16, 1024));
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int at = ks / 4, kbytes = (ks % 4) * 32;
    wgmma_qk64(s, dq + ((at * BM * 128 + kbytes) >> 4), dk + ((at * BLK * 128 + kbytes) >> 4), ks > 0);
  }
  wg_commit();
}
// acc += P V over the block in buffer g for output columns [256 wg, +256), P from registers (pa) or from the
// 64 x 64 swizzled tile at p_smem.
__device__ __forceinline__ void issue_pv_regs(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[4][4], Smem& sm, int g,
                                              int wg) {
  const uint64_t dv = opaque(desc(atom(sm, g, wg * 4), BLK * 128, 1024));
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv(acc, pa[kk], dv + ((kk * 16 * 128) >> 4));
  wg_commit();
}
__device__ __forceinline__ void issue_pv_smem(float (&acc)[PV_N / 8][4], const __nv_bfloat16* p_smem, Smem& sm, int g,
                                              int wg) {
  const uint64_t dp = opaque(desc(p_smem, 16, 1024)), dv = opaque(desc(atom(sm, g, wg * 4), BLK * 128, 1024));
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv_ss(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
  wg_commit();
}

// Atoms [A0, A1) of the block of keys [k0, k0 + 64) into buffer g by this warpgroup's 128 threads: 8 threads a
// row (one 16-byte chunk of each atom), 16 rows a pass; rows past k_end zero-filled. ids: the rows' slot ids.
template <int A0, int A1>
__device__ __forceinline__ void gather(Smem& sm, int g, const __nv_bfloat16* __restrict__ kv_buffer,
                                       const int (&ids)[4], int k0, int k_end) {
#ifndef VMLA_SKIP_LOAD
  const int t = threadIdx.x % 128, j = t % 8;
  // (the shared addresses from one opaque base: else the compiler hoists all 20 out of the block loop)
  uint32_t base = smem_addr(atom(sm, g, A0));
  asm volatile("" : "+r"(base));
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int r = pass * 16 + t / 8;
    const bool live = k0 + r < k_end;
    const __nv_bfloat16* src = kv_buffer + (live ? static_cast<int64_t>(ids[pass]) * VMLA_DIM : 0) + j * 8;
    const uint32_t row = base + (r * 64 + ((j ^ (r % 8)) * 8)) * 2;
#pragma unroll
    for (int at = A0; at < A1; ++at)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(row + (at - A0) * BLK * 128),
                   "l"(src + at * 64), "r"(live ? 16 : 0));
  }
#endif
}
// The slot ids gather() needs for the block at k0 (this thread's 4 rows).
__device__ __forceinline__ void load_ids(int (&ids)[4], const int* __restrict__ kv_idx, int k0, int k_end) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int key = k0 + pass * 16 + t / 8;
    ids[pass] = key < k_end ? __ldg(kv_idx + key) : 0;
  }
}

// A thread's 16 scores of a row (keys 8 j + 2 t + e of the block) scaled, capped, masked (vis[w]: keys 32 w..)
// and their max over the row.
__device__ __forceinline__ float masked_max16(float* x, const uint32_t (&vis)[2], const Args& a, int tig) {
  if (a.logit_cap > 0.f) {  // (one division a row, not one a score: the slow path of 16 is 16 calls)
    const float k = a.sm_scale / a.logit_cap, cap_log2 = a.logit_cap * LOG2E;
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = cap_log2 * tanhf(x[i] * k);
  } else {
    const float scale_log2 = a.sm_scale * LOG2E;
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] *= scale_log2;
  }
  float mx = VMLA_NEG_INF;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int jt = i / 2, c = (jt % 4) * 8 + tig * 2 + (i % 2);
    if (!((vis[jt / 4] >> c) & 1u)) x[i] = VMLA_NEG_INF;
    mx = fmaxf(mx, x[i]);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}
// The online step of a row against the running max m_old given this block's max: x becomes p = 2^(x - m_new);
// returns the scale the row's earlier sums and accumulators need (exactly 1 where the max did not move); adds
// the row's p to l (this thread's share).
__device__ __forceinline__ float exp_row(float* x, float mx, float m_old, float& m_new, float& l) {
  const bool grow = mx > m_old;
  m_new = grow ? mx : m_old;
  const float m_use = m_new == VMLA_NEG_INF ? 0.f : m_new;
  const float scale = grow ? exp2f(m_old - m_use) : 1.f;
  float psum = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    x[i] = exp2f(x[i] - m_use);
    psum += x[i];
  }
  l = l * scale + psum;
  return scale;
}
// Two rows' p (16 keys each) as the A fragments of P V's four k16 steps.
__device__ __forceinline__ void pack_p16(const float (&x)[2][16], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = pack_bf16(x[0][4 * kk], x[0][4 * kk + 1]);
    pa[kk][1] = pack_bf16(x[1][4 * kk], x[1][4 * kk + 1]);
    pa[kk][2] = pack_bf16(x[0][4 * kk + 2], x[0][4 * kk + 3]);
    pa[kk][3] = pack_bf16(x[1][4 * kk + 2], x[1][4 * kk + 3]);
  }
}
// This thread's words of the 64 x 64 swizzled P tile at p_smem (the other warpgroup's A operand): word (kk, e)
// holds pa[kk][e] (rows r_lo + 8 (e % 2), keys 16 kk + 8 (e / 2) + 2 tig). A row is 128 bytes, so the swizzled
// address is the row's first word for this thread (chunk r_lo % 8) XOR the chunk index times 16.
struct PWords {
  uint32_t lo;  // shared address of row r_lo's word for chunk 0
  __device__ __forceinline__ PWords(const __nv_bfloat16* p_smem, int r_lo, int tig)
      : lo(smem_addr(p_smem) + r_lo * 128 + (r_lo % 8) * 16 + tig * 4) {}
  __device__ __forceinline__ uint32_t at(int kk, int e) const {
    return (lo + (e % 2) * 8 * 128) ^ ((2 * kk + e / 2) * 16);
  }
};
__device__ __forceinline__ void store_p(const PWords& w, const uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(w.at(kk, e)), "r"(pa[kk][e]) : "memory");
}
// Row h of this thread's words times f[h] where it is not 1 (rounded to bf16 a second time).
__device__ __forceinline__ void rescale_p(const PWords& w, const float (&f)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (f[h] != 1.f) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = h; e < 4; e += 2) {
          uint32_t v;
          asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(w.at(kk, e)) : "memory");
          const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(w.at(kk, e)), "r"(pack_bf16(p.x * f[h], p.y * f[h]))
                       : "memory");
        }
    }
}
}  // namespace blocks64

template <class Merge>
__device__ __forceinline__ void verify_segment_blocks64(Smem& sm, const Args& a, int b, int row0, int k_begin,
                                                        int k_end, float* __restrict__ out_o,
                                                        float* __restrict__ out_lse, Merge&& merge) {
  using namespace blocks64;
  const SegmentRows seg(a, b, row0);
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int tig = lane % 4;
  const int nblocks = (k_end - k_begin + BLK - 1) / BLK, iters = (nblocks + 1) / 2;
  float* sM = &sm.s[0][0][0];  // [64] the running max; [64, 128) s0, [128, 192) s1 (then the row sums' shares)
  float* sS0 = sM + 64;
  float* sS1 = sM + 128;
  __nv_bfloat16* sP1 = &sm.p[0][0][0];  // warpgroup 1's P; warpgroup 0's goes in buffer 0's rope atom
  __nv_bfloat16* sP0 = atom(sm, 0, 8);

  // prologue: Q and the first two blocks, waited for; the running max at -inf
  gather_swizzled<BM>(
      &sm.q[0][0][0], [&](int r) { return row0 + r < seg.rows ? a.q + (seg.grow0 + r) * VMLA_DIM : nullptr; }, a.q);
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const int k0 = k_begin + g * BLK;
    gather_swizzled<BLK>(
        buffer(sm, g),
        [&](int r) {
          return k0 + r < k_end ? a.kv_buffer + static_cast<int64_t>(__ldg(seg.kv_idx + k0 + r)) * VMLA_DIM : nullptr;
        },
        a.kv_buffer);
  }
  cp_async_commit();
  if (tid < BM) sM[tid] = VMLA_NEG_INF;
  cp_async_wait_all();
  fence_async_smem();
  __syncthreads();
  VMLA_MARK(2);

  const WgRows rows(seg, row0, a.num_heads, warp, lane / 4);
  float acc[PV_N / 8][4];
#pragma unroll
  for (int i = 0; i < PV_N / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float l[2] = {0.f, 0.f};
  float s[8][4];
  uint32_t pa[4][4];
  issue_qk(s, sm, wg);
  wg_wait<0>();
  fence_operands(s);

  for (int it = 0; it < iters; ++it) {
    int tok[2] = {rows.token[0], rows.token[1]};
    asm volatile("" : "+r"(tok[0]), "+r"(tok[1]));  // (the mask rows' addresses are not held across the loop)
    const int blk = 2 * it + wg;                    // this warpgroup's block
    const int k0 = k_begin + blk * BLK;
    const bool more = it + 1 < iters;
    const int r_lo = row_lo();
    int ids[2][4];  // slot ids of the next two blocks' rows this thread gathers (loaded under a P V)
    float x[2][16], mx[2], m_new[2], sc[2];
    uint32_t vis[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
        x[h][2 * jt] = s[jt][2 * h];
        x[h][2 * jt + 1] = s[jt][2 * h + 1];
      }
#pragma unroll
      for (int w = 0; w < 2; ++w)
        vis[h][w] = visible_keys<32>(a, k0 + 32 * w, k_end, seg.prefix, r_lo + 8 * h < seg.valid_rows, tok[h]);
      mx[h] = masked_max16(x[h], vis[h], a, tig);
    }
    if (wg == 0) {
      float s1[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[h] = exp_row(x[h], mx[h], sM[r_lo + 8 * h], m_new[h], l[h]);
      __syncwarp();  // (every lane of a row has read the running max before its first lane writes it)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (tig == 0) {
          sS0[r_lo + 8 * h] = sc[h];
          sM[r_lo + 8 * h] = m_new[h];
        }
      rescale_rows(acc, sc);
      pack_p16(x, pa);
      arrive(BAR_S0);
      store_p(PWords(sP0, r_lo, tig), pa);  // (before the P V that reads pa: PTX leaves reading it under one undefined)
      issue_pv_regs(acc, pa, sm, 0, 0);
      sync(BAR_S1);  // warpgroup 1's max, scale and P
#pragma unroll
      for (int h = 0; h < 2; ++h) s1[h] = sS1[r_lo + 8 * h];
      rescale_p(PWords(sP0, r_lo, tig), s1);  // P on warpgroup 1's max
      fence_async_smem();
      arrive(BAR_P0);
      if (more) load_ids(ids[0], seg.kv_idx, k_begin + (2 * it + 2) * BLK, k_end);
      wg_wait<0>();
      fence_operands(acc);
      fence_operands(pa);
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] *= s1[h];
      rescale_rows(acc, s1);
      if (more) gather<0, 4>(sm, 0, a.kv_buffer, ids[0], k_begin + (2 * it + 2) * BLK, k_end);
      cp_async_commit();
      issue_pv_smem(acc, sP1, sm, 1, 0);
      if (more) load_ids(ids[1], seg.kv_idx, k_begin + (2 * it + 3) * BLK, k_end);
      wg_wait<0>();
      fence_operands(acc);
      if (more) gather<0, 4>(sm, 1, a.kv_buffer, ids[1], k_begin + (2 * it + 3) * BLK, k_end);
      cp_async_commit();
      if (more) {
        cp_async_wait<1>();
        fence_async_smem();
        sync(BAR_K0R);  // warpgroup 1's half of buffer 0 landed (and its reads of it done)
        issue_qk(s, sm, 0);
        cp_async_wait<0>();
        fence_async_smem();
        arrive(BAR_K1L);
        wg_wait<0>();
        fence_operands(s);
      }
    } else {
      float s0[2];
      sync(BAR_S0);  // warpgroup 0's max and scale
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        s0[h] = sS0[r];
        l[h] *= s0[h];
        sc[h] = exp_row(x[h], mx[h], sM[r], m_new[h], l[h]);
      }
      __syncwarp();  // (as above)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (tig == 0) {
          sS1[r_lo + 8 * h] = sc[h];
          sM[r_lo + 8 * h] = m_new[h];
        }
        sc[h] *= s0[h];
      }
      rescale_rows(acc, sc);
      pack_p16(x, pa);
      store_p(PWords(sP1, r_lo, tig), pa);
      fence_async_smem();
      arrive(BAR_S1);
      issue_pv_regs(acc, pa, sm, 1, 1);
      sync(BAR_P0);  // warpgroup 0's P, on this max
      issue_pv_smem(acc, sP0, sm, 0, 1);
      if (more) load_ids(ids[0], seg.kv_idx, k_begin + (2 * it + 2) * BLK, k_end);
      wg_wait<0>();
      fence_operands(acc);
      fence_operands(pa);
      if (more) {
        gather<4, 9>(sm, 0, a.kv_buffer, ids[0], k_begin + (2 * it + 2) * BLK, k_end);
        cp_async_commit();
        load_ids(ids[1], seg.kv_idx, k_begin + (2 * it + 3) * BLK, k_end);
        gather<4, 9>(sm, 1, a.kv_buffer, ids[1], k_begin + (2 * it + 3) * BLK, k_end);
        cp_async_commit();
        cp_async_wait<1>();
        fence_async_smem();
        arrive(BAR_K0R);
        cp_async_wait<0>();
        fence_async_smem();
        sync(BAR_K1L);  // warpgroup 0's half of buffer 1 landed
        issue_qk(s, sm, 1);
        wg_wait<0>();
        fence_operands(s);
      }
    }
  }

  VMLA_MARK(3);
  const int r_lo = row_lo();
  const WgRows rows_end(seg, row0, a.num_heads, r_lo / 16, r_lo % 16);
  // ---- epilogue: each warpgroup's share of the row sums, added; the final max; o or the partial, lse ----
  __syncthreads();  // (the last s0 / s1 read before they hold the sums)
  RowState st[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st[h].l = l[h];
    sum_row_shares(st[h]);
    if (tig == 0) (wg == 0 ? sS0 : sS1)[r_lo + 8 * h] = st[h].l;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    st[h].l = sS0[r] + sS1[r];  // l0 + l1: the same bits in both
    st[h].m = sM[r];
  }
  store_rows(acc, st, rows_end, wg, tig, a, seg.grow0, out_o, out_lse);
  merge(seg.grow0, seg.valid_rows);
  cp_async_wait_all();
  __syncthreads();
}
#endif

}  // namespace vmla_wg
