// The Hopper path's few-row segment (VMLA_FEW_ROWS; verify_mla_wgmma_common.cuh has the overview).
#pragma once

#include "verify_mla_wgmma_common.cuh"

namespace vmla_wg {

// ---- few-row tiles (VMLA_FEW_ROWS) ----
// A row tile of at most 16 rows - a request's last, such as the small tree's node 16 x 8 heads - costs a 64-row
// wgmma tile the full price (the H200 times a tile at ~1.9 us whatever its real rows). Such a tile runs this
// mma.sync segment instead: one m16 row block over the same swizzled stages and slot-id ring, no wgmma (so none
// of the kernel's wgmmas is under a branch ptxas cannot prove warpgroup-uniform). Same arithmetic contract as
// the 64-row segment (fp32 scores and accumulators, bf16 P, the mma.sync path's softmax step); not the same bits.
// Each shared byte is read about once (the first cut, which reloaded Q every tile and had every warp sum all
// partial scores, read ~212 KB a tile by count and cost ~0.8 of a 64-row unit on the H200; this one ~121 KB, ~0.6):
//   QK:  warp w scores keys [16 (w % 2), +16) over dims [144 (w / 2), +144): 9 k16 steps with its Q fragments
//        in registers (loaded once a segment) and K by ldmatrix (two n8 tiles a load).
//   softmax: the four dim quarters summed by 128 threads (8 a row, 4 keys each), P (bf16) and alpha to shared
//        memory.
//   PV:  warp w accumulates output columns [64 w, 64 w + 64) (8 n8 tiles, V by ldmatrix.trans): 32 fp32 a thread.
// Without a P V in flight across tiles, two tiles load ahead (3 stages) and the slot ids four. Beside the
// split_keys loop (whose score buffer holds row statistics only) the partial scores go in the last of its 4 stages.
constexpr int FEW_BM = 16;                                 // rows scored (one m16 block)
constexpr int FEW_QROWS = 32;                              // Q rows gathered (gather_swizzled splits 32 rows evenly)
constexpr int FEW_STAGES = VMLA_STAGES - VMLA_SPLIT_KEYS;  // (split_keys: the last stage holds the scores)
constexpr int FEW_LOAD_AHEAD = FEW_STAGES - 1, FEW_SLOT_AHEAD = 2 * FEW_LOAD_AHEAD;
constexpr int FEW_DSPLIT = 4, FEW_KSTEPS = KSTEPS / FEW_DSPLIT;  // QK: dim quarters, k16 steps in each
constexpr int FEW_COLS = 4, FEW_TPR = BN / FEW_COLS;             // softmax: keys a thread, threads a row
static_assert(VMLA_FEW_ROWS <= FEW_BM, "a few-row tile is one m16 block");
static_assert(FEW_SLOT_AHEAD + 1 <= IDX_RING, "the slot-id ring holds the ids requested and not yet used");
static_assert(FEW_BM * P_STRIDE <= 2 * BM * BN, "P fits the P buffers");
static_assert(FEW_DSPLIT * 2 == VMLA_WARPS && FEW_BM * FEW_TPR <= NUM_THREADS, "warps = dim quarters x key halves");
static_assert((FEW_DSPLIT + 1) * FEW_BM * SX_STRIDE <= (VMLA_SPLIT_KEYS ? ATOMS * BN * 32 : 2 * BM * SX_STRIDE),
              "the partial scores and row statistics fit their buffer");

template <class Merge>
__device__ __forceinline__ void verify_segment_few(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                                   float* __restrict__ out_o, float* __restrict__ out_lse,
                                                   Merge&& merge) {
  const SegmentRows seg(a, b, row0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  const int kh = warp % 2, dq = warp / 2;  // QK: this warp's key half (2 n8 tiles) and dim quarter
  const int num_tiles = (k_end - k_begin + BN - 1) / BN;
  // [FEW_DSPLIT][FEW_BM rows][SX_STRIDE] partial scores
  float* part = VMLA_SPLIT_KEYS ? reinterpret_cast<float*>(&sm.kv[FEW_STAGES][0][0][0]) : &sm.s[0][0][0];
  float* row_alpha = part + FEW_DSPLIT * FEW_BM * SX_STRIDE;  // [FEW_BM], then the rows' sums [FEW_BM]
  __nv_bfloat16* p = &sm.p[0][0][0];                          // [FEW_BM][P_STRIDE]
  // softmax threads (tid < 128): row srow, keys [scol, scol + 4)
  const int srow = tid / FEW_TPR, scol = (tid % FEW_TPR) * FEW_COLS;
  const bool soft = tid < FEW_BM * FEW_TPR, srow_valid = soft && srow < seg.valid_rows;
  const int stoken = seg.q0 + (srow_valid ? (row0 + srow) / a.num_heads : 0);

  start_segment<FEW_QROWS, FEW_SLOT_AHEAD, FEW_LOAD_AHEAD>(sm, a, seg, row0, k_begin, k_end, num_tiles);
  uint32_t qf[FEW_KSTEPS][4];  // this warp's Q fragments (rows 0-15, its dim quarter)
#pragma unroll
  for (int i = 0; i < FEW_KSTEPS; ++i)
    ldmatrix_x4(qf[i], &sm.q[0][0][0] +
                           swizzled<FEW_QROWS>(lane % 8 + ((lane / 8) % 2) * 8, 2 * (dq * FEW_KSTEPS + i) + lane / 16));

  RowState st;
  float acc[1][8][4];  // one m16 block x this warp's 8 n8 tiles of output columns
  zero_frags(acc);
  const int k_key = kh * 16 + (lane / 16) * 8 + lane % 8,
            k_chunk = 2 * dq * FEW_KSTEPS + (lane / 8) % 2;  // K: 2 n8 tiles a load
  const int v_key = ((lane / 8) % 2) * 8 + lane % 8, v_chunk = warp * 8 + lane / 16;

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % FEW_STAGES;
    cp_async_wait<FEW_LOAD_AHEAD - 1>();  // tile t landed (the next may still be in flight)
    __syncthreads();  // ... for every thread; all warps past tile t-1 (its stage, P and the scores are free)
    if (t == 0) VMLA_MARK(2);
    {
      const int ahead = t + FEW_LOAD_AHEAD;
      if (ahead < num_tiles)
        load_kv_tile(sm, ahead % FEW_STAGES, ahead % IDX_RING, a.kv_buffer, k_begin + ahead * BN, k_end);
      load_tile_slots(sm.idx[(t + FEW_SLOT_AHEAD) % IDX_RING], seg.kv_idx, k_begin + (t + FEW_SLOT_AHEAD) * BN, k_end);
      cp_async_commit();
    }
    const __nv_bfloat16* skv = &sm.kv[stage][0][0][0];
    float sc[2][4] = {};  // the warp's two n8 tiles of keys
#ifndef VMLA_SKIP_QK
#pragma unroll
    for (int i = 0; i < FEW_KSTEPS; ++i) {
      uint32_t kf[4];
      ldmatrix_x4(kf, skv + swizzled<BN>(k_key, k_chunk + 2 * i));
      mma_bf16(sc[0], qf[i], kf[0], kf[1]);
      mma_bf16(sc[1], qf[i], kf[2], kf[3]);
    }
#endif
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(&part[(dq * FEW_BM + g + 8 * h) * SX_STRIDE + kh * 16 + j * 8 + tig * 2]) =
            make_float2(sc[j][2 * h], sc[j][2 * h + 1]);
    __syncthreads();
    float alpha = 1.f;
    if (soft) {
      float x[FEW_COLS];
      sum_partials<FEW_COLS, FEW_DSPLIT>(x, &part[srow * SX_STRIDE + scol], FEW_BM * SX_STRIDE);
      alpha = softmax_step<FEW_COLS, FEW_TPR>(st, x, p + srow * P_STRIDE + scol, a, k_begin + t * BN + scol, k_end,
                                              seg.prefix, srow_valid, stoken);
      if (scol == 0) row_alpha[srow] = alpha;
    }
    const bool moved = __syncthreads_or(alpha != 1.f);  // P and alpha visible; did any row move its max?
    if (moved) rescale_acc(acc, row_alpha, lane);
#ifndef VMLA_SKIP_PV
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t pa[4];
      load_a_frag<P_STRIDE>(pa, p, 0, kk * 16, lane);
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, skv + swizzled<BN>(kk * 16 + v_key, v_chunk + 2 * pr));
        mma_bf16(acc[0][2 * pr], pa, vf[0], vf[1]);
        mma_bf16(acc[0][2 * pr + 1], pa, vf[2], vf[3]);
      }
    }
#endif
  }

  VMLA_MARK(3);
  float* row_l = row_alpha + FEW_BM;
  if (soft && scol == 0) {
    row_l[srow] = st.l;
    if (srow_valid) store_row_lse(a, st, seg.grow0, srow, out_o, out_lse);
  }
  __syncthreads();
  store_acc(acc, warp * 64, seg.valid_rows, row_l, a, seg.grow0, out_o, lane);
  merge(seg.grow0, seg.valid_rows);
  cp_async_wait_all();
  __syncthreads();
}

}  // namespace vmla_wg
