// The verify kernel's building blocks, apart from its tile loop (verify_mla.cu) and the PTX wrappers
// (verify_mla_ptx.cuh): the argument block, the online-softmax step of one thread's keys, P.V, the epilogue
// that writes o/lse or a partial, and the LSE merge of split row tiles.
#pragma once
#include <cuda_bf16.h>

#include "verify_mla_config.cuh"
#include "verify_mla_params.cuh"
#include "verify_mla_hooks.cuh"
#include "verify_mla_ptx.cuh"

namespace vmla {

constexpr int ROW_STRIDE = VMLA_DIM + 8;        // bf16 elems per staged row; +16 B keeps ldmatrix conflict-free
constexpr int S_STRIDE = VMLA_BN + VMLA_S_PAD;  // fp32 elems per partial-score row
constexpr int P_STRIDE = VMLA_BN + 8;           // bf16 elems per P row
static_assert(VMLA_S_PAD > 0 || VMLA_BN == 16, "unpadded partial-score rows (VMLA_S_PAD 0) are swizzled for BN 16");

// Column col of partial-score row `row` in shared memory: unpadded rows of 16 floats (VMLA_S_PAD 0) swap their
// halves on rows 2-3 mod 4, which keeps the fragment stores (4 rows a phase) and the softmax's float4 reads
// (2 rows) conflict-free; padded rows are as they are.
__device__ __forceinline__ int s_col(int row, int col) { return VMLA_S_PAD == 0 ? col ^ (((row >> 1) & 1) << 3) : col; }
constexpr int KSTEPS = VMLA_DIM / 16;  // k16 steps of QK over the 576 dims
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define VMLA_NEG_INF (-__int_as_float(0x7f800000))

// Fetch the slot ids of keys [k0, k0 + VMLA_BN) into dst (0 past k_end): one warp's worth of threads, cp.async.
__device__ __forceinline__ void load_tile_slots(int* dst, const int* __restrict__ kv_idx, int k0, int k_end) {
  if (threadIdx.x < VMLA_BN) {
    const int key = k0 + threadIdx.x;
    cp_async_4(&dst[threadIdx.x], key < k_end ? kv_idx + key : kv_idx, key < k_end);
  }
}

template <int A, int B>
__device__ __forceinline__ void zero_frags(float (&x)[A][B][4]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[i][j][e] = 0.f;
}

// A m16 x k16 fragment (rows r0.., cols c0..) of a row-major bf16 tile in shared memory.
template <int STRIDE>
__device__ __forceinline__ void load_a_frag(uint32_t (&r)[4], const __nv_bfloat16* base, int r0, int c0, int lane) {
  ldmatrix_x4(r, base + (r0 + ((lane / 8) % 2) * 8 + lane % 8) * STRIDE + c0 + (lane / 16) * 8);
}

struct Args {
  const __nv_bfloat16* __restrict__ q;          // [T * H, 576]
  const __nv_bfloat16* __restrict__ kv_buffer;  // [pool rows, 576]
  const int* __restrict__ qo_indptr;            // [bs + 1]
  const int* __restrict__ kv_indptr;            // [bs + 1]  combined: prefix_len + N
  const int* __restrict__ kv_indices;           // combined slot lists
  const int* __restrict__ prefix_lens;          // [bs]
  const int* __restrict__ tree_mask;            // [T, mask_words]
  int mask_words, num_heads;
  float sm_scale, logit_cap;
  __nv_bfloat16* __restrict__ o;  // [T * H, 512]
  float* __restrict__ lse;        // [T * H] or null
};

// Bit c is set where key key0 + c (c < COLS) is visible to the row: below k_end, and a prefix key, or a draft
// key whose bit is set in the row's tree mask (rows past the request's last see every key below k_end). The
// COLS keys touch at most two mask words, each read once; a thread of prefix keys reads none.
template <int COLS>
__device__ __forceinline__ uint32_t visible_keys(const Args& a, int key0, int k_end, int prefix, bool row_valid,
                                                 int token) {
  static_assert(COLS <= 32, "a thread's keys fit one word of bits");
  constexpr uint32_t ALL = COLS == 32 ? 0xffffffffu : (1u << (COLS % 32)) - 1u;
  const int live = k_end - key0;  // keys below k_end
  uint32_t bits = live >= COLS ? ALL : live <= 0 ? 0u : (1u << live) - 1u;
  const int j0 = key0 - prefix;  // draft index of the first key (< 0: it is a prefix key)
  const int ja = max(j0, 0), jb = min(j0 + COLS, k_end - prefix) - 1;  // the live draft keys among them
  if (row_valid && jb >= ja) {
    const int* row = a.tree_mask + static_cast<int64_t>(token) * a.mask_words;
    const uint32_t w0 = row[ja >> 5], w1 = (jb >> 5) != (ja >> 5) ? row[jb >> 5] : 0u;
    uint32_t seen = j0 < 0 ? (1u << -j0) - 1u : 0u;  // the prefix keys (j0 > -COLS here)
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int j = j0 + c;
      if (j >= ja && j <= jb) seen |= ((((j >> 5) == (ja >> 5) ? w0 : w1) >> (j & 31)) & 1u) << c;
    }
    bits &= seen;
  }
  return bits;
}

