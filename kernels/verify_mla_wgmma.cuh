// The Hopper path of verify_mla.cu (VMLA_WGMMA, sm_90a only): one segment of the stream-K walk with warpgroup
// MMAs reading Q, K and V straight from shared memory, no ldmatrix. sm_120 has no wgmma; it runs the mma.sync
// path. Same arithmetic contract as that path (fp32 scores and accumulators, bf16 P, online softmax in the log2
// domain with an exact running max), so the two agree to bf16 rounding, not bit for bit.
//
// Block: 64 rows (node, head), two warpgroups, 32-key tiles; two loops over them:
//   split_keys (VMLA_SPLIT_KEYS, the default; verify_segment_split_keys): a step is two tiles, warpgroup g
//        scores tile g over all 576 dims (wgmma m64n32k16, A = Q and B = K both from shared memory), the two
//        trade row maxima and then P, and each accumulates its output columns over both tiles.
//   dims_split (verify_segment_dims_split): each warpgroup takes half of the 36 k16 steps of one tile, writes its
//        fp32 partial to shared memory and adds the other's: both then hold the full scores of all 64 rows and run
//        the same softmax on them (registers, 2 rows x 8 keys a thread); optionally pipelined (VMLA_WG_PIPE).
//   PV (both): warpgroup g accumulates output columns [256 g, 256 g + 256) (wgmma m64n256k16, A = P from
//        registers, B = V from shared memory, N-major): 128 fp32 accumulators a thread.
// Shared memory holds Q and each K/V stage as 9 "atoms" of 64 dims (128 B a row) in the 128-byte swizzle the
// tensor cores read (16-byte chunk c of row r at chunk c ^ (r % 8)); the same bytes are K (K-major B operand of
// QK) and V (N-major B operand of PV).
#pragma once

#include "verify_mla_wgmma_ptx.cuh"

