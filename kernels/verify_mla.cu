// Target-verify attention for absorbed MLA (SGLang TARGET_VERIFY, tree drafts), bf16 in/out, fp32 accumulate.
//
// For request b, draft node i, head h:  o[i,h] = sum_t softmax_t(scale * q[i,h].K[t]) V[t]
// over every prefix key and the draft keys node i may see (bit j of tree_mask[token, j/32]).
// K[t] is the 576-wide pool row at combined_kv_indices[kv_indptr[b] + t] (prefix slots ++ out_cache_loc),
// V[t] its first 512 columns. See docs/kernel-notes.md for the design and its numbers.
//
// Work decomposition: all heads of all nodes of a request share one KV stream, so rows (node, head) are
// packed into M (row r of request b = q[(qo_indptr[b] * H) + r]) and cut into row tiles of BM rows. The
// work is the list of (row tile, key tile of BN keys) units, request by request; a persistent grid of one
// block per SM takes equal contiguous shares of it (stream-K), so every SM gets the same number of key
// tiles whatever the batch looks like. Where a block's share covers a row tile whole, it writes o/lse;
// otherwise it writes an fp32 partial (o, lse) that verify_mla_merge combines through the LSEs.
//
// Inside a block (8 warps): Q fragments live in registers (BM 32) or are read from shared memory (BM 64,
// on parts with ~227 KB); K tiles of BN keys stream through a cp.async ring whose slot ids are fetched
// ahead. S = Q K^T is computed as dim-slice x row-group x key-part partials (mma.sync m16n8k16), summed
// through shared memory by the softmax step, which writes P (bf16) back; then each warp accumulates P V
// for its 64 output columns. The sm_120 configuration stays under its 101,376-byte per-block limit.
#include <cuda_bf16.h>

#include "verify_mla_config.cuh"

namespace {

// NVRTC has no <stdint.h>
using uint32_t = unsigned int;
using int64_t = long long;

constexpr int NUM_THREADS = VMLA_WARPS * 32;
constexpr int KSTEPS_PER_SLICE = VMLA_DIM / 16 / VMLA_DSLICES;  // 9 k16-steps of QK per warp
constexpr int ROW_STRIDE = VMLA_DIM + 8;                          // bf16 elems; +16 B keeps ldmatrix conflict-free
constexpr int S_STRIDE = VMLA_BN + 8;                             // fp32 elems per scratch row
constexpr int P_STRIDE = VMLA_BN + 8;                             // bf16 elems per P row
constexpr int MT = VMLA_BM / 16;                                  // m16 tiles per block
constexpr int QK_MT = MT / VMLA_RGROUPS;                          // m16 tiles per warp in QK
constexpr int QK_NT = VMLA_BN / VMLA_KHALVES / 8;                 // n8 tiles of keys per warp in QK
constexpr int PV_COLS = VMLA_VDIM / VMLA_WARPS;                   // output columns per warp
constexpr int PV_NT = PV_COLS / 8;
constexpr int CHUNKS_PER_ROW = VMLA_DIM * 2 / 16;                 // 16-byte pieces per 576-wide row
constexpr int THREADS_PER_ROW = NUM_THREADS / VMLA_BM;            // softmax threads per row
constexpr int COLS_PER_THREAD = VMLA_BN / THREADS_PER_ROW;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define VMLA_NEG_INF (-__int_as_float(0x7f800000))

static_assert(VMLA_DSLICES * VMLA_RGROUPS * VMLA_KHALVES == VMLA_WARPS, "QK split must use every warp");
static_assert(QK_MT * VMLA_RGROUPS == MT && QK_NT % 2 == 0, "QK rows and keys must split evenly");
static_assert(KSTEPS_PER_SLICE * 16 * VMLA_DSLICES == VMLA_DIM, "dims must split evenly");
static_assert(PV_COLS * VMLA_WARPS == VMLA_VDIM && PV_NT % 2 == 0, "output columns must split evenly");
static_assert(COLS_PER_THREAD % 4 == 0 && THREADS_PER_ROW <= 32, "softmax step reads float4s within a warp");
static_assert(VMLA_Q_SMEM || VMLA_BM <= VMLA_BN, "Q staging reuses one K stage buffer");

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
  float m_final[VMLA_BM];
  float l_final[VMLA_BM];
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: fill with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
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

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fetch the slot ids of keys [k0, k0 + BN) into idx[slot] (0 past k_end). One warp's worth of threads.
__device__ __forceinline__ void load_tile_slots(Smem& sm, int slot, const int* __restrict__ kv_idx, int k0, int k_end) {
  if (threadIdx.x < VMLA_BN) {
    const int key = k0 + threadIdx.x;
    cp_async_4(&sm.idx[slot][threadIdx.x], key < k_end ? kv_idx + key : kv_idx, key < k_end);
  }
}

// Gather BN pool rows (keys [k0, k0 + BN) of this segment, slot ids already in idx[slot]) into one stage;
// rows past k_end are zero.
__device__ __forceinline__ void load_kv_tile(Smem& sm, int stage, int slot, const __nv_bfloat16* __restrict__ kv_buffer,
                                             int k0, int k_end) {
#ifndef VMLA_SKIP_LOAD
  for (int c = threadIdx.x; c < VMLA_BN * CHUNKS_PER_ROW; c += NUM_THREADS) {
    const int r = c / CHUNKS_PER_ROW, part = c % CHUNKS_PER_ROW;
    const bool valid = k0 + r < k_end;
    const __nv_bfloat16* src = kv_buffer + static_cast<int64_t>(sm.idx[slot][r]) * VMLA_DIM + part * 8;
    cp_async_16(&sm.kv[stage][r][part * 8], valid ? src : kv_buffer, valid);
  }
#endif
}

}  // namespace