// What a segment (rows [row0, row0 + BM) of request b) needs of its request.
struct SegmentRows {
  int q0;             // the request's first token
  int rows;           // its rows (tokens x heads)
  int prefix;         // its prefix length (keys below it are always visible)
  const int* kv_idx;  // its combined slot list (prefix kv_indices ++ out_cache_loc)
  int64_t grow0;      // global row (token * H + head) of the segment's first row
  int valid_rows;     // rows of the segment below this are real (< BM in a request's last row tile)
  __device__ __forceinline__ SegmentRows(const Args& a, int b, int row0)
      : q0(a.qo_indptr[b]),
        rows((a.qo_indptr[b + 1] - q0) * a.num_heads),
        prefix(a.prefix_lens[b]),
        kv_idx(a.kv_indices + a.kv_indptr[b]),
        grow0(static_cast<int64_t>(q0) * a.num_heads + row0),
        valid_rows(rows - row0) {}
};

// One row's state in the online softmax (m in the log2 domain).
struct RowState {
  float m = VMLA_NEG_INF, l = 0.f;
};

// The softmax step for one thread's COLS consecutive keys [key0, key0 + COLS) of one row (TPR threads
// share the row, adjacent lanes): scale, cap, mask (prefix keys always visible, draft key j visible when
// bit j of the row's tree_mask is set), online max/sum. Writes P (bf16) to p and returns alpha, the factor
// the row's accumulator must be multiplied by.
template <int COLS, int TPR>
__device__ __forceinline__ float softmax_step(RowState& st, float (&x)[COLS], __nv_bfloat16* p, const Args& a, int key0,
                                              int k_end, int prefix, bool row_valid, int token) {
  const float scale_log2 = a.sm_scale * LOG2E;
#ifdef VMLA_SKIP_SOFTMAX  // timing experiment: P = scores, no mask/max/exp/sums
  __nv_bfloat16 pq[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) pq[c] = __float2bfloat16_rn(x[c] * 1e-3f);
#pragma unroll
  for (int c4 = 0; c4 < COLS; c4 += 4) *reinterpret_cast<uint2*>(p + c4) = *reinterpret_cast<const uint2*>(&pq[c4]);
  st.l = 1.f;
  return 1.f;
#else
  if (a.logit_cap > 0.f) {  // a uniform branch: without it every score would pay for tanhf
#pragma unroll
    for (int c = 0; c < COLS; ++c) x[c] = a.logit_cap * tanhf(x[c] * a.sm_scale / a.logit_cap) * LOG2E;
  } else {
#pragma unroll
    for (int c = 0; c < COLS; ++c) x[c] *= scale_log2;
  }
  float tile_max = VMLA_NEG_INF;
#if VMLA_FAST_MASK
  const uint32_t vis = visible_keys<COLS>(a, key0, k_end, prefix, row_valid, token);
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    if (!((vis >> c) & 1u)) x[c] = VMLA_NEG_INF;
    tile_max = fmaxf(tile_max, x[c]);
  }
