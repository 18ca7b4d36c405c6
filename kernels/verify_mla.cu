// Target-verify attention for absorbed MLA (SGLang TARGET_VERIFY, tree drafts), bf16 in/out, fp32 accumulate.
//
// For request b, draft node i, head h:  o[i,h] = sum_t softmax_t(scale * q[i,h].K[t]) V[t]
// over every prefix key and the draft keys node i may see (bit j of tree_mask[token, j/32]).
// K[t] is the 576-wide pool row at combined_kv_indices[kv_indptr[b] + t] (prefix slots ++ out_cache_loc),
// V[t] its first 512 columns. See docs/kernel-design.md for the design and its numbers.
//
// Work decomposition: all heads of all nodes of a request share one KV stream, so rows (node, head) are
// packed into M (row r of request b = q[(qo_indptr[b] * H) + r]) and cut into row tiles of BM rows. The
// work is the list of (row tile, key tile of BN keys) units, request by request; a persistent grid of one
// block per SM takes contiguous shares of it (stream-K), balanced by the host's plan so every SM gets the same
// work (key tiles + a cost per segment) whatever the batch looks like. A share covering a row tile writes o/lse;
// otherwise it writes an fp32 partial (o, lse), combined through the LSEs by the last of the tile's blocks to
// finish (tiles of at most VMLA_FUSED_MERGE_SEGS partials) or by verify_mla_merge after this kernel.
//
// Inside a block (8 warps): Q fragments live in registers (BM 32) or are read from shared memory (BM 64,
// on parts with ~227 KB); K tiles of BN keys stream through a cp.async ring whose slot ids are fetched
// ahead. S = Q K^T is computed as dim-slice x row-group x key-part partials (mma.sync m16n8k16), summed
// through shared memory by the softmax step, which writes P (bf16) back; then each warp accumulates P V
// for its 64 output columns. The sm_120 configuration stays under its 101,376-byte per-block limit.
// On Hopper (VMLA_WGMMA, compiled for sm_90a) the segment body is one of the verify_mla_body_*.cuh headers (shared
// parts in verify_mla_wgmma_common.cuh): warpgroup MMAs straight from swizzled shared memory; the stream-K walk,
// slot-id ring, mask bits and merges are shared. The mma.sync body is verify_mla_body_mma_sync.cuh.
#include "verify_mla_common.cuh"

namespace {
using namespace vmla;

constexpr int NUM_THREADS = VMLA_WARPS * 32;
}  // namespace

// The fused merge: after a block has written its partial of a split row tile, the last of the tile's `segs`
// blocks to finish (counted in *counter, reset to 0 for the next launch) combines them into o/lse. Only for
// tiles of at most VMLA_FUSED_MERGE_SEGS partials (the plan decides; longer merges are verify_mla_merge's:
// one block reading many partials would hold up the end of the kernel).
struct TileMerge {
  int* counter;  // null: verify_mla_merge runs after this kernel instead
  int segs;
  const float* tile_o;    // the tile's first partial slot, [segs][BM][512]
  const float* tile_lse;  // [segs][BM]
};

template <class S>
__device__ __forceinline__ void merge_if_last(S& sm, const Args& a, const TileMerge& m, int64_t grow0, int valid_rows) {
  __threadfence();  // this block's partial is visible device-wide before the counter says it is there
  __syncthreads();
  if (threadIdx.x == 0) {
    sm.flag[0] = atomicAdd(m.counter, 1) == m.segs - 1;
    if (sm.flag[0]) *m.counter = 0;  // every block of this tile has counted: ready for the next launch
  }
  __syncthreads();
  if (!sm.flag[0]) return;
  __threadfence();
  // per-row weights of the segs partials into the (now idle) score buffer, then the rows, CHUNKS_PER_THREAD
  // float4s per thread at a time with every load of a round in flight together
  valid_rows = min(valid_rows, VMLA_BM);  // (rows - row0 counts the request's later tiles too)
  float (*w)[VMLA_BM] = reinterpret_cast<float (*)[VMLA_BM]>(&sm.s[0][0][0]);
  for (int r = threadIdx.x; r < valid_rows; r += NUM_THREADS) {
    const MergeWeights mw = merge_weights(m.tile_lse + r, VMLA_BM, m.segs);
    for (int s = 0; s < m.segs; ++s) w[s][r] = merge_weight(__ldcg(m.tile_lse + s * VMLA_BM + r), mw);
    if (a.lse != nullptr) a.lse[grow0 + r] = merged_lse(mw);
  }
  __syncthreads();
  constexpr int CHUNKS = VMLA_VDIM / 4, CHUNKS_PER_THREAD = 4;
  const int total = valid_rows * CHUNKS;
  for (int i0 = threadIdx.x; i0 < total; i0 += CHUNKS_PER_THREAD * NUM_THREADS) {
    float4 acc[CHUNKS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < VMLA_FUSED_MERGE_SEGS; ++s) {
      if (s >= m.segs) break;
#pragma unroll
      for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
        const int i = i0 + j * NUM_THREADS, r = i / CHUNKS;
        if (i < total)
          add_weighted(
              acc[j], w[s][r],
              __ldcg(reinterpret_cast<const float4*>(m.tile_o + (s * VMLA_BM + r) * VMLA_VDIM + (i % CHUNKS) * 4)));
      }
    }
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      const int i = i0 + j * NUM_THREADS;
      if (i < total) store_bf16x4(&a.o[(grow0 + i / CHUNKS) * VMLA_VDIM + (i % CHUNKS) * 4], acc[j]);
    }
  }
}