namespace vmla_wg {
using namespace vmla;

constexpr int BM = 64, BN = VMLA_BN, NUM_THREADS = 256;
constexpr int ATOMS = VMLA_DIM / 64;            // 9 atoms of 64 dims
constexpr int KSTEPS_PER_WG = KSTEPS / 2;       // 18 k16 steps of QK per warpgroup
constexpr int NT = BN / 8;                      // n8 tiles of keys in a score tile
constexpr int PV_N = VMLA_VDIM / 2;             // output columns per warpgroup
constexpr int SX_STRIDE = BN + 8;               // fp32 per row of a partial-score buffer (2-way bank conflicts)
// Rows of tile t + LOAD_AHEAD are requested at tile t (the pipelined loop keeps one more stage for the P V in
// flight); their slot ids SLOT_AHEAD tiles ahead, so they have landed by then.
constexpr int LOAD_AHEAD = VMLA_STAGES - 1 - (VMLA_WG_PIPE ? 1 : 0);
constexpr int SLOT_AHEAD = 2 * LOAD_AHEAD;
// The split_keys loop needs 4 slots (the ids of the next step's tiles, read, and of the step after, fetched); its
// few-row tiles, 3 stages deep, fetch 4 tiles ahead and need 5.
constexpr int IDX_RING = VMLA_SPLIT_KEYS ? 5 : 2 * VMLA_STAGES;
static_assert(LOAD_AHEAD >= 1, "the pipelined loop needs 3 stages");
static_assert(!VMLA_SPLIT_KEYS || (VMLA_STAGES == 4 && VMLA_WG_PIPE == 0),
              "the split_keys loop is 4 stages: a 64-key step and the next, loaded a step ahead");
static_assert(VMLA_WG_PIPE == 0 || VMLA_WG_PIPE == 1, "VMLA_WG_PIPE: 0 (QK then P V per tile) or 1 (pipelined)");
static_assert(BN == 32 && NT == 4, "the score fragments (wgmma_qk), the mask word and the PV k-steps assume 32-key tiles");
static_assert(VMLA_BM == 64 && VMLA_WARPS == 8, "the wgmma path is 64 rows, two warpgroups");

struct Smem {
  __nv_bfloat16 q[ATOMS][BM][64];               // 1024-byte aligned atoms (the block's base is)
  __nv_bfloat16 kv[VMLA_STAGES][ATOMS][BN][64];
  __nv_bfloat16 p[2][BM][BN];                   // the few-row segment's P; the split_keys loop's P fragments
#if VMLA_SPLIT_KEYS
  float s[2][BM][2];                            // each warpgroup's row maxima and sums (then the fused merge's weights)
#else
  float s[2][BM][SX_STRIDE];                    // each warpgroup's partial scores (then the fused merge's weights)
#endif
  int idx[IDX_RING][BN];
  int flag[4];
};
static_assert(sizeof(Smem::q) % 1024 == 0 && sizeof(Smem::kv[0]) % 1024 == 0, "atoms stay 1024-byte aligned");
static_assert(VMLA_FUSED_MERGE_SEGS * BM * sizeof(float) <= sizeof(Smem::s), "the fused merge's weights fit the score buffer");

// Registers an in-flight wgmma reads or writes: keep the compiler from moving their uses above the wait (or
// reusing P's registers before it), as if the wait had written them.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)); }
__device__ __forceinline__ void fence_operand(uint32_t& x) { asm volatile("" : "+r"(x)); }
template <class T, int A, int B>
__device__ __forceinline__ void fence_operands(T (&r)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) fence_operand(r[i][j]);
}
// acc += P V over one k16 step of keys: P = 64 x 16 from registers (mma.sync A-fragment layout), V = 16 keys x 256
// columns (desc, N-major). The 128 accumulators are operands 0-127.
#define VMLA_D128 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28," \
  "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55," \
  "%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82," \
  "%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107," \
  "%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define VMLA_ACC8(i) "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3]), \
  "+f"(acc[i + 1][0]), "+f"(acc[i + 1][1]), "+f"(acc[i + 1][2]), "+f"(acc[i + 1][3])
#define VMLA_ACC128 VMLA_ACC8(0), VMLA_ACC8(2), VMLA_ACC8(4), VMLA_ACC8(6), VMLA_ACC8(8), VMLA_ACC8(10), \
  VMLA_ACC8(12), VMLA_ACC8(14), VMLA_ACC8(16), VMLA_ACC8(18), VMLA_ACC8(20), VMLA_ACC8(22), VMLA_ACC8(24), \
  VMLA_ACC8(26), VMLA_ACC8(28), VMLA_ACC8(30)
#define VMLA_PV_OP "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " VMLA_D128
__device__ __forceinline__ void wgmma_pv(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[4], uint64_t db) {
  asm volatile(VMLA_PV_OP ", {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
               : VMLA_ACC128
               : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "l"(db));
}
// acc += P V over one k16 step, P = 64 x 16 from shared memory (desc, K-major), V = 16 keys x 256 (desc, N-major).
__device__ __forceinline__ void wgmma_pv_ss(float (&acc)[PV_N / 8][4], uint64_t da, uint64_t db) {
  asm volatile(VMLA_PV_OP ", %128, %129, p, 1, 1, 0, 1;\n}\n"
               : VMLA_ACC128
               : "l"(da), "l"(db));
}
#undef VMLA_PV_OP
#undef VMLA_ACC128
#undef VMLA_ACC8
#undef VMLA_D128

// Element offset of 16-byte chunk c (of 72) of row r in swizzled atoms of ROWS rows: atom c / 8 at ROWS * 64
// elements a step, chunk c % 8 of the row at (c % 8) ^ (r % 8).
template <int ROWS>
__device__ __forceinline__ int swizzled(int r, int c) { return ((c / 8) * ROWS + r) * 64 + (((c % 8) ^ (r % 8)) * 8); }