#else
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int key = key0 + c;
    const float v = x[c];
    bool visible = key < k_end;
    if (visible && key >= prefix && row_valid) {
      const int j = key - prefix;
      visible = (a.tree_mask[static_cast<int64_t>(token) * a.mask_words + (j >> 5)] >> (j & 31)) & 1;
    }
    x[c] = visible ? v : VMLA_NEG_INF;
    tile_max = fmaxf(tile_max, x[c]);
  }
#endif
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
  // The reference max moves only when the tile's max exceeds it: the dominant key's p is exactly 1 (as in
  // SGLang's kernel), and alpha is exactly 1 on every tile that does not raise it (a tile where no row of the
  // block moved skips the accumulator rescale).
  const bool grow = tile_max > st.m;  // st.m = -inf: any visible key grows it
  const float m_new = grow ? tile_max : st.m;
  const float m_use = m_new == VMLA_NEG_INF ? 0.f : m_new;
  const float alpha = grow ? exp2f(st.m - m_use) : 1.f;
  float psum = 0.f;
  __nv_bfloat16 pb[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const float pv = exp2f(x[c] - m_use);
    psum += pv;
    pb[c] = __float2bfloat16_rn(pv);
  }
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
  st.l = st.l * alpha + psum;
  st.m = m_new;
#pragma unroll
  for (int c4 = 0; c4 < COLS; c4 += 4) *reinterpret_cast<uint2*>(p + c4) = *reinterpret_cast<const uint2*>(&pb[c4]);
  return alpha;
#endif
}

// Sum the DSLICES partial-score rows (float4s) of one thread's COLS keys.
template <int COLS, int DSLICES>
__device__ __forceinline__ void sum_partials(float (&x)[COLS], const float* s0, int slice_stride) {
#pragma unroll
  for (int c4 = 0; c4 < COLS; c4 += 4) {
    float4 v = *reinterpret_cast<const float4*>(s0 + c4);
#pragma unroll
    for (int d = 1; d < DSLICES; ++d) {
      const float4 w = *reinterpret_cast<const float4*>(s0 + d * slice_stride + c4);
      v.x += w.x;
      v.y += w.y;
      v.z += w.z;
      v.w += w.w;
    }
    x[c4] = v.x;
    x[c4 + 1] = v.y;
    x[c4 + 2] = v.z;
    x[c4 + 3] = v.w;
  }
}

// A row's LSE (natural log) from its online-softmax state; -inf where it saw no visible key.
__device__ __forceinline__ float row_lse(const RowState& st) {
  return st.l > 0.f ? (st.m + log2f(st.l)) * LN2 : VMLA_NEG_INF;
}

// Row r's LSE: into lse (row grow0 + r; when asked for) for a tile one block wrote whole (out_o null), else
// into its partial's out_lse[r].
__device__ __forceinline__ void store_row_lse(const Args& a, const RowState& st, int64_t grow0, int r,
                                              const float* out_o, float* out_lse) {
  if (out_o == nullptr) {
    if (a.lse != nullptr) a.lse[grow0 + r] = row_lse(st);
  } else {
    out_lse[r] = row_lse(st);
  }
}

// Epilogue of one warp's accumulator (m16 tiles x n8 tiles of output columns from col0): rows r of the tile
// (global row grow0 + r, valid while r < valid_rows) divided by their l (l_final[r]), as bf16 into o or, for a
// split tile, as fp32 into the partial out_o[BM][512].
template <int MTILES, int NTILES>
__device__ __forceinline__ void store_acc(const float (&acc)[MTILES][NTILES][4], int col0, int valid_rows,
                                          const float* l_final, const Args& a, int64_t grow0, float* out_o, int lane) {
  const int g = lane / 4, tig = lane % 4;
#pragma unroll
  for (int mi = 0; mi < MTILES; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mi * 16 + g + half * 8;
      if (r >= valid_rows) continue;
      const float l = l_final[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int ni = 0; ni < NTILES; ++ni) {
        const int c = col0 + ni * 8 + tig * 2;
        const float v0 = acc[mi][ni][half * 2] * inv, v1 = acc[mi][ni][half * 2 + 1] * inv;
        if (out_o == nullptr) {
          *reinterpret_cast<__nv_bfloat162*>(&a.o[(grow0 + r) * VMLA_VDIM + c]) = __floats2bfloat162_rn(v0, v1);
        } else {
          *reinterpret_cast<float2*>(&out_o[r * VMLA_VDIM + c]) = make_float2(v0, v1);
        }
      }
    }
}

