// Two CTAs of a cluster sharing their pool-row gathers (experiments/gather_pair_probe.py; docs/history/kernel-design-log.md, "A
// cluster for sm_120"): does a tile land faster in both CTAs when each reads half its rows from L2 and hands that
// half to the other, than when each reads all of them? The same 32-row tiles of 1,152-byte rows by slot id as
// gather_ceiling.cu, into a ring of STAGES stages, nothing else done with them; rows move as one bulk copy each
// (cp.async.bulk onto a stage mbarrier), issued by an IO warp beside the 8 warps that wait for each tile:
//   gather_bulk_S     one CTA, all 32 rows from global memory (the bulk-copy baseline);
//   gather_pair_fwd_S a cluster of 2: each CTA copies its 16 rows from global memory, and a second IO warp
//                     forwards them (one 18,432-byte shared-to-shared bulk copy) into the peer's same stage;
//   gather_pair_mc_S  a cluster of 2: each CTA's 16 rows multicast from global memory into both CTAs;
//   gather_pair_cp_S  a cluster of 2: each CTA's 16 rows by the kernel's 16-byte cp.async (128 of the waiting
//                     threads, 8 a row; their completion tracked by the stage's mbarrier), forwarded as in
//                     gather_pair_fwd_S.
// Of the pair forms only the forward maps to instructions on sm_120 (docs/history/kernel-design-log.md). A stage is reused once both CTAs have waited for it (an `empty` mbarrier
// of count 2, one arrival from each). Each waiting thread XORs one word of every tile it saw land into `out`;
// `stamps` gets each CTA's %globaltimer at start and end (waves show as CTAs that start after others end).
#include <cuda_bf16.h>

#include "cluster_ptx.cuh"

namespace {
using namespace vmla;
constexpr int ROWS = 32, DIM = 576, ROW_BYTES = DIM * 2, TPR = 8;
constexpr int WAITERS = 256, IO_WARPS = 2, THREADS = WAITERS + 32 * IO_WARPS;
enum Mode { BULK = 0, PAIR_FWD = 1, PAIR_MC = 2, PAIR_CP = 3 };

__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {  // bar's arrival once this thread's copies land
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_g2s_multicast(uint32_t dst, const void* src, int bytes, uint32_t bar,
                                                   unsigned short ctas) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(ctas)
      : "memory");
}
__device__ __forceinline__ void bulk_s2peer(uint32_t peer_dst, uint32_t src, int bytes, uint32_t peer_bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   peer_dst),
               "r"(src), "r"(bytes), "r"(peer_bar)
               : "memory");
}