// Copy ROWS rows of 576 bf16 into swizzled atoms (dst = atom 0 of ROWS rows; atom a at dst + a * ROWS * 64):
// NUM_THREADS / ROWS threads a row, 16-byte cp.async each; rows where row_src is null are zero-filled.
template <int ROWS, class RowSrc>
__device__ __forceinline__ void gather_swizzled(__nv_bfloat16* dst, RowSrc row_src, const __nv_bfloat16* fallback) {
  constexpr int TPR = NUM_THREADS / ROWS, CHUNKS = VMLA_DIM / 8;
  static_assert(NUM_THREADS % ROWS == 0 && CHUNKS % TPR == 0, "rows split evenly over the threads");
  const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
  const __nv_bfloat16* src = row_src(r);
#pragma unroll
  for (int i = 0; i < CHUNKS / TPR; ++i) {
    const int c = j + i * TPR;
    cp_async_16(dst + swizzled<ROWS>(r, c), src != nullptr ? src + c * 8 : fallback, src != nullptr);
  }
}

__device__ __forceinline__ void load_kv_tile(Smem& sm, int stage, int slot, const __nv_bfloat16* __restrict__ kv_buffer,
                                             int k0, int k_end) {
#ifndef VMLA_SKIP_LOAD
  gather_swizzled<BN>(&sm.kv[stage][0][0][0], [&](int r) {
    return k0 + r < k_end ? kv_buffer + static_cast<int64_t>(sm.idx[slot][r]) * VMLA_DIM : nullptr;
  }, kv_buffer);
#endif
}

// A thread's 8 scores of one row (keys 8 j + 2 t + e of the tile, j < 4, e < 2; the row's 4 threads are
// adjacent lanes) scaled, capped and masked (bit c of vis: key k0 + c visible); returns their max over the row.
__device__ __forceinline__ float masked_row_max(float* x, uint32_t vis, const Args& a, int tig) {
#ifdef VMLA_SKIP_SOFTMAX  // timing experiment (with row_exp's): P = scores, no mask/max/exp/sums
  return 0.f;
#endif
  if (a.logit_cap > 0.f) {  // a uniform branch: without it every score would pay for tanhf
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = a.logit_cap * tanhf(x[i] * a.sm_scale / a.logit_cap) * LOG2E;
  } else {
    const float scale_log2 = a.sm_scale * LOG2E;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= scale_log2;
  }
  float tile_max = VMLA_NEG_INF;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = (i / 2) * 8 + tig * 2 + (i % 2);
    if (!((vis >> c) & 1u)) x[i] = VMLA_NEG_INF;
    tile_max = fmaxf(tile_max, x[i]);
  }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  return fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
}

// The online-softmax update of one row, given the max of every score the step covers of it (tile_max): x becomes
// p = 2^(x - m); returns alpha. l is this thread's share of the row's sum (the 4 shares are added at the end).
__device__ __forceinline__ float row_exp(RowState& st, float* x, float tile_max) {
#ifdef VMLA_SKIP_SOFTMAX
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] *= 1e-3f;
  st.l = 1.f;
  return 1.f;
#endif
  const bool grow = tile_max > st.m;
  const float m_new = grow ? tile_max : st.m;
  const float m_use = m_new == VMLA_NEG_INF ? 0.f : m_new;
  const float alpha = grow ? exp2f(st.m - m_use) : 1.f;
  float psum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = exp2f(x[i] - m_use);
    psum += x[i];
  }
  st.l = st.l * alpha + psum;
  st.m = m_new;
  return alpha;
}