#if VMLA_WGMMA
#include "verify_mla_body_dims_split.cuh"
#include "verify_mla_body_split_keys.cuh"
#include "verify_mla_body_blocks64.cuh"
#include "verify_mla_body_few_rows.cuh"
using BlockSmem = vmla_wg::Smem;
constexpr int SMEM_ALIGN = 1024;  // the swizzled atoms need 1024-byte alignment: the block aligns its base
#else
#include "verify_mla_body_mma_sync.cuh"
using BlockSmem = Smem;
constexpr int SMEM_ALIGN = 0;
#endif

// Dynamic shared memory verify_mla_fwd needs. The host passes what it will launch with
// (kdtree.kernel.KernelConfig.smem_bytes) as VMLA_SMEM_BYTES: a disagreement fails the compile, on any machine.
extern "C" __constant__ int verify_mla_smem_bytes = sizeof(BlockSmem) + SMEM_ALIGN;
#ifdef VMLA_SMEM_BYTES
static_assert(sizeof(BlockSmem) + SMEM_ALIGN == VMLA_SMEM_BYTES,
              "KernelConfig.smem_bytes (VMLA_SMEM_BYTES) is not the shared memory verify_mla_fwd uses");
#endif

// The walk's state across a segment: the next segment's tile and unit range (the default), or only its tile and
// the range's end, the plan entries loaded again (VMLA_WALK_LEAN: two registers fewer, for the timing hooks' builds,
// which spill with the default's).
#ifndef VMLA_WALK_LEAN
#define VMLA_WALK_LEAN (VMLA_TRACE || VMLA_PHASES)
#endif

// A plan entry loaded where it is used, not held across a segment (the blocks64 body has no register to spare).
__device__ __forceinline__ int plan_entry(const int* p, int i) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(v) : "l"(p + i));
  return v;
}

// Persistent stream-K grid: block c takes work units [cta_unit_start[c], cta_unit_start[c + 1]) of the list of
// (row tile, key tile) units; row tile rt owns units [rt_unit_start[rt], rt_unit_start[rt + 1]).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, VMLA_BLOCKS_PER_SM)
    verify_mla_fwd(VMLA_KERNEL_PARAMS(VMLA_FWD_PARAMS)) {  // vmla::FwdParams' members (verify_mla_params.cuh)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BlockSmem& sm = *reinterpret_cast<BlockSmem*>(
      smem_raw + (SMEM_ALIGN ? (SMEM_ALIGN - smem_addr(smem_raw) % SMEM_ALIGN) % SMEM_ALIGN : 0));
  const Args a{q,          kv_buffer, qo_indptr, kv_indptr, kv_indices, prefix_lens, tree_mask,
               mask_words, num_heads, sm_scale,  logit_cap, o,          lse};
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // verify_mla_merge may launch now (it waits)
#endif
  VMLA_MARK(-1);
  VMLA_MARK(VMLA_MARK_START);