template <int STAGES, int MODE>
__device__ __forceinline__ void gather(const __nv_bfloat16* __restrict__ pool, const int* __restrict__ slots,
                                       int slot_mask, int tiles, unsigned* out, unsigned long long* stamps) {
  extern __shared__ __align__(128) __nv_bfloat16 ring[];  // [STAGES][ROWS][DIM]
  __shared__ __align__(8) unsigned long long own[STAGES], full[STAGES], empty[STAGES];
  constexpr bool PAIR = MODE != BULK;
  constexpr bool FWD = MODE == PAIR_FWD || MODE == PAIR_CP;  // the peer's rows come by its forward
  constexpr int MINE = PAIR ? ROWS / 2 : ROWS;  // rows this CTA reads from global memory a tile
  constexpr int CP_THREADS = MINE * TPR, COPIES = DIM / 8 / TPR;  // PAIR_CP: the waiting threads that copy
  const uint32_t rank = PAIR ? cluster_rank() : 0, peer = rank ^ 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t ring0 = vmla::smem_addr(ring);
  auto stage_row = [&](int s, int r) { return ring0 + (s * ROWS + r) * ROW_BYTES; };
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamps[2 * blockIdx.x] = t;
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(vmla::smem_addr(&own[s]), MODE == PAIR_CP ? CP_THREADS : 1);  // this CTA's rows (BULK, PAIR_MC: all)
      mbar_init(vmla::smem_addr(&full[s]), 1);   // PAIR_FWD: the peer's forwarded rows
      mbar_init(vmla::smem_addr(&empty[s]), PAIR ? 2 : 1);
    }
    mbar_fence_init();
  }
  if (PAIR) cluster_sync(); else __syncthreads();
  const int first = (blockIdx.x / (PAIR ? 2 : 1)) * tiles * ROWS;  // a cluster's two CTAs gather the same tiles
  auto cp_rows = [&](int t) {  // PAIR_CP: this CTA's rows of tile t, by the first CP_THREADS waiting threads
    const int s = t % STAGES, r = rank * MINE + threadIdx.x / TPR, j = threadIdx.x % TPR;
    const __nv_bfloat16* src = pool + static_cast<int64_t>(slots[(first + t * ROWS + r) & slot_mask]) * DIM;
    __nv_bfloat16* dst = ring + (s * ROWS + r) * DIM;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) vmla::cp_async_16(dst + (j + i * TPR) * 8, src + (j + i * TPR) * 8, true);
    cp_async_arrive_noinc(vmla::smem_addr(&own[s]));
  };
  if (warp == WAITERS / 32) {  // IO warp 0: waits for a stage to be free, then issues this CTA's rows
    for (int t = 0; t < tiles; ++t) {
      if (MODE == PAIR_CP) {  // the waiting threads copy; this warp only announces the peer's forward
        const int s = t % STAGES;
        if (t >= STAGES) mbar_wait(vmla::smem_addr(&empty[s]), (t / STAGES - 1) & 1);
        if (lane == 0) mbar_expect_tx(vmla::smem_addr(&full[s]), MINE * ROW_BYTES);
        continue;
      }
      const int s = t % STAGES;
      if (t >= STAGES) mbar_wait(vmla::smem_addr(&empty[s]), (t / STAGES - 1) & 1);
      const uint32_t bar = vmla::smem_addr(&own[s]);
      if (lane == 0) {
        mbar_expect_tx(bar, (MODE == PAIR_MC ? ROWS : MINE) * ROW_BYTES);
        if (FWD) mbar_expect_tx(vmla::smem_addr(&full[s]), MINE * ROW_BYTES);
      }
      __syncwarp();
      if (lane < MINE) {
        const int r = rank * MINE + lane;
        const __nv_bfloat16* src = pool + static_cast<int64_t>(slots[(first + t * ROWS + r) & slot_mask]) * DIM;
        if (MODE == PAIR_MC) bulk_g2s_multicast(stage_row(s, r), src, ROW_BYTES, bar, 3);
        else bulk_g2s(stage_row(s, r), src, ROW_BYTES, bar);
      }
    }
  } else if (warp == WAITERS / 32 + 1) {  // IO warp 1 (PAIR_FWD): this CTA's rows, once landed, into the peer
    if (FWD && lane == 0) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % STAGES;
        mbar_wait(vmla::smem_addr(&own[s]), (t / STAGES) & 1);
        if (MODE == PAIR_CP) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async's bytes, seen by the copy
        const uint32_t src = stage_row(s, rank * MINE);
        bulk_s2peer(in_cta(src, peer), src, MINE * ROW_BYTES, in_cta(vmla::smem_addr(&full[s]), peer));
      }
    }
  } else {  // the 8 waiting warps
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    unsigned seen = 0;
    if (MODE == PAIR_CP && threadIdx.x < CP_THREADS)
      for (int t = 0; t < STAGES; ++t) cp_rows(t);
    for (int t = 0; t < tiles; ++t) {
      const int s = t % STAGES;
      const uint32_t parity = (t / STAGES) & 1;
      mbar_wait(vmla::smem_addr(&own[s]), parity);
      if (FWD) mbar_wait(vmla::smem_addr(&full[s]), parity);
      seen ^= reinterpret_cast<const unsigned*>(ring + (s * ROWS + r) * DIM)[j];
      asm volatile("bar.sync 1, %0;" ::"n"(WAITERS) : "memory");  // every waiting thread is done with stage s
      if (threadIdx.x == 0) {
        mbar_arrive_cluster(in_cta(vmla::smem_addr(&empty[s]), rank));
        if (PAIR) mbar_arrive_cluster(in_cta(vmla::smem_addr(&empty[s]), peer));
      }
      if (MODE == PAIR_CP && threadIdx.x < CP_THREADS && t + STAGES < tiles) {
        mbar_wait(vmla::smem_addr(&empty[s]), (t / STAGES) & 1);  // both CTAs are done with stage s
        cp_rows(t + STAGES);
      }
    }
    out[blockIdx.x * WAITERS + threadIdx.x] = seen;
  }
  __syncwarp();
  if (PAIR) cluster_sync(); else __syncthreads();  // nothing in flight into, or arriving on, a CTA that exits
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamps[2 * blockIdx.x + 1] = t;
  }
}
}  // namespace

#define GATHER_ENTRY(name, stages, mode, attrs)                                                                   \
  extern "C" __global__ void attrs __launch_bounds__(THREADS)                                                     \
      name(const __nv_bfloat16* pool, const int* slots, int slot_mask, int tiles, unsigned* out,                  \
           unsigned long long* stamps) {                                                                          \
    gather<stages, mode>(pool, slots, slot_mask, tiles, out, stamps);                                             \
  }
#define PAIR_ATTRS __cluster_dims__(2, 1, 1)
GATHER_ENTRY(gather_bulk_2, 2, BULK, )
GATHER_ENTRY(gather_bulk_4, 4, BULK, )
GATHER_ENTRY(gather_pair_fwd_2, 2, PAIR_FWD, PAIR_ATTRS)
GATHER_ENTRY(gather_pair_fwd_4, 4, PAIR_FWD, PAIR_ATTRS)
GATHER_ENTRY(gather_pair_mc_2, 2, PAIR_MC, PAIR_ATTRS)
GATHER_ENTRY(gather_pair_mc_4, 4, PAIR_MC, PAIR_ATTRS)
GATHER_ENTRY(gather_pair_cp_2, 2, PAIR_CP, PAIR_ATTRS)
GATHER_ENTRY(gather_pair_cp_4, 4, PAIR_CP, PAIR_ATTRS)