// One row's softmax step on a thread's 8 scores of a tile: mask, max, online update (x becomes p; alpha).
__device__ __forceinline__ float softmax_row(RowState& st, float* x, uint32_t vis, const Args& a, int tig) {
  return row_exp(st, x, masked_row_max(x, vis, a, tig));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// k-steps [K0, K0 + STEPS) of S = Q K^T for this warpgroup (asynchronous: one commit group). The steps are
// template arguments so every descriptor offset is a constant added to two base descriptors (otherwise the
// compiler precomputes the 36 64-bit descriptors per thread and holds them in registers).
template <int K0, int STEPS>
__device__ __forceinline__ void issue_qk_steps(float (&s)[NT][4], uint64_t dq, uint64_t dk) {
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  wg_fence();
#ifndef VMLA_SKIP_QK
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    const int ks = K0 + i, atom = ks / 4, kbytes = (ks % 4) * 32;
    wgmma_qk(s, dq + ((atom * BM * 128 + kbytes) >> 4), dk + ((atom * BN * 128 + kbytes) >> 4), i > 0);
  }
#endif
  wg_commit();
}
// This warpgroup's half of the dims (18 k-steps) of the tile in `stage`.
__device__ __forceinline__ void issue_qk(float (&s)[NT][4], Smem& sm, int stage, int wg) {
  const uint64_t dq = desc(&sm.q[0][0][0], 16, 1024), dk = desc(&sm.kv[stage][0][0][0], 16, 1024);
  if (wg == 0) issue_qk_steps<0, KSTEPS_PER_WG>(s, dq, dk); else issue_qk_steps<KSTEPS_PER_WG, KSTEPS_PER_WG>(s, dq, dk);
}

// acc += P V for warpgroup wg's 256 output columns over the 32 keys of the tile in `stage`, P (both k16 steps)
// from registers (asynchronous: one commit group).
__device__ __forceinline__ void issue_pv(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[2][4], Smem& sm, int stage, int wg) {
  wg_fence();
#ifndef VMLA_SKIP_PV
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) wgmma_pv(acc, pa[kk], desc(&sm.kv[stage][wg * 4][kk * 16][0], BN * 128, 1024));
#endif
  wg_commit();
}

// This thread's two rows of a 64-row tile (r_lo = 16 warp + lane / 4 and r_lo + 8) and their tokens.
struct WgRows {
  int r_lo, token[2];
  bool valid[2];
  __device__ __forceinline__ WgRows(const SegmentRows& seg, int row0, int num_heads, int warp, int g) : r_lo(warp * 16 + g) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      valid[h] = r_lo + 8 * h < seg.valid_rows;
      token[h] = seg.q0 + (valid[h] ? (row0 + r_lo + 8 * h) / num_heads : 0);
    }
  }
};

// A score fragment (n8 tiles j: rows r_lo, r_lo + 8) as the two rows' 8 scores each.
__device__ __forceinline__ void score_rows(const float (&s)[NT][4], float (&x)[2][8]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    x[0][j * 2] = s[j][0]; x[0][j * 2 + 1] = s[j][1];
    x[1][j * 2] = s[j][2]; x[1][j * 2 + 1] = s[j][3];
  }
}
// The accumulator rows times their alpha (skipped where neither row moved its max).
__device__ __forceinline__ void rescale_rows(float (&acc)[PV_N / 8][4], const float (&alpha)[2]) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int i = 0; i < PV_N / 8; ++i) {
      acc[i][0] *= alpha[0]; acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1]; acc[i][3] *= alpha[1];
    }
  }
}
// The two rows' p (8 keys each) as the A fragments of P V's two k16 steps.
__device__ __forceinline__ void pack_p(const float (&x)[2][8], uint32_t (&pa)[2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    pa[kk][0] = pack_bf16(x[0][4 * kk], x[0][4 * kk + 1]);
    pa[kk][1] = pack_bf16(x[1][4 * kk], x[1][4 * kk + 1]);
    pa[kk][2] = pack_bf16(x[0][4 * kk + 2], x[0][4 * kk + 3]);
    pa[kk][3] = pack_bf16(x[1][4 * kk + 2], x[1][4 * kk + 3]);
  }
}