// Dynamic shared memory verify_mla_fwd needs (kdtree.kernel.KernelConfig.smem_bytes must agree; a GPU test checks).
extern "C" __constant__ int verify_mla_smem_bytes = sizeof(Smem);

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
  __nv_bfloat16* __restrict__ o;                // [T * H, 512]
  float* __restrict__ lse;                      // [T * H] or null
};

// One segment: rows [row0, row0 + BM) of request b against its keys [k_begin, k_end). Writes o/lse (out_o
// null) or the fp32 partial out_o[BM][512], out_lse[BM] normalised by its own sum.
__device__ __forceinline__ void verify_segment(Smem& sm, const Args& a, int b, int row0, int k_begin, int k_end,
                                               float* __restrict__ out_o, float* __restrict__ out_lse) {
  const __nv_bfloat16* __restrict__ q = a.q;
  const __nv_bfloat16* __restrict__ kv_buffer = a.kv_buffer;
  const int* __restrict__ tree_mask = a.tree_mask;
  const int mask_words = a.mask_words, num_heads = a.num_heads;
  const float sm_scale = a.sm_scale, logit_cap = a.logit_cap;
  const int q0 = a.qo_indptr[b];
  const int rows = (a.qo_indptr[b + 1] - q0) * num_heads;
  const int kv_start = a.kv_indptr[b];
  const int prefix = a.prefix_lens[b];
  const int* kv_idx = a.kv_indices + kv_start;
  const int64_t grow0 = static_cast<int64_t>(q0) * num_heads + row0;  // global row of this block's first row
  const int valid_rows = rows - row0;  // < BM in a request's last row tile

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tig = lane % 4;

  // ---- prologue: Q into shared memory (its own buffer, or staged in the last K stage) ----
#if VMLA_Q_SMEM
  __nv_bfloat16(*qs)[ROW_STRIDE] = sm.q;
#else
  __nv_bfloat16(*qs)[ROW_STRIDE] = sm.kv[VMLA_STAGES - 1];
#endif
  {
    for (int c = tid; c < VMLA_BM * CHUNKS_PER_ROW; c += NUM_THREADS) {
      const int r = c / CHUNKS_PER_ROW, part = c % CHUNKS_PER_ROW;
      const bool valid = row0 + r < rows;
      const __nv_bfloat16* src = valid ? q + (grow0 + r) * VMLA_DIM + part * 8 : q;
      cp_async_16(&qs[r][part * 8], src, valid);
    }
  }
  const int num_tiles = (k_end - k_begin + VMLA_BN - 1) / VMLA_BN;
#pragma unroll
  for (int j = 0; j < SLOT_AHEAD; ++j) load_tile_slots(sm, j, kv_idx, k_begin + j * VMLA_BN, k_end);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();  // Q staged, slot ids of the first tiles in shared memory
#pragma unroll
  for (int j = 0; j < VMLA_STAGES - 1; ++j) {  // one commit group per tile
    if (j < num_tiles) load_kv_tile(sm, j, j, kv_buffer, k_begin + j * VMLA_BN, k_end);
    cp_async_commit();
  }

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

  // softmax-step state: THREADS_PER_ROW threads per row, each COLS_PER_THREAD keys of a tile
  const int srow = tid / THREADS_PER_ROW, scol = (tid % THREADS_PER_ROW) * COLS_PER_THREAD;
  const bool srow_valid = row0 + srow < rows;
  const int stoken = q0 + (srow_valid ? (row0 + srow) / num_heads : 0);
  float m_run = VMLA_NEG_INF, l_run = 0.f;  // m in the log2 domain
  const float scale_log2 = sm_scale * LOG2E;

  float acc[MT][PV_NT][4];
  zero_frags(acc);

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % VMLA_STAGES;
    const int k0 = k_begin + t * VMLA_BN;
    cp_async_wait<VMLA_STAGES - 2>();  // tile t has landed (newer tiles may still be in flight)
    __syncthreads();  // tile t visible to all; every warp is past P.V of tile t-1, whose buffer we refill now
    {
      const int ahead = t + VMLA_STAGES - 1;
      if (ahead < num_tiles)
        load_kv_tile(sm, ahead % VMLA_STAGES, ahead % IDX_RING, kv_buffer, k_begin + ahead * VMLA_BN, k_end);
      load_tile_slots(sm, (t + SLOT_AHEAD) % IDX_RING, kv_idx, k_begin + (t + SLOT_AHEAD) * VMLA_BN, k_end);
      cp_async_commit();
    }

    // ---- S partial = Q[:, slice] K[keys of this half, slice]^T ----
    {
      float s[QK_MT][QK_NT][4];
      zero_frags(s);
      const int key_base = khalf * (VMLA_BN / VMLA_KHALVES);
#pragma unroll
      for (int ks = 0; ks < KSTEPS_PER_SLICE; ++ks) {
        const int d0 = dslice * KSTEPS_PER_SLICE * 16 + ks * 16;
#if VMLA_Q_SMEM
        uint32_t qa[QK_MT][4];
#pragma unroll
        for (int mi = 0; mi < QK_MT; ++mi)
          if (qk_row0 + mi * 16 < valid_rows)
            ldmatrix_x4(qa[mi], &qs[qk_row0 + mi * 16 + ((lane / 8) % 2) * 8 + lane % 8][d0 + (lane / 16) * 8]);
#define VMLA_QFRAG(mi) qa[mi]
#else
#define VMLA_QFRAG(mi) qf[mi][ks]
#endif
#pragma unroll
        for (int np = 0; np < QK_NT; np += 2) {
          uint32_t kb[4];
          const int key = key_base + np * 8 + (lane / 16) * 8 + lane % 8;
          const int d = d0 + ((lane / 8) % 2) * 8;
          ldmatrix_x4(kb, &sm.kv[stage][key][d]);
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
#pragma unroll
      for (int mi = 0; mi < QK_MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < QK_NT; ++ni) {
          const int col = key_base + ni * 8 + tig * 2;
          const int r = qk_row0 + mi * 16 + g;
          *reinterpret_cast<float2*>(&sm.s[dslice][r][col]) = make_float2(s[mi][ni][0], s[mi][ni][1]);
          *reinterpret_cast<float2*>(&sm.s[dslice][r + 8][col]) = make_float2(s[mi][ni][2], s[mi][ni][3]);
        }
    }
    __syncthreads();

    // ---- softmax step: sum the partials, scale, cap, mask, online max/sum, write P ----
    {
      float x[COLS_PER_THREAD];
#pragma unroll
      for (int c4 = 0; c4 < COLS_PER_THREAD; c4 += 4) {
        float4 a = *reinterpret_cast<const float4*>(&sm.s[0][srow][scol + c4]);
#pragma unroll
        for (int d = 1; d < VMLA_DSLICES; ++d) {
          const float4 v = *reinterpret_cast<const float4*>(&sm.s[d][srow][scol + c4]);
          a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w;
        }
        x[c4] = a.x; x[c4 + 1] = a.y; x[c4 + 2] = a.z; x[c4 + 3] = a.w;
      }
#ifdef VMLA_SKIP_SOFTMAX  // timing experiment: P = scores, no mask/max/exp/sums
      __nv_bfloat16 pq[COLS_PER_THREAD];
#pragma unroll
      for (int c = 0; c < COLS_PER_THREAD; ++c) pq[c] = __float2bfloat16_rn(x[c] * 1e-3f);
#pragma unroll
      for (int c4 = 0; c4 < COLS_PER_THREAD; c4 += 4)
        *reinterpret_cast<uint2*>(&sm.p[srow][scol + c4]) = *reinterpret_cast<const uint2*>(&pq[c4]);
      if (tid % THREADS_PER_ROW == 0) sm.alpha[srow] = 1.f;
      l_run = 1.f;
#else
      float tile_max = VMLA_NEG_INF;
#pragma unroll
      for (int c = 0; c < COLS_PER_THREAD; ++c) {
        const int key = k0 + scol + c;
        float v = logit_cap > 0.f ? logit_cap * tanhf(x[c] * sm_scale / logit_cap) * LOG2E : x[c] * scale_log2;
        bool visible = key < k_end;
        if (visible && key >= prefix && srow_valid) {
          const int j = key - prefix;
          visible = (tree_mask[static_cast<int64_t>(stoken) * mask_words + (j >> 5)] >> (j & 31)) & 1;
        }
        x[c] = visible ? v : VMLA_NEG_INF;
        tile_max = fmaxf(tile_max, x[c]);
      }
#pragma unroll
      for (int off = THREADS_PER_ROW / 2; off > 0; off /= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float m_new = fmaxf(m_run, tile_max);
      const float m_use = m_new == VMLA_NEG_INF ? 0.f : m_new;
      const float alpha = exp2f(m_run - m_use);
      float psum = 0.f;
      __nv_bfloat16 pb[COLS_PER_THREAD];
#pragma unroll
      for (int c = 0; c < COLS_PER_THREAD; ++c) {
        const float p = exp2f(x[c] - m_use);
        psum += p;
        pb[c] = __float2bfloat16_rn(p);
      }
#pragma unroll
      for (int off = THREADS_PER_ROW / 2; off > 0; off /= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      l_run = l_run * alpha + psum;
      m_run = m_new;
#pragma unroll
      for (int c4 = 0; c4 < COLS_PER_THREAD; c4 += 4)
        *reinterpret_cast<uint2*>(&sm.p[srow][scol + c4]) = *reinterpret_cast<const uint2*>(&pb[c4]);
      if (tid % THREADS_PER_ROW == 0) sm.alpha[srow] = alpha;
#endif
    }
    __syncthreads();

    // ---- O = alpha * O + P V for this warp's output columns ----
    {
      const int col0 = warp * PV_COLS;
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const float a_lo = sm.alpha[mi * 16 + g], a_hi = sm.alpha[mi * 16 + g + 8];
#pragma unroll
        for (int ni = 0; ni < PV_NT; ++ni) {
          acc[mi][ni][0] *= a_lo; acc[mi][ni][1] *= a_lo;
          acc[mi][ni][2] *= a_hi; acc[mi][ni][3] *= a_hi;
        }
      }
#pragma unroll
      for (int kk = 0; kk < VMLA_BN / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          const int r = mi * 16 + ((lane / 8) % 2) * 8 + lane % 8;
          if (mi * 16 < valid_rows) ldmatrix_x4(pa[mi], &sm.p[r][kk * 16 + (lane / 16) * 8]);
        }
#pragma unroll
        for (int np = 0; np < PV_NT; np += 2) {
          uint32_t vb[4];
          const int key = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
          const int c = col0 + np * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(vb, &sm.kv[stage][key][c]);
#ifndef VMLA_SKIP_PV
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            if (mi * 16 >= valid_rows) continue;
            mma_bf16(acc[mi][np], pa[mi], vb[0], vb[1]);
            mma_bf16(acc[mi][np + 1], pa[mi], vb[2], vb[3]);
          }
#else
          acc[0][np][0] += __uint_as_float(vb[0] ^ vb[3] ^ pa[0][0]);
#endif
        }
      }
    }
  }

  // ---- epilogue ----
  if (tid % THREADS_PER_ROW == 0) {
    sm.m_final[srow] = m_run;
    sm.l_final[srow] = l_run;
  }
  __syncthreads();
  const bool direct = out_o == nullptr;
  if (tid % THREADS_PER_ROW == 0 && srow_valid) {
    const float l = l_run;
    const float row_lse = l > 0.f ? (m_run + log2f(l)) * LN2 : VMLA_NEG_INF;
    if (direct) {
      if (a.lse != nullptr) a.lse[grow0 + srow] = row_lse;
    } else {
      out_lse[srow] = row_lse;
    }
  }
  const int col0 = warp * PV_COLS;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mi * 16 + g + half * 8;
      if (row0 + r >= rows) continue;
      const float l = sm.l_final[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int ni = 0; ni < PV_NT; ++ni) {
        const int c = col0 + ni * 8 + tig * 2;
        const float v0 = acc[mi][ni][half * 2] * inv, v1 = acc[mi][ni][half * 2 + 1] * inv;
        if (direct) {
          *reinterpret_cast<__nv_bfloat162*>(&a.o[(grow0 + r) * VMLA_VDIM + c]) = __floats2bfloat162_rn(v0, v1);
        } else {
          *reinterpret_cast<float2*>(&out_o[r * VMLA_VDIM + c]) = make_float2(v0, v1);
        }
      }
    }
  cp_async_wait_all();  // slot-id prefetches past the end must land before the next segment reuses the ring
  __syncthreads();      // the next segment reuses every shared buffer
}