// Scale a warp's accumulator rows by their alpha (alpha[r] for tile row mi * 16 + g (+ 8)).
template <int MTILES, int NTILES>
__device__ __forceinline__ void rescale_acc(float (&acc)[MTILES][NTILES][4], const float* alpha, int lane) {
  const int g = lane / 4;
#pragma unroll
  for (int mi = 0; mi < MTILES; ++mi) {
    const float a_lo = alpha[mi * 16 + g], a_hi = alpha[mi * 16 + g + 8];
#pragma unroll
    for (int ni = 0; ni < NTILES; ++ni) {
      acc[mi][ni][0] *= a_lo;
      acc[mi][ni][1] *= a_lo;
      acc[mi][ni][2] *= a_hi;
      acc[mi][ni][3] *= a_hi;
    }
  }
}

// O += P V for one warp: the m16 tiles of P ([rows][P_STRIDE]; tiles at or past valid_rows skipped) times the
// stage's V columns [col0, col0 + 8 * NTILES) over the tile's BN keys.
template <int MTILES, int NTILES>
__device__ __forceinline__ void pv_step(float (&acc)[MTILES][NTILES][4], const __nv_bfloat16* p, const __nv_bfloat16* v,
                                        int col0, int valid_rows, int lane) {
  constexpr int GROUP = NTILES < VMLA_PV_GROUP ? NTILES : VMLA_PV_GROUP;  // n8 tiles per P fragment load
#pragma unroll
  for (int ng = 0; ng < NTILES; ng += GROUP)
#pragma unroll
    for (int kk = 0; kk < VMLA_BN / 16; ++kk) {
      uint32_t pa[MTILES][4];
#pragma unroll
      for (int mi = 0; mi < MTILES; ++mi)
        if (mi * 16 < valid_rows) load_a_frag<P_STRIDE>(pa[mi], p, mi * 16, kk * 16, lane);
#pragma unroll
      for (int np = ng; np < ng + GROUP; np += 2) {
        uint32_t vb[4];
        const int key = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
        ldmatrix_x4_trans(vb, v + key * ROW_STRIDE + col0 + np * 8 + (lane / 16) * 8);
#ifndef VMLA_SKIP_PV
#pragma unroll
        for (int mi = 0; mi < MTILES; ++mi) {
          if (mi * 16 >= valid_rows) continue;  // padding rows: no work
          mma_bf16(acc[mi][np], pa[mi], vb[0], vb[1]);
          mma_bf16(acc[mi][np + 1], pa[mi], vb[2], vb[3]);
        }
#else
        acc[0][np][0] += __uint_as_float(vb[0] ^ vb[3] ^ pa[0][0]);
#endif
      }
    }
}

// Write one warp's fp32 QK partial (m16 tiles from row r0, n8 tiles of keys from col0) to s[rows][S_STRIDE];
// m16 tiles holding no row below valid_rows are skipped.
template <int MTILES, int NTILES>
__device__ __forceinline__ void store_scores(float* s, const float (&x)[MTILES][NTILES][4], int r0, int col0,
                                             int valid_rows, int lane) {
  const int g = lane / 4, tig = lane % 4;
#pragma unroll
  for (int mi = 0; mi < MTILES; ++mi)
#pragma unroll
    for (int ni = 0; ni < NTILES; ++ni) {
      if (r0 + mi * 16 >= valid_rows) continue;  // padding m16 tile: nobody reads it
      const int r = r0 + mi * 16 + g;
      float* row = s + r * S_STRIDE + s_col(r, col0 + ni * 8 + tig * 2);  // (rows r and r + 8 swizzle alike)
      *reinterpret_cast<float2*>(row) = make_float2(x[mi][ni][0], x[mi][ni][1]);
      *reinterpret_cast<float2*>(row + 8 * S_STRIDE) = make_float2(x[mi][ni][2], x[mi][ni][3]);
    }
}