// Epilogue of warpgroup wg's 256 output columns for this thread's two rows (st[h].l: the row's whole sum):
// o, or the partial out_o[64][512]; the LSE from warpgroup 0.
__device__ __forceinline__ void store_rows(const float (&acc)[PV_N / 8][4], const RowState (&st)[2], const WgRows& rows,
                                           int wg, int tig, const Args& a, int64_t grow0, float* out_o, float* out_lse) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rows.r_lo + 8 * h;
    if (!rows.valid[h]) continue;
    if (wg == 0 && tig == 0) store_row_lse(a, st[h], grow0, r, out_o, out_lse);
    const float inv = st[h].l > 0.f ? 1.f / st[h].l : 0.f;
#pragma unroll
    for (int i = 0; i < PV_N / 8; ++i) {
      const int c = wg * PV_N + i * 8 + tig * 2;
      const float v0 = acc[i][2 * h] * inv, v1 = acc[i][2 * h + 1] * inv;
      if (out_o == nullptr) {
        *reinterpret_cast<__nv_bfloat162*>(&a.o[(grow0 + r) * VMLA_VDIM + c]) = __floats2bfloat162_rn(v0, v1);
      } else {
        *reinterpret_cast<float2*>(&out_o[r * VMLA_VDIM + c]) = make_float2(v0, v1);
      }
    }
  }
}
// A row's sum from its 4 threads' shares (adjacent lanes).
__device__ __forceinline__ void sum_row_shares(RowState& st) {
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
}

// A segment's first loads: its Q rows (QROWS, swizzled; rows past the request zero-filled) and the slot ids of
// its first SLOTS tiles as one cp.async group, waited for; then the rows of its first LOADS tiles, a group each.
template <int QROWS, int SLOTS, int LOADS>
__device__ __forceinline__ void start_segment(Smem& sm, const Args& a, const SegmentRows& seg, int row0, int k_begin,
                                              int k_end, int num_tiles) {
  gather_swizzled<QROWS>(&sm.q[0][0][0], [&](int r) { return row0 + r < seg.rows ? a.q + (seg.grow0 + r) * VMLA_DIM : nullptr; }, a.q);
#pragma unroll
  for (int j = 0; j < SLOTS; ++j) load_tile_slots(sm.idx[j], seg.kv_idx, k_begin + j * BN, k_end);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();  // slot ids of the first tiles in shared memory (Q may still be landing: see the loop)
  VMLA_MARK(1);
#pragma unroll
  for (int j = 0; j < LOADS; ++j) {  // one commit group per tile
    if (j < num_tiles) load_kv_tile(sm, j, j, a.kv_buffer, k_begin + j * BN, k_end);
    cp_async_commit();
  }
}

