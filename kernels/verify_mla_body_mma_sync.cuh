// The mma.sync segment body of verify_mla.cu (every target but the Hopper path; the design is in verify_mla.cu's
// header comment): Q fragments, the cp.async ring of K tiles, QK as dim-slice x row-group x key-part partials,
// the softmax step through shared memory, P V per warp's output columns. Included by verify_mla.cu after
// NUM_THREADS, TileMerge and merge_if_last, which the Hopper bodies share.
#pragma once

#include "verify_mla_common.cuh"

namespace {
using namespace vmla;

constexpr int KSTEPS_PER_SLICE = KSTEPS / VMLA_DSLICES;  // 9 k16-steps of QK per warp
constexpr int MT = VMLA_BM / 16;                         // m16 tiles per block
constexpr int QK_MT = MT / VMLA_RGROUPS;                 // m16 tiles per warp in QK
constexpr int QK_NT = VMLA_BN / VMLA_KHALVES / 8;        // n8 tiles of keys per warp in QK
constexpr int PASS_NT = QK_NT / VMLA_KPASSES;            // ... per pass over them
constexpr int PV_COLS = VMLA_VDIM / VMLA_WARPS;          // output columns per warp
constexpr int PV_NT = PV_COLS / 8;
constexpr int CHUNKS_PER_ROW = VMLA_DIM * 2 / 16;       // 16-byte pieces per 576-wide row
constexpr int THREADS_PER_ROW = NUM_THREADS / VMLA_BM;  // softmax threads per row
constexpr int COLS_PER_THREAD = VMLA_BN / THREADS_PER_ROW;

static_assert(VMLA_DSLICES * VMLA_RGROUPS * VMLA_KHALVES == VMLA_WARPS, "QK split must use every warp");
static_assert(QK_MT * VMLA_RGROUPS == MT && PASS_NT % 2 == 0 && PASS_NT * VMLA_KPASSES == QK_NT,
              "QK rows and keys must split evenly");
static_assert(KSTEPS_PER_SLICE * 16 * VMLA_DSLICES == VMLA_DIM, "dims must split evenly");
static_assert(PV_COLS * VMLA_WARPS == VMLA_VDIM && PV_NT % 2 == 0, "output columns must split evenly");
static_assert(COLS_PER_THREAD % 4 == 0 && THREADS_PER_ROW <= 32, "softmax step reads float4s within a warp");
static_assert(VMLA_S_PAD > 0 || COLS_PER_THREAD == 4, "a swizzled partial-score row is read one float4 a thread");
static_assert(VMLA_Q_SMEM || VMLA_BM <= VMLA_BN || VMLA_BM <= VMLA_STAGES * VMLA_BN,
              "Q staging reuses one K stage buffer (or, for BM > BN, all of them)");
constexpr bool Q_STAGED_ACROSS = !VMLA_Q_SMEM && VMLA_BM > VMLA_BN;  // Q staged over every K stage

// Rows of tile j are issued at iteration j - STAGES + 1; their slot ids are fetched STAGES - 1 iterations
// before that (so they have landed when needed): at iteration t we fetch the ids of tile t + SLOT_AHEAD.
constexpr int SLOT_AHEAD = 2 * VMLA_STAGES - 2;
constexpr int IDX_RING = 2 * VMLA_STAGES;

struct Smem {
#if VMLA_Q_SMEM
  __nv_bfloat16 q[VMLA_BM][ROW_STRIDE];  // Q stays here; QK reads its fragments every tile
#endif
  __nv_bfloat16 kv[VMLA_STAGES][VMLA_BN][ROW_STRIDE];
  int idx[IDX_RING][VMLA_BN];
  float s[VMLA_DSLICES][VMLA_BM][S_STRIDE];
  __nv_bfloat16 p[VMLA_BM][P_STRIDE];
  float alpha[VMLA_BM];
  float l_final[VMLA_BM];
  int flag[4];  // [0]: this block merges the row tile (fused merge)
};

// Copy ROWS rows of VMLA_DIM bf16 into shared memory (dst rows ROW_STRIDE apart) with 16-byte cp.async; row r
// comes from row_src(r), or is zero-filled where that is null. NUM_THREADS / ROWS threads share a row, thread j
// taking its chunks j, j + TPR, ... (the first threads one more where TPR does not divide a row's 72): one address
// per thread and row, and every 8 threads' copies cover one 128-byte run of a row (no bank conflicts). (Rows that
// do not divide the threads: chunk c to thread c % NUM_THREADS.)
template <int ROWS, class RowSrc>
__device__ __forceinline__ void gather_rows(__nv_bfloat16 (*dst)[ROW_STRIDE], RowSrc row_src,
                                            const __nv_bfloat16* fallback) {
  constexpr int TPR = NUM_THREADS / ROWS;
  if constexpr (NUM_THREADS % ROWS == 0 && TPR >= 4) {
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const __nv_bfloat16* src = row_src(r);
#pragma unroll
    for (int i = 0; i < (CHUNKS_PER_ROW + TPR - 1) / TPR; ++i) {
      const int part = j + i * TPR;
      if (CHUNKS_PER_ROW % TPR != 0 && part >= CHUNKS_PER_ROW) break;
      cp_async_16(&dst[r][part * 8], src != nullptr ? src + part * 8 : fallback, src != nullptr);
    }
  } else {
    for (int c = threadIdx.x; c < ROWS * CHUNKS_PER_ROW; c += NUM_THREADS) {
      const int r = c / CHUNKS_PER_ROW, part = c % CHUNKS_PER_ROW;
      const __nv_bfloat16* src = row_src(r);
      cp_async_16(&dst[r][part * 8], src != nullptr ? src + part * 8 : fallback, src != nullptr);
    }
  }
}

// Gather BN pool rows (keys [k0, k0 + BN) of this segment, slot ids already in idx[slot]) into one stage;
// rows past k_end are zero.
__device__ __forceinline__ void load_kv_tile(Smem& sm, int stage, int slot, const __nv_bfloat16* __restrict__ kv_buffer,
                                             int k0, int k_end) {
#ifndef VMLA_SKIP_LOAD
  gather_rows<VMLA_BN>(
      sm.kv[stage],
      [&](int r) { return k0 + r < k_end ? kv_buffer + static_cast<int64_t>(sm.idx[slot][r]) * VMLA_DIM : nullptr; },
      kv_buffer);
#endif
}

}  // namespace