// The LSE merge of one row's partials (segs slots, slot s's LSE at lse[s * lse_stride]): the arithmetic shared by
// verify_mla_merge and the fused merge in verify_mla.cu, so both give the same bits (o = sum_s weight_s * o_s,
// in slot order). Reads bypass L1 (__ldcg): other blocks wrote the partials during this launch.
struct MergeWeights {
  float m_use, inv, wsum;
};
// N > 0: at most N partials (a constant trip count: the loops unroll, lse_at may index registers); N = 0: any number.
template <int N = 0, class LseAt>
__device__ __forceinline__ MergeWeights merge_weights_of(int segs, LseAt lse_at) {
  float mx = VMLA_NEG_INF;
  for (int s = 0; s < (N > 0 ? N : segs); ++s)
    if (s < segs) mx = fmaxf(mx, lse_at(s));
  const float m_use = mx == VMLA_NEG_INF ? 0.f : mx;
  float wsum = 0.f;
  for (int s = 0; s < (N > 0 ? N : segs); ++s)
    if (s < segs) wsum += __expf(lse_at(s) - m_use);
  return {m_use, wsum > 0.f ? 1.f / wsum : 0.f, wsum};
}
__device__ __forceinline__ MergeWeights merge_weights(const float* lse, int lse_stride, int segs) {
  return merge_weights_of(segs, [&](int s) { return __ldcg(lse + static_cast<int64_t>(s) * lse_stride); });
}
// The same from LSEs already in registers (l[s] for s < segs <= N).
template <int N>
__device__ __forceinline__ MergeWeights merge_weights(const float (&l)[N], int segs) {
  return merge_weights_of<N>(segs, [&](int s) { return l[s]; });
}
__device__ __forceinline__ float merged_lse(const MergeWeights& w) {
  return w.wsum > 0.f ? w.m_use + logf(w.wsum) : VMLA_NEG_INF;
}
// The weight of the partial whose LSE is lse_s.
__device__ __forceinline__ float merge_weight(float lse_s, const MergeWeights& w) {
  return __expf(lse_s - w.m_use) * w.inv;
}
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, const float4& v) {
  reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(v.x, v.y);
  reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(v.z, v.w);
}
__device__ __forceinline__ void add_weighted(float4& acc, float w, const float4& v) {
  acc.x += w * v.x;
  acc.y += w * v.y;
  acc.z += w * v.z;
  acc.w += w * v.w;
}

}  // namespace vmla

// Combine the partials of every row whose tile was split across blocks, through their LSEs (rows of
// tiles written whole by one block are left alone). One block of 64 or 128 threads per row
// (kdtree.kernel.MERGE_THREADS); row_merge[row] = (the row's line in the partial slots: first slot * BM + row in tile,
// number of partials), from the plan, so that a block reads it and then only the partials (no search for the row's
// request and tile). Launched as a programmatic dependent of verify_mla_fwd where the host can
// (kdtree.kernel.launch_dependent): its blocks may start while the forward kernel runs; griddepcontrol.wait holds them
// until its partials are complete and visible (a no-op after a plain launch).
constexpr int MERGE_REG_SEGS = 8;  // rows with at most this many partials keep them all in registers ...
#ifndef VMLA_MERGE_VECS
#define VMLA_MERGE_VECS 2
#endif
constexpr int MERGE_VECS = VMLA_MERGE_VECS;  // ... up to this many float4 of the row a thread (2: blocks of >= 64)
#ifndef VMLA_MERGE_STAGED
#define VMLA_MERGE_STAGED \
  1  // rows of more partials: their LSEs staged in shared memory, then MERGE_REG_SEGS partials
     // loaded at a time (0: each LSE and partial loaded as it is added, one load in flight)
#endif
constexpr int MERGE_STAGED_SEGS = 1024;  // (a row has at most one partial a block of the grid; more: the loop below)
constexpr int64_t MERGE_O_STRIDE =
    static_cast<int64_t>(VMLA_BM) * VMLA_VDIM;  // floats from one partial slot to the next
