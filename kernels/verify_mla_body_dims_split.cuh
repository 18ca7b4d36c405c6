// The Hopper dims_split body (VMLA_WGMMA without VMLA_SPLIT_KEYS; verify_mla_wgmma_common.cuh has the overview).
#pragma once

#include "verify_mla_wgmma_common.cuh"

namespace vmla_wg {

// One segment: rows [row0, row0 + 64) of request b against its keys [k_begin, k_end). Writes o/lse (out_o null)
// or the fp32 partial out_o[64][512], out_lse[64] normalised by its own sum.
template <class Merge>
__device__ __forceinline__ void verify_segment_dims_split(Smem& sm, const Args& a, int b, int row0, int k_begin,
                                                          int k_end, float* __restrict__ out_o,
                                                          float* __restrict__ out_lse, Merge&& merge) {
  const int num_heads = a.num_heads;
  const SegmentRows seg(a, b, row0);
  const int prefix = seg.prefix, valid_rows = seg.valid_rows;
  const int* kv_idx = seg.kv_idx;
  const int64_t grow0 = seg.grow0;
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, tig = lane % 4;
  const int num_tiles = (k_end - k_begin + BN - 1) / BN;
  static_assert(SLOT_AHEAD + 1 <= IDX_RING, "the slot-id ring holds the ids requested and not yet used");

  start_segment<BM, SLOT_AHEAD, LOAD_AHEAD>(sm, a, seg, row0, k_begin, k_end, num_tiles);

  const WgRows rows(seg, row0, num_heads, warp, g);
  const int r_lo = rows.r_lo;
  RowState st[2];
  float acc[PV_N / 8][4];
#pragma unroll
  for (int i = 0; i < PV_N / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // ---- the steps of a tile ----
  // top(t): tile t landed and visible to the tensor cores (and every warpgroup past the steps that read the
  // stage refilled now), then the rows of tile t + LOAD_AHEAD and the slot ids of tile t + SLOT_AHEAD requested
  auto top = [&](int t) {
    cp_async_wait<LOAD_AHEAD - 1>();
    fence_async_smem();
    __syncthreads();
    const int ahead = t + LOAD_AHEAD;
    if (ahead < num_tiles)
      load_kv_tile(sm, ahead % VMLA_STAGES, ahead % IDX_RING, a.kv_buffer, k_begin + ahead * BN, k_end);
    load_tile_slots(sm.idx[(t + SLOT_AHEAD) % IDX_RING], kv_idx, k_begin + (t + SLOT_AHEAD) * BN, k_end);
    cp_async_commit();
  };
  // this warpgroup's 18 k-steps of QK for the tile in `stage` (asynchronous: one commit group)
  auto issue_qk = [&](float (&s)[NT][4], int stage) { vmla_wg::issue_qk(s, sm, stage, wg); };
  // exchange the partial scores: both warpgroups get the full sum (part 0 + part 1, the same bits)
  auto scores = [&](const float (&s)[NT][4], float (&x)[2][8]) {
#ifdef VMLA_SKIP_EXCHANGE  // timing experiment: this warpgroup's partial only (no shared memory, no barrier)
    score_rows(s, x);
    return;
#endif
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      *reinterpret_cast<float2*>(&sm.s[wg][r_lo][j * 8 + tig * 2]) = make_float2(s[j][0], s[j][1]);
      *reinterpret_cast<float2*>(&sm.s[wg][r_lo + 8][j * 8 + tig * 2]) = make_float2(s[j][2], s[j][3]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 o0 = *reinterpret_cast<const float2*>(&sm.s[0][r_lo + 8 * h][j * 8 + tig * 2]);
        const float2 o1 = *reinterpret_cast<const float2*>(&sm.s[1][r_lo + 8 * h][j * 8 + tig * 2]);
        x[h][j * 2] = o0.x + o1.x;
        x[h][j * 2 + 1] = o0.y + o1.y;
      }
  };
  auto softmax = [&](float (&x)[2][8], int t, float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      alpha[h] = softmax_row(
          st[h], x[h], visible_keys<BN>(a, k_begin + t * BN, k_end, prefix, rows.valid[h], rows.token[h]), a, tig);
  };

  float s[NT][4], x[2][8], alpha[2];
  uint32_t pa[2][4];
  // Software pipeline: QK of tile t and P V of tile t-1 are issued together; the exchange and the softmax of
  // tile t run while P V of tile t-1 is on the tensor cores (its V stays in its stage: 3 stages).
#if VMLA_WG_PIPE == 1
  auto stash_p = [&](const float (&x)[2][8], int) { pack_p(x, pa); };
  auto issue_pv_of = [&](int t) { issue_pv(acc, pa, sm, t % VMLA_STAGES, wg); };
  auto pv_done = [&]() {  // the accumulators and P's registers are free again
    fence_operands(acc);
    fence_operands(pa);
  };
#endif
#if VMLA_WG_PIPE
  if (num_tiles > 0) {
    top(0);
    VMLA_MARK(2);
    issue_qk(s, 0);
    wg_wait<0>();
    fence_operands(s);
    scores(s, x);
    softmax(x, 0, alpha);  // the accumulators are still zero: no rescale
    stash_p(x, 0);
    for (int t = 1; t < num_tiles; ++t) {
      top(t);  // P of tile t-1 published; both warpgroups past the exchange of tile t-1 and P V of tile t-2
      issue_qk(s, t % VMLA_STAGES);
      issue_pv_of(t - 1);
      wg_wait<1>();  // QK of tile t (P V of tile t-1 may still run)
      fence_operands(s);
      scores(s, x);
      softmax(x, t, alpha);
      wg_wait<0>();  // P V of tile t-1
      pv_done();
      rescale_rows(acc, alpha);
      stash_p(x, t);
    }
    issue_pv_of(num_tiles - 1);
    wg_wait<0>();
    pv_done();
  }
#else
  for (int t = 0; t < num_tiles; ++t) {  // one tile at a time: QK, exchange, softmax, P V
    const int stage = t % VMLA_STAGES;
    top(t);
    issue_qk(s, stage);
    wg_wait<0>();
    fence_operands(s);
    scores(s, x);
    softmax(x, t, alpha);
    rescale_rows(acc, alpha);
    pack_p(x, pa);
    issue_pv(acc, pa, sm, stage, wg);
    wg_wait<0>();
    fence_operands(acc);
    fence_operands(pa);
  }
#endif

  VMLA_MARK(3);
  // ---- epilogue: the row sums (4 shares), o or the partial, lse ----
#pragma unroll
  for (int h = 0; h < 2; ++h) sum_row_shares(st[h]);
  store_rows(acc, st, rows, wg, tig, a, grow0, out_o, out_lse);
  merge(grow0, valid_rows);
  cp_async_wait_all();
  __syncthreads();
}

}  // namespace vmla_wg