// Persistent stream-K grid: block c takes work units [cta_unit_start[c], cta_unit_start[c + 1]) of the list of
// (row tile, key tile) units; row tile rt owns units [rt_unit_start[rt], rt_unit_start[rt + 1]).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
verify_mla_fwd(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv_buffer,
               const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,
               const int* __restrict__ kv_indices, const int* __restrict__ prefix_lens,
               const int* __restrict__ tree_mask, int mask_words, int num_heads, float sm_scale, float logit_cap,
               __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
               const int* __restrict__ cta_unit_start,  // [grid + 1]
               const int* __restrict__ cta_first_rt,    // [grid]
               const int* __restrict__ rt_unit_start,   // [row tiles + 1]
               const int* __restrict__ rt_request,      // [row tiles]
               const int* __restrict__ rt_row0,         // [row tiles] first row within its request
               const int* __restrict__ rt_first_cta,    // [row tiles] block holding the tile's first unit
               const int* __restrict__ rt_seg_base,     // [row tiles + 1] partial slots of each tile
               float* __restrict__ part_o,              // [segments, BM, 512]
               float* __restrict__ part_lse) {          // [segments, BM]
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const Args a{q, kv_buffer, qo_indptr, kv_indptr, kv_indices, prefix_lens, tree_mask, mask_words, num_heads,
               sm_scale, logit_cap, o, lse};
  const int c = blockIdx.x;
  int u = cta_unit_start[c];
  const int u_end = cta_unit_start[c + 1];
  for (int rt = cta_first_rt[c]; u < u_end; ++rt) {
    const int t0 = rt_unit_start[rt], t1 = rt_unit_start[rt + 1];
    const int seg_end = min(u_end, t1);
    const int b = rt_request[rt];
    const int kv_len = a.kv_indptr[b + 1] - a.kv_indptr[b];
    const int k_begin = (u - t0) * VMLA_BN, k_end = min(kv_len, (seg_end - t0) * VMLA_BN);
    const int segments = rt_seg_base[rt + 1] - rt_seg_base[rt];
    float* out_o = nullptr;
    float* out_lse = nullptr;
    if (segments > 1) {
      const int64_t slot = rt_seg_base[rt] + (c - rt_first_cta[rt]);
      out_o = part_o + slot * VMLA_BM * VMLA_VDIM;
      out_lse = part_lse + slot * VMLA_BM;
    }
    verify_segment(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse);
    u = seg_end;
  }
}