// One segment: rows [row0, row0 + BM) of request b against its keys [k_begin, k_end). Writes o/lse (out_o
// null) or the fp32 partial out_o[BM][512], out_lse[BM] normalised by its own sum (then merges the tile if
// merge.counter is set and this block is the tile's last).
__device__ __forceinline__ void verify_segment(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                               float* __restrict__ out_o, float* __restrict__ out_lse,
                                               const TileMerge& merge) {
  const __nv_bfloat16* __restrict__ q = a.q;
  const __nv_bfloat16* __restrict__ kv_buffer = a.kv_buffer;
  const int num_heads = a.num_heads;
  const SegmentRows seg(a, b, row0);
  const int q0 = seg.q0, rows = seg.rows, prefix = seg.prefix, valid_rows = seg.valid_rows;
  const int* kv_idx = seg.kv_idx;
  const int64_t grow0 = seg.grow0;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // ---- prologue: Q into shared memory (its own buffer, or staged in the last K stage) ----
#if VMLA_Q_SMEM
  __nv_bfloat16(*qs)[ROW_STRIDE] = sm.q;
#else
  __nv_bfloat16(*qs)[ROW_STRIDE] = Q_STAGED_ACROSS ? sm.kv[0] : sm.kv[VMLA_STAGES - 1];
#endif
  const int num_tiles = (k_end - k_begin + VMLA_BN - 1) / VMLA_BN;
  gather_rows<VMLA_BM>(qs, [&](int r) { return row0 + r < rows ? q + (grow0 + r) * VMLA_DIM : nullptr; }, q);
#pragma unroll
  for (int j = 0; j < SLOT_AHEAD; ++j) load_tile_slots(sm.idx[j], kv_idx, k_begin + j * VMLA_BN, k_end);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();  // Q staged, slot ids of the first tiles in shared memory
  auto issue_first_tiles = [&] {
#pragma unroll
    for (int j = 0; j < VMLA_STAGES - 1; ++j) {  // one commit group per tile
      if (j < num_tiles) load_kv_tile(sm, j, j, kv_buffer, k_begin + j * VMLA_BN, k_end);
      cp_async_commit();
    }
  };
  if constexpr (!Q_STAGED_ACROSS) issue_first_tiles();

  // QK role of this warp: a slice of the dims, a group of rows, a part of the keys
  const int dslice = warp % VMLA_DSLICES;
  const int rgroup = (warp / VMLA_DSLICES) % VMLA_RGROUPS;
  const int khalf = warp / (VMLA_DSLICES * VMLA_RGROUPS);
  const int qk_row0 = rgroup * QK_MT * 16;
#if !VMLA_Q_SMEM
  // Q fragments in registers: qf[m-tile][k-step] for this warp's rows and dim slice (while tile 0 lands)
  uint32_t qf[QK_MT][KSTEPS_PER_SLICE][4];
#pragma unroll
  for (int mi = 0; mi < QK_MT; ++mi)
#pragma unroll
    for (int ks = 0; ks < KSTEPS_PER_SLICE; ++ks) {
      const int r = qk_row0 + mi * 16 + ((lane / 8) % 2) * 8 + lane % 8;
      const int d = dslice * KSTEPS_PER_SLICE * 16 + ks * 16 + (lane / 16) * 8;
      ldmatrix_x4(qf[mi][ks], &qs[r][d]);
    }
  // the loop's first barrier also frees the Q staging buffer (the last stage)
#endif
  if constexpr (Q_STAGED_ACROSS) {  // Q fills every stage: its fragments leave before the first rows land
    __syncthreads();
    issue_first_tiles();
  }

  // softmax-step state: THREADS_PER_ROW threads per row, each COLS_PER_THREAD keys of a tile
  const int srow = tid / THREADS_PER_ROW, scol = (tid % THREADS_PER_ROW) * COLS_PER_THREAD;
  const bool srow_valid = row0 + srow < rows;
  // whole warps of padding rows skip the softmax step (their m16 tiles hold no scores and feed no output)
  const bool swarp_valid = (warp * 32) / THREADS_PER_ROW < valid_rows;
  const int stoken = q0 + (srow_valid ? (row0 + srow) / num_heads : 0);
  RowState st;

  float acc[MT][PV_NT][4];
  zero_frags(acc);

  // ---- S partial = Q[:, slice] K[keys of this part, slice]^T for the tile in `stage`, to sm.s ----
  // (in VMLA_KPASSES passes over the part's keys: fewer score registers live at once, for 4-warp blocks)
  auto qk_tile = [&](int stage) {
    if (qk_row0 >= valid_rows) return;  // this warp's rows are all padding (a request's last row tile)
#pragma unroll
    for (int kp = 0; kp < VMLA_KPASSES; ++kp) {
      float s[QK_MT][PASS_NT][4];
      zero_frags(s);
      const int key_base = khalf * (VMLA_BN / VMLA_KHALVES) + kp * PASS_NT * 8;
#pragma unroll
      for (int ks = 0; ks < KSTEPS_PER_SLICE; ++ks) {
        const int d0 = dslice * KSTEPS_PER_SLICE * 16 + ks * 16;
#if VMLA_Q_SMEM
        uint32_t qa[QK_MT][4];
#pragma unroll
        for (int mi = 0; mi < QK_MT; ++mi)
          if (qk_row0 + mi * 16 < valid_rows) load_a_frag<ROW_STRIDE>(qa[mi], &qs[0][0], qk_row0 + mi * 16, d0, lane);
#define VMLA_QFRAG(mi) qa[mi]
#else
#define VMLA_QFRAG(mi) qf[mi][ks]
#endif
#pragma unroll
        for (int np = 0; np < PASS_NT; np += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, &sm.kv[stage][key_base + np * 8 + (lane / 16) * 8 + lane % 8][d0 + ((lane / 8) % 2) * 8]);
#ifndef VMLA_SKIP_QK
#pragma unroll
          for (int mi = 0; mi < QK_MT; ++mi) {
            if (qk_row0 + mi * 16 >= valid_rows) continue;  // a tile's last rows may be padding: no work
            mma_bf16(s[mi][np], VMLA_QFRAG(mi), kb[0], kb[1]);
            mma_bf16(s[mi][np + 1], VMLA_QFRAG(mi), kb[2], kb[3]);
          }
#else
          s[0][np][0] += __uint_as_float(kb[0] ^ kb[3] ^ VMLA_QFRAG(0)[0]);
#endif
        }
#undef VMLA_QFRAG
      }
      store_scores(&sm.s[dslice][0][0], s, qk_row0, key_base, valid_rows, lane);
    }
  };

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % VMLA_STAGES;
    const int k0 = k_begin + t * VMLA_BN;
    cp_async_wait<VMLA_STAGES - 2>();  // tile t has landed (newer tiles may still be in flight)
    __syncthreads();  // tile t visible to all; every warp is past P.V of tile t-1, whose buffer we refill now
    {
      const int ahead = t + VMLA_STAGES - 1;
      if (ahead < num_tiles)
        load_kv_tile(sm, ahead % VMLA_STAGES, ahead % IDX_RING, kv_buffer, k_begin + ahead * VMLA_BN, k_end);
      load_tile_slots(sm.idx[(t + SLOT_AHEAD) % IDX_RING], kv_idx, k_begin + (t + SLOT_AHEAD) * VMLA_BN, k_end);
      cp_async_commit();
    }
    qk_tile(stage);
    __syncthreads();
    // ---- softmax step: sum the partials, scale, cap, mask, online max/sum; P and alpha to shared memory ----
    float alpha = 1.f;
    if (swarp_valid) {
      float x[COLS_PER_THREAD];
      sum_partials<COLS_PER_THREAD, VMLA_DSLICES>(x, &sm.s[0][srow][s_col(srow, scol)], VMLA_BM * S_STRIDE);
      alpha = softmax_step<COLS_PER_THREAD, THREADS_PER_ROW>(st, x, &sm.p[srow][scol], a, k0 + scol, k_end, prefix,
                                                             srow_valid, stoken);
    }
    if (tid % THREADS_PER_ROW == 0) sm.alpha[srow] = alpha;
    // P and alpha visible to all; and did any row move its max (then the accumulators need rescaling)?
    const bool moved = __syncthreads_or(alpha != 1.f);
    // ---- O = alpha * O + P V for this warp's output columns ----
    if (moved) rescale_acc(acc, sm.alpha, lane);
    pv_step(acc, &sm.p[0][0], &sm.kv[stage][0][0], warp * PV_COLS, valid_rows, lane);
  }

  // ---- epilogue ----
  if (tid % THREADS_PER_ROW == 0) {
    sm.l_final[srow] = st.l;
    if (srow_valid) store_row_lse(a, st, grow0, srow, out_o, out_lse);
  }
  __syncthreads();
  store_acc(acc, warp * PV_COLS, valid_rows, sm.l_final, a, grow0, out_o, lane);
  if (out_o != nullptr && merge.counter != nullptr) merge_if_last(sm, a, merge, grow0, valid_rows);
  cp_async_wait_all();  // slot-id prefetches past the end must land before the next segment reuses the ring
  __syncthreads();      // the next segment reuses every shared buffer
}