// Row `row` of o (and lse) from its segs partials: sum_s weight_s * partial_s in slot order, BATCH partials loaded at
// a time, partial s's LSE from lse_at(s).
template <int BATCH, class LseAt>
__device__ __forceinline__ void merge_row(int row, int segs, const float* row_o, LseAt lse_at,
                                          const vmla::MergeWeights& mw, __nv_bfloat16* __restrict__ o,
                                          float* __restrict__ lse) {
  for (int c = threadIdx.x * 4; c < VMLA_VDIM; c += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < segs; s0 += BATCH) {
      float4 v[BATCH];
#pragma unroll
      for (int k = 0; k < BATCH; ++k)
        if (s0 + k < segs) v[k] = __ldcg(reinterpret_cast<const float4*>(row_o + (s0 + k) * MERGE_O_STRIDE + c));
#pragma unroll
      for (int k = 0; k < BATCH; ++k)
        if (s0 + k < segs) vmla::add_weighted(acc, vmla::merge_weight(lse_at(s0 + k), mw), v[k]);
    }
    vmla::store_bf16x4(&o[static_cast<int64_t>(row) * VMLA_VDIM + c], acc);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[row] = vmla::merged_lse(mw);
}
extern "C" __global__ void __launch_bounds__(128)
    verify_mla_merge(VMLA_KERNEL_PARAMS(VMLA_MERGE_PARAMS)) {  // vmla::MergeParams' members (verify_mla_params.cuh)
  const int row = blockIdx.x;
  const int2 m = row_merge[row];
  const int segs = m.y;
  if (segs <= 1) return;
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const float* row_lse = part_lse + m.x;
  const float* row_o = part_o + static_cast<int64_t>(m.x) * VMLA_VDIM;
  if (segs <= MERGE_REG_SEGS && blockDim.x * 4 * MERGE_VECS >= VMLA_VDIM) {  // every load issued before the first use
    float l[MERGE_REG_SEGS];
    float4 v[MERGE_REG_SEGS][MERGE_VECS];
#pragma unroll
    for (int s = 0; s < MERGE_REG_SEGS; ++s) {
      if (s < segs) {
        l[s] = __ldcg(row_lse + s * VMLA_BM);
#pragma unroll
        for (int j = 0; j < MERGE_VECS; ++j) {
          const int c = (threadIdx.x + j * blockDim.x) * 4;
          if (c < VMLA_VDIM) v[s][j] = __ldcg(reinterpret_cast<const float4*>(row_o + s * MERGE_O_STRIDE + c));
        }
      }
    }
    const vmla::MergeWeights mw = vmla::merge_weights(l, segs);
#pragma unroll
    for (int j = 0; j < MERGE_VECS; ++j) {
      const int c = (threadIdx.x + j * blockDim.x) * 4;
      if (c >= VMLA_VDIM) continue;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < MERGE_REG_SEGS; ++s)
        if (s < segs) vmla::add_weighted(acc, vmla::merge_weight(l[s], mw), v[s][j]);
      vmla::store_bf16x4(&o[static_cast<int64_t>(row) * VMLA_VDIM + c], acc);
    }
    if (threadIdx.x == 0 && lse != nullptr) lse[row] = vmla::merged_lse(mw);
    return;
  }
  if (VMLA_MERGE_STAGED && segs <= MERGE_STAGED_SEGS) {  // the LSEs staged once, MERGE_REG_SEGS partials in flight
    __shared__ float l[MERGE_STAGED_SEGS];
    for (int s = threadIdx.x; s < segs; s += blockDim.x) l[s] = __ldcg(row_lse + static_cast<int64_t>(s) * VMLA_BM);
    __syncthreads();
    const auto staged = [&](int s) { return l[s]; };
    merge_row<MERGE_REG_SEGS>(row, segs, row_o, staged, vmla::merge_weights_of(segs, staged), o, lse);
    return;
  }
  const auto loaded = [&](int s) { return __ldcg(row_lse + static_cast<int64_t>(s) * VMLA_BM); };
  merge_row<1>(row, segs, row_o, loaded, vmla::merge_weights(row_lse, VMLA_BM, segs), o, lse);
}