// One segment: rows [row0, row0 + 64) of request b against its keys [k_begin, k_end). Writes o/lse (out_o null)
// or the fp32 partial out_o[64][512], out_lse[64] normalised by its own sum.
template <class Merge>
__device__ __forceinline__ void verify_segment_dims_split(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                                          float* __restrict__ out_o, float* __restrict__ out_lse, Merge&& merge) {
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
    if (ahead < num_tiles) load_kv_tile(sm, ahead % VMLA_STAGES, ahead % IDX_RING, a.kv_buffer, k_begin + ahead * BN, k_end);
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
      alpha[h] = softmax_row(st[h], x[h], visible_keys<BN>(a, k_begin + t * BN, k_end, prefix, rows.valid[h], rows.token[h]), a, tig);
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
__device__ __forceinline__ void verify_segment_split_keys(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                                          float* __restrict__ out_o, float* __restrict__ out_lse, Merge&& merge) {
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
      if (t0 + j < padded_tiles) load_kv_tile(sm, (t0 + j) % VMLA_STAGES, (t0 + j) % IDX_RING, a.kv_buffer, k_begin + (t0 + j) * BN, k_end);
#pragma unroll
    for (int j = 4; j < 6; ++j) load_tile_slots(sm.idx[(t0 + j) % IDX_RING], seg.kv_idx, k_begin + (t0 + j) * BN, k_end);
    cp_async_commit();
    VMLA_PHASE(1);
    wg_wait<0>();
    fence_operands(s);
    VMLA_PHASE(2);
    score_rows(s, x);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = masked_row_max(x[h], visible_keys<BN>(a, k_begin + mine * BN, k_end, seg.prefix, rows.valid[h], rows.token[h]), a, tig);
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
__device__ __forceinline__ void arrive(int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(NUM_THREADS) : "memory"); }
__device__ __forceinline__ void sync(int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(NUM_THREADS) : "memory"); }

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
__device__ __forceinline__ void issue_pv_regs(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[4][4], Smem& sm, int g, int wg) {
  const uint64_t dv = opaque(desc(atom(sm, g, wg * 4), BLK * 128, 1024));
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv(acc, pa[kk], dv + ((kk * 16 * 128) >> 4));
  wg_commit();
}
__device__ __forceinline__ void issue_pv_smem(float (&acc)[PV_N / 8][4], const __nv_bfloat16* p_smem, Smem& sm, int g, int wg) {
  const uint64_t dp = opaque(desc(p_smem, 16, 1024)), dv = opaque(desc(atom(sm, g, wg * 4), BLK * 128, 1024));
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv_ss(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
  wg_commit();
}

// Atoms [A0, A1) of the block of keys [k0, k0 + 64) into buffer g by this warpgroup's 128 threads: 8 threads a
// row (one 16-byte chunk of each atom), 16 rows a pass; rows past k_end zero-filled. ids: the rows' slot ids.
template <int A0, int A1>
__device__ __forceinline__ void gather(Smem& sm, int g, const __nv_bfloat16* __restrict__ kv_buffer, const int (&ids)[4],
                                       int k0, int k_end) {
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
  __device__ __forceinline__ uint32_t at(int kk, int e) const { return (lo + (e % 2) * 8 * 128) ^ ((2 * kk + e / 2) * 16); }
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
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(w.at(kk, e)), "r"(pack_bf16(p.x * f[h], p.y * f[h])) : "memory");
        }
    }
}
}  // namespace blocks64

