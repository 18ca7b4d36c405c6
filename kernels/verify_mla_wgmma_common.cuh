// The Hopper path of verify_mla.cu (VMLA_WGMMA, sm_90a only): one segment of the stream-K walk with warpgroup
// MMAs reading Q, K and V straight from shared memory, no ldmatrix. sm_120 has no wgmma; it runs the mma.sync
// path. Same arithmetic contract as that path (fp32 scores and accumulators, bf16 P, online softmax in the log2
// domain with an exact running max), so the two agree to bf16 rounding, not bit for bit.
//
// This header holds what the Hopper bodies share: the tile constants, the shared-memory layout, the swizzled
// gathers, the P V wgmmas, the softmax pieces, the epilogue and a segment's first loads. Each body has its own
// header: verify_mla_body_split_keys.cuh, verify_mla_body_dims_split.cuh, verify_mla_body_blocks64.cuh and the
// few-row segment's verify_mla_body_few_rows.cuh.
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
constexpr int ATOMS = VMLA_DIM / 64;       // 9 atoms of 64 dims
constexpr int KSTEPS_PER_WG = KSTEPS / 2;  // 18 k16 steps of QK per warpgroup
constexpr int NT = BN / 8;                 // n8 tiles of keys in a score tile
constexpr int PV_N = VMLA_VDIM / 2;        // output columns per warpgroup
constexpr int SX_STRIDE = BN + 8;          // fp32 per row of a partial-score buffer (2-way bank conflicts)
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
static_assert(BN == 32 && NT == 4,
              "the score fragments (wgmma_qk), the mask word and the PV k-steps assume 32-key tiles");
static_assert(VMLA_BM == 64 && VMLA_WARPS == 8, "the wgmma path is 64 rows, two warpgroups");

struct Smem {
  __nv_bfloat16 q[ATOMS][BM][64];  // 1024-byte aligned atoms (the block's base is)
  __nv_bfloat16 kv[VMLA_STAGES][ATOMS][BN][64];
  __nv_bfloat16 p[2][BM][BN];  // the few-row segment's P; the split_keys loop's P fragments
#if VMLA_SPLIT_KEYS
  float s[2][BM][2];  // each warpgroup's row maxima and sums (then the fused merge's weights)
#else
  float s[2][BM][SX_STRIDE];  // each warpgroup's partial scores (then the fused merge's weights)
#endif
  int idx[IDX_RING][BN];
  int flag[4];
};
static_assert(sizeof(Smem::q) % 1024 == 0 && sizeof(Smem::kv[0]) % 1024 == 0, "atoms stay 1024-byte aligned");
static_assert(VMLA_FUSED_MERGE_SEGS * BM * sizeof(float) <= sizeof(Smem::s),
              "the fused merge's weights fit the score buffer");

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
#define VMLA_D128                                                                                                \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"  \
  "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55," \
  "%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82," \
  "%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107," \
  "%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define VMLA_ACC8(i)                                                                                            \
  "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3]), "+f"(acc[i + 1][0]), "+f"(acc[i + 1][1]), \
      "+f"(acc[i + 1][2]), "+f"(acc[i + 1][3])
#define VMLA_ACC128                                                                                                  \
  VMLA_ACC8(0), VMLA_ACC8(2), VMLA_ACC8(4), VMLA_ACC8(6), VMLA_ACC8(8), VMLA_ACC8(10), VMLA_ACC8(12), VMLA_ACC8(14), \
      VMLA_ACC8(16), VMLA_ACC8(18), VMLA_ACC8(20), VMLA_ACC8(22), VMLA_ACC8(24), VMLA_ACC8(26), VMLA_ACC8(28),       \
      VMLA_ACC8(30)
#define VMLA_PV_OP \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " VMLA_D128
__device__ __forceinline__ void wgmma_pv(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[4], uint64_t db) {
  asm volatile(VMLA_PV_OP ", {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
               : VMLA_ACC128
               : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "l"(db));
}
// acc += P V over one k16 step, P = 64 x 16 from shared memory (desc, K-major), V = 16 keys x 256 (desc, N-major).
__device__ __forceinline__ void wgmma_pv_ss(float (&acc)[PV_N / 8][4], uint64_t da, uint64_t db) {
  asm volatile(VMLA_PV_OP ", %128, %129, p, 1, 1, 0, 1;\n}\n" : VMLA_ACC128 : "l"(da), "l"(db));
}
#undef VMLA_PV_OP
#undef VMLA_ACC128
#undef VMLA_ACC8
#undef VMLA_D128

// Element offset of 16-byte chunk c (of 72) of row r in swizzled atoms of ROWS rows: atom c / 8 at ROWS * 64
// elements a step, chunk c % 8 of the row at (c % 8) ^ (r % 8).
template <int ROWS>
__device__ __forceinline__ int swizzled(int r, int c) {
  return ((c / 8) * ROWS + r) * 64 + (((c % 8) ^ (r % 8)) * 8);
}

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
  gather_swizzled<BN>(
      &sm.kv[stage][0][0][0],
      [&](int r) { return k0 + r < k_end ? kv_buffer + static_cast<int64_t>(sm.idx[slot][r]) * VMLA_DIM : nullptr; },
      kv_buffer);
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
  if (wg == 0)
    issue_qk_steps<0, KSTEPS_PER_WG>(s, dq, dk);
  else
    issue_qk_steps<KSTEPS_PER_WG, KSTEPS_PER_WG>(s, dq, dk);
}

// acc += P V for warpgroup wg's 256 output columns over the 32 keys of the tile in `stage`, P (both k16 steps)
// from registers (asynchronous: one commit group).
__device__ __forceinline__ void issue_pv(float (&acc)[PV_N / 8][4], const uint32_t (&pa)[2][4], Smem& sm, int stage,
                                         int wg) {
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
  __device__ __forceinline__ WgRows(const SegmentRows& seg, int row0, int num_heads, int warp, int g)
      : r_lo(warp * 16 + g) {
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
    x[0][j * 2] = s[j][0];
    x[0][j * 2 + 1] = s[j][1];
    x[1][j * 2] = s[j][2];
    x[1][j * 2 + 1] = s[j][3];
  }
}
// The accumulator rows times their alpha (skipped where neither row moved its max).
__device__ __forceinline__ void rescale_rows(float (&acc)[PV_N / 8][4], const float (&alpha)[2]) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int i = 0; i < PV_N / 8; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
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
                                           int wg, int tig, const Args& a, int64_t grow0, float* out_o,
                                           float* out_lse) {
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
  gather_swizzled<QROWS>(
      &sm.q[0][0][0], [&](int r) { return row0 + r < seg.rows ? a.q + (seg.grow0 + r) * VMLA_DIM : nullptr; }, a.q);
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

}  // namespace vmla_wg
