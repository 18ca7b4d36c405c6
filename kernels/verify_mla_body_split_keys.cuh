// The Hopper split_keys body (VMLA_SPLIT_KEYS, the default; verify_mla_wgmma_common.cuh has the overview).
#pragma once

#include "verify_mla_wgmma_common.cuh"

namespace vmla_wg {

#if VMLA_SPLIT_KEYS
// ---- warpgroups on their own tiles (VMLA_SPLIT_KEYS) ----
// A step is 64 keys, two tiles: warpgroup g scores tile 2 i + g over all 576 dims (36 wgmma m64n32k16), so no
// partial scores cross between them and each runs the softmax of its own tile only. The two trade their rows'
// maxima (both then take the same reference max, so alpha and the running max are the same in both), each
// exponentiates its tile, and they trade P as bf16 A fragments (4 KB each way): each accumulates its 256 output
// columns over both tiles, P V of its own tile issued before the trade. Each keeps its own tiles' share of
// the row sums; the two are added at the end. Four stages: this step's two tiles and the next step's, loaded a
// whole step ahead. A segment with an odd number of tiles gives its last step a zero-filled second tile.
template <class Merge>
__device__ __forceinline__ void verify_segment_split_keys(Smem& sm, const Args& a, int b, int row0, int k_begin,
                                                          int k_end, float* __restrict__ out_o,
                                                          float* __restrict__ out_lse, Merge&& merge) {
  const SegmentRows seg(a, b, row0);
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, tig = lane % 4;
  const int num_tiles = (k_end - k_begin + BN - 1) / BN, padded_tiles = num_tiles + (num_tiles & 1);

  start_segment<BM, 4, 2>(sm, a, seg, row0, k_begin, k_end, padded_tiles);
  const WgRows rows(seg, row0, a.num_heads, warp, lane / 4);
  RowState st[2];
  float acc[PV_N / 8][4];
#pragma unroll
  for (int i = 0; i < PV_N / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  // P fragments, [warpgroup][warp][k16 step][register][lane]: a thread reads the other warpgroup's at its own place
  uint32_t* pf_mine = reinterpret_cast<uint32_t*>(&sm.p[0][0][0]) + (wg * 4 + warp) * 8 * 32 + lane;
  const uint32_t* pf_other = reinterpret_cast<uint32_t*>(&sm.p[0][0][0]) + ((wg ^ 1) * 4 + warp) * 8 * 32 + lane;

  VMLA_PHASE_CLOCK;
  for (int t0 = 0; t0 < padded_tiles; t0 += 2) {
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();  // this step's tiles landed, visible to the tensor cores; both warpgroups past the last step
    VMLA_PHASE(0);
    if (t0 == 0) VMLA_MARK(2);
    const int mine = t0 + wg;
    float s[NT][4], x[2][8], mx[2], alpha[2];
    issue_qk_steps<0, KSTEPS>(s, desc(&sm.q[0][0][0], 16, 1024), desc(&sm.kv[mine % VMLA_STAGES][0][0][0], 16, 1024));
    // while QK runs: the next step's tiles into the stages of the last, and the slot ids of the step after
#pragma unroll 1
    for (int j = 2; j < 4; ++j)
      if (t0 + j < padded_tiles)
        load_kv_tile(sm, (t0 + j) % VMLA_STAGES, (t0 + j) % IDX_RING, a.kv_buffer, k_begin + (t0 + j) * BN, k_end);
#pragma unroll
    for (int j = 4; j < 6; ++j)
      load_tile_slots(sm.idx[(t0 + j) % IDX_RING], seg.kv_idx, k_begin + (t0 + j) * BN, k_end);
    cp_async_commit();
    VMLA_PHASE(1);
    wg_wait<0>();
    fence_operands(s);
    VMLA_PHASE(2);
    score_rows(s, x);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = masked_row_max(
          x[h], visible_keys<BN>(a, k_begin + mine * BN, k_end, seg.prefix, rows.valid[h], rows.token[h]), a, tig);
      if (tig == 0) sm.s[wg][rows.r_lo + 8 * h][0] = mx[h];
    }
    VMLA_PHASE(3);
    __syncthreads();  // both warpgroups' row maxima
    VMLA_PHASE(4);
#pragma unroll
    for (int h = 0; h < 2; ++h) alpha[h] = row_exp(st[h], x[h], fmaxf(mx[h], sm.s[wg ^ 1][rows.r_lo + 8 * h][0]));
    rescale_rows(acc, alpha);
    uint32_t pa[2][4], po[2][4];
    pack_p(x, pa);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pf_mine[(kk * 4 + e) * 32] = pa[kk][e];
    issue_pv(acc, pa, sm, mine % VMLA_STAGES, wg);  // (in flight through the trade)
    VMLA_PHASE(5);
    __syncthreads();  // both warpgroups' P
    VMLA_PHASE(6);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) po[kk][e] = pf_other[(kk * 4 + e) * 32];
    issue_pv(acc, po, sm, (t0 + (wg ^ 1)) % VMLA_STAGES, wg);
    wg_wait<0>();
    fence_operands(acc);
    fence_operands(pa);
    fence_operands(po);
    VMLA_PHASE(7);
  }
  VMLA_PHASE_FLUSH;

  VMLA_MARK(3);
  // ---- epilogue: each warpgroup's share of the row sums, added; o or the partial, lse ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum_row_shares(st[h]);
    if (tig == 0) sm.s[wg][rows.r_lo + 8 * h][1] = st[h].l;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) st[h].l += sm.s[wg ^ 1][rows.r_lo + 8 * h][1];  // l0 + l1: the same bits in both
  store_rows(acc, st, rows, wg, tig, a, seg.grow0, out_o, out_lse);
  merge(seg.grow0, seg.valid_rows);
  cp_async_wait_all();
  __syncthreads();
}
#endif

}  // namespace vmla_wg