// Combine the partials of every row whose tile was split across blocks, through their LSEs (rows of
// tiles written whole by one block are left alone). One block of 128 threads per row.
extern "C" __global__ void __launch_bounds__(128)
verify_mla_merge(const int* __restrict__ qo_indptr, int batch_size, int num_heads,
                 const int* __restrict__ req_rt_base,  // [bs + 1] first row tile of each request
                 const int* __restrict__ rt_seg_base, const float* __restrict__ part_o,
                 const float* __restrict__ part_lse, __nv_bfloat16* __restrict__ o, float* __restrict__ lse) {
  const int row = blockIdx.x;
  const int token = row / num_heads;
  int lo = 0, hi = batch_size;  // request of this token: qo_indptr[b] <= token < qo_indptr[b + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (qo_indptr[mid] <= token) lo = mid; else hi = mid;
  }
  const int r = row - qo_indptr[lo] * num_heads;
  const int rt = req_rt_base[lo] + r / VMLA_BM, tr = r % VMLA_BM;
  const int base = rt_seg_base[rt], segs = rt_seg_base[rt + 1] - base;
  if (segs <= 1) return;
  float mx = VMLA_NEG_INF;
  for (int s = 0; s < segs; ++s) mx = fmaxf(mx, part_lse[static_cast<int64_t>(base + s) * VMLA_BM + tr]);
  const float m_use = mx == VMLA_NEG_INF ? 0.f : mx;
  float wsum = 0.f;
  for (int s = 0; s < segs; ++s) wsum += __expf(part_lse[static_cast<int64_t>(base + s) * VMLA_BM + tr] - m_use);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  for (int c = threadIdx.x * 4; c < VMLA_VDIM; c += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < segs; ++s) {
      const int64_t slot = base + s;
      const float w = __expf(part_lse[slot * VMLA_BM + tr] - m_use) * inv;
      const float4 v = *reinterpret_cast<const float4*>(&part_o[(slot * VMLA_BM + tr) * VMLA_VDIM + c]);
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(&o[static_cast<int64_t>(row) * VMLA_VDIM + c]);
    dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
    dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[row] = wsum > 0.f ? m_use + logf(wsum) : VMLA_NEG_INF;
}