#if VMLA_WALK_LEAN
  // row tile rt's units in [block start, u_hi): first the block's last segment (u_hi its end), then from its first
  // row tile up to that segment (u_hi its start); only rt and u_hi are held across a segment
  int rt = cta_first_rt[blockIdx.x], u_hi = cta_unit_start[blockIdx.x + 1];
  if (VMLA_LAST_SEGMENT_FIRST && cta_unit_start[blockIdx.x] < u_hi)
    while (rt_unit_start[rt + 1] < u_hi) ++rt;
  for (;;) {
    const int t0 = plan_entry(rt_unit_start, rt);
    const int seg_begin = max(plan_entry(cta_unit_start, blockIdx.x), t0);
    if (seg_begin >= u_hi) break;  // (before t1 is read: rt may be one past the last row tile)
    const int t1 = plan_entry(rt_unit_start, rt + 1);
    const int seg_end = min(u_hi, t1);
#else
  // units [u, u_hi) of row tiles rt, rt + 1, ...: first the block's last segment, then the units before it
  int rt = cta_first_rt[blockIdx.x], u = cta_unit_start[blockIdx.x], u_hi = cta_unit_start[blockIdx.x + 1];
  if (VMLA_LAST_SEGMENT_FIRST && u < u_hi) {
    while (rt_unit_start[rt + 1] < u_hi) ++rt;
    u = max(u, rt_unit_start[rt]);
  }
  while (u < u_hi) {
    const int t0 = rt_unit_start[rt], t1 = rt_unit_start[rt + 1];
    const int seg_begin = u, seg_end = min(u_hi, t1);
#endif
    const int b = rt_request[rt];
    const int kv_len = a.kv_indptr[b + 1] - a.kv_indptr[b];
    const int k_begin = (seg_begin - t0) * VMLA_BN, k_end = min(kv_len, (seg_end - t0) * VMLA_BN);
    const int segments = rt_seg_base[rt + 1] - rt_seg_base[rt];
    VMLA_MARK(0);
    float* out_o = nullptr;
    float* out_lse = nullptr;
    TileMerge merge{nullptr, segments, nullptr, nullptr};
    if (segments > 1) {
      const int64_t base = rt_seg_base[rt], slot = base + (static_cast<int>(blockIdx.x) - rt_first_cta[rt]);
      out_o = part_o + slot * VMLA_BM * VMLA_VDIM;
      out_lse = part_lse + slot * VMLA_BM;
      if (rt_counter != nullptr)
        merge = {rt_counter + rt, segments, part_o + base * VMLA_BM * VMLA_VDIM, part_lse + base * VMLA_BM};
    }
#if VMLA_WGMMA
    auto merge_tile = [&](int64_t grow0, int valid_rows) {
      if (out_o != nullptr && merge.counter != nullptr) merge_if_last(sm, a, merge, grow0, valid_rows);
    };
    if (VMLA_FEW_ROWS > 0 && (a.qo_indptr[b + 1] - a.qo_indptr[b]) * num_heads - rt_row0[rt] <= VMLA_FEW_ROWS)
      vmla_wg::verify_segment_few(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse, merge_tile);
    else
#if VMLA_SPLIT_KEYS && VMLA_BLOCKS64
      vmla_wg::verify_segment_blocks64(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse, merge_tile);
#elif VMLA_SPLIT_KEYS
      vmla_wg::verify_segment_split_keys(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse,
                                         merge_tile);
#else
      vmla_wg::verify_segment_dims_split(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse,
                                         merge_tile);
#endif
#else
    verify_segment(sm, a, b, rt_row0[rt], k_begin, max(k_begin, k_end), out_o, out_lse, merge);
#endif
    VMLA_MARK(4);
    VMLA_MARK(-2);  // next segment
#if VMLA_WALK_LEAN
    const int c = blockIdx.x, tile_begin = plan_entry(rt_unit_start, rt);
    if (VMLA_LAST_SEGMENT_FIRST && plan_entry(rt_unit_start, rt + 1) >= plan_entry(cta_unit_start, c + 1) &&
        tile_begin > plan_entry(cta_unit_start, c)) {
      u_hi = tile_begin;  // the last segment is done: the units before it, from the block's first row tile
      rt = plan_entry(cta_first_rt, c);
    } else {
      ++rt;
    }
#else
    const int c = blockIdx.x;
    if (VMLA_LAST_SEGMENT_FIRST && u_hi == plan_entry(cta_unit_start, c + 1) &&
        seg_begin > plan_entry(cta_unit_start, c)) {
      u_hi = seg_begin;  // the last segment is done: the units before it, from the block's first
      u = plan_entry(cta_unit_start, c), rt = plan_entry(cta_first_rt, c);
    } else {
      u = seg_end, ++rt;
    }
#endif
  }
  VMLA_MARK(VMLA_MARK_END);
}