template <class Merge>
__device__ __forceinline__ void verify_segment_blocks64(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                                        float* __restrict__ out_o, float* __restrict__ out_lse, Merge&& merge) {
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
  gather_swizzled<BM>(&sm.q[0][0][0], [&](int r) { return row0 + r < seg.rows ? a.q + (seg.grow0 + r) * VMLA_DIM : nullptr; }, a.q);
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const int k0 = k_begin + g * BLK;
    gather_swizzled<BLK>(buffer(sm, g), [&](int r) {
      return k0 + r < k_end ? a.kv_buffer + static_cast<int64_t>(__ldg(seg.kv_idx + k0 + r)) * VMLA_DIM : nullptr;
    }, a.kv_buffer);
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
    const int blk = 2 * it + wg;  // this warpgroup's block
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
constexpr int FEW_BM = 16;                       // rows scored (one m16 block)
constexpr int FEW_QROWS = 32;                    // Q rows gathered (gather_swizzled splits 32 rows evenly)
constexpr int FEW_STAGES = VMLA_STAGES - VMLA_SPLIT_KEYS;  // (split_keys: the last stage holds the scores)
constexpr int FEW_LOAD_AHEAD = FEW_STAGES - 1, FEW_SLOT_AHEAD = 2 * FEW_LOAD_AHEAD;
constexpr int FEW_DSPLIT = 4, FEW_KSTEPS = KSTEPS / FEW_DSPLIT;  // QK: dim quarters, k16 steps in each
constexpr int FEW_COLS = 4, FEW_TPR = BN / FEW_COLS;  // softmax: keys a thread, threads a row
static_assert(VMLA_FEW_ROWS <= FEW_BM, "a few-row tile is one m16 block");
static_assert(FEW_SLOT_AHEAD + 1 <= IDX_RING, "the slot-id ring holds the ids requested and not yet used");
static_assert(FEW_BM * P_STRIDE <= 2 * BM * BN, "P fits the P buffers");
static_assert(FEW_DSPLIT * 2 == VMLA_WARPS && FEW_BM * FEW_TPR <= NUM_THREADS, "warps = dim quarters x key halves");
static_assert((FEW_DSPLIT + 1) * FEW_BM * SX_STRIDE <= (VMLA_SPLIT_KEYS ? ATOMS * BN * 32 : 2 * BM * SX_STRIDE),
              "the partial scores and row statistics fit their buffer");

template <class Merge>
__device__ __forceinline__ void verify_segment_few(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                                   float* __restrict__ out_o, float* __restrict__ out_lse, Merge&& merge) {
  const SegmentRows seg(a, b, row0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  const int kh = warp % 2, dq = warp / 2;  // QK: this warp's key half (2 n8 tiles) and dim quarter
  const int num_tiles = (k_end - k_begin + BN - 1) / BN;
  // [FEW_DSPLIT][FEW_BM rows][SX_STRIDE] partial scores
  float* part = VMLA_SPLIT_KEYS ? reinterpret_cast<float*>(&sm.kv[FEW_STAGES][0][0][0]) : &sm.s[0][0][0];
  float* row_alpha = part + FEW_DSPLIT * FEW_BM * SX_STRIDE;  // [FEW_BM], then the rows' sums [FEW_BM]
  __nv_bfloat16* p = &sm.p[0][0][0]; // [FEW_BM][P_STRIDE]
  // softmax threads (tid < 128): row srow, keys [scol, scol + 4)
  const int srow = tid / FEW_TPR, scol = (tid % FEW_TPR) * FEW_COLS;
  const bool soft = tid < FEW_BM * FEW_TPR, srow_valid = soft && srow < seg.valid_rows;
  const int stoken = seg.q0 + (srow_valid ? (row0 + srow) / a.num_heads : 0);

  start_segment<FEW_QROWS, FEW_SLOT_AHEAD, FEW_LOAD_AHEAD>(sm, a, seg, row0, k_begin, k_end, num_tiles);
  uint32_t qf[FEW_KSTEPS][4];  // this warp's Q fragments (rows 0-15, its dim quarter)
#pragma unroll
  for (int i = 0; i < FEW_KSTEPS; ++i)
    ldmatrix_x4(qf[i], &sm.q[0][0][0] + swizzled<FEW_QROWS>(lane % 8 + ((lane / 8) % 2) * 8, 2 * (dq * FEW_KSTEPS + i) + lane / 16));

  RowState st;
  float acc[1][8][4];  // one m16 block x this warp's 8 n8 tiles of output columns
  zero_frags(acc);
  const int k_key = kh * 16 + (lane / 16) * 8 + lane % 8, k_chunk = 2 * dq * FEW_KSTEPS + (lane / 8) % 2;  // K: 2 n8 tiles a load
  const int v_key = ((lane / 8) % 2) * 8 + lane % 8, v_chunk = warp * 8 + lane / 16;

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % FEW_STAGES;
    cp_async_wait<FEW_LOAD_AHEAD - 1>();  // tile t landed (the next may still be in flight)
    __syncthreads();  // ... for every thread; all warps past tile t-1 (its stage, P and the scores are free)
    if (t == 0) VMLA_MARK(2);
    {
      const int ahead = t + FEW_LOAD_AHEAD;
      if (ahead < num_tiles) load_kv_tile(sm, ahead % FEW_STAGES, ahead % IDX_RING, a.kv_buffer, k_begin + ahead * BN, k_end);
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
