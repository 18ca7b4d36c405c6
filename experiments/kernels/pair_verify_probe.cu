// A producer/consumer pair of CTAs for the mma.sync path (experiments/pair_verify_probe.py; docs/history/kernel-design-log.md,
// "A producer/consumer pair for sm_120"): how fast can 64 query rows run against their keys when one CTA of a
// cluster of 2 scores them (QK and the softmax) and the other accumulates P V, each in sm_120's 99 KB?
// The steady state of a long request only: one 64-row tile a cluster over `nkeys` keys (a multiple of 32)
// gathered by slot id, no mask, no cap, no split; the output normalised. Nothing of the verify kernel's plan.
//
// Producer (cluster rank 0), 8 warps = 2 row groups (32 rows) x 2 key halves (16 keys) x 2 dim halves (288 dims):
// Q fragments in registers for the whole run (144 a thread); K tiles of 32 pool rows (1,152 B) by 16-byte
// cp.async into 2 stages; QK by mma.sync m16n8k16, the dim halves' partial scores summed through shared memory;
// the online softmax (exact running max, log2 domain) by the 4 warps of dim half 0, their row maxima traded
// between the key halves; P (bf16) and each row's rescale factor written into the consumer's shared memory by
// st.async, completing on the consumer's p_full mbarrier of that stage. Consumer (rank 1), 8 warps of 64 output
// columns each: V tiles (the pool rows' first 1,024 B) by cp.async into 2 stages of its own; a tile's P V once its
// P has landed, the accumulators rescaled first; it frees the P stage with a remote arrival on the producer's
// p_empty. The producer sends its row sums at the end.
// Timing switches (the output is wrong with any of them; experiments/pair_verify_probe.py --parts): PROBE_ROLE_ONLY 1
// runs the producer alone (nothing sent, nothing waited for), 2 the consumer alone (P never waited for);
// PROBE_SKIP_LOAD leaves the pool-row copies out.
#include <cuda_bf16.h>

#include "cluster_ptx.cuh"

#ifndef PROBE_ROLE_ONLY
#define PROBE_ROLE_ONLY 0
#endif
#ifndef PROBE_SKIP_LOAD
#define PROBE_SKIP_LOAD 0
#endif
#ifndef PROBE_DSPLIT
#define PROBE_DSPLIT 2  // the producer's warps: 2 dim halves (1: all 576 dims a warp; see producer())
#endif

namespace {
#ifndef PROBE_PINGPONG
#define PROBE_PINGPONG 0  // 1: the producer's warps in two groups of 4 on alternate tiles (producer_pingpong)
#endif
#ifndef PROBE_FWD_V
#define PROBE_FWD_V 0  // 1 (with PROBE_PINGPONG): the producer forwards each tile's V (its K rows' first 1,024 B) into
                       // the consumer's stage by st.async, so the consumer gathers nothing and L2 is read once a row
#endif
#ifndef PROBE_PSTAGES
#define PROBE_PSTAGES PROBE_STAGES  // the P ring in the consumer: tiles the scorer may run ahead of the P V
#endif
#ifndef PROBE_BN
#define PROBE_BN 32  // keys a tile (16 or 32)
#endif
#ifndef PROBE_STAGES
#define PROBE_STAGES 2  // each role's cp.async ring (and the P ring): tiles in flight + 1
#endif
constexpr int ROWS = 64, BN = PROBE_BN, DIM = 576, VDIM = 512, STAGES = PROBE_STAGES, THREADS = 256;
static_assert((BN == 16 || BN == 32) && (PROBE_DSPLIT == 1 || BN == 32), "16-key tiles take the all-dims producer");
constexpr int KSTRIDE = DIM + 8, VSTRIDE = VDIM + 8, PSTRIDE = BN + 8;  // +16 B: conflict-free ldmatrix rows
constexpr int P_TX = ROWS * BN * 2 + ROWS * 4 + (PROBE_FWD_V ? BN * VDIM * 2 : 0);  // P, the rescale factors (and V)
static_assert(!PROBE_FWD_V || PROBE_PINGPONG, "the forward is the ping-pong producer's");
constexpr int PS = PROBE_PSTAGES;
static_assert(!PROBE_FWD_V || PS == STAGES, "a forwarded V stage is freed with its P stage");

struct ProducerSmem {
  __nv_bfloat16 k[STAGES][BN][KSTRIDE];
  float4 partial[4][32][4];  // dim half 1's partial scores, in fragment order: [row group x key half][lane][frag]
  float rowmax[2][ROWS];     // each key half's tile maxima
  float rowsum[2][ROWS];
  float state_m[ROWS], state_l[ROWS];  // PROBE_PINGPONG: the running max and sum after the last tile scored
  unsigned long long p_empty[PS];
};
struct ConsumerSmem {
  __nv_bfloat16 v[STAGES][BN][VSTRIDE];
  __nv_bfloat16 p[PS][ROWS][PSTRIDE];
  float alpha[PS][ROWS];
  float l[ROWS];
  unsigned long long p_full[PS], fin;
};
constexpr int SMEM = sizeof(ProducerSmem) > sizeof(ConsumerSmem) ? sizeof(ProducerSmem) : sizeof(ConsumerSmem);
#ifndef PROBE_OVER_LIMIT
#define PROBE_OVER_LIMIT 0  // 1: a build past sm_120's shared memory, timed on the H200 only
#endif
static_assert(PROBE_OVER_LIMIT || SMEM <= 101376, "over sm_120's 99 KB of shared memory a block");

__device__ __forceinline__ uint32_t in_cta(const void* p, uint32_t cta) { return vmla::in_cta(vmla::smem_addr(p), cta); }
__device__ __forceinline__ void mbar_init(void* bar, int count) { vmla::mbar_init(vmla::smem_addr(bar), count); }
__device__ __forceinline__ void mbar_expect_tx(void* bar, int bytes) { vmla::mbar_expect_tx(vmla::smem_addr(bar), bytes); }
__device__ __forceinline__ void mbar_wait(void* bar, uint32_t parity) { vmla::mbar_wait(vmla::smem_addr(bar), parity); }
using vmla::cluster_rank, vmla::cluster_sync, vmla::mbar_arrive_cluster;
__device__ __forceinline__ void st_async(uint32_t cluster_addr, uint32_t value, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(cluster_addr),
               "r"(value), "r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ void st_async_v4(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// BN pool rows (their first WIDTH dims) into dst rows of STRIDE by N threads (`tid` of them), N / BN a row; `slot`
// is this thread's row's slot id, read a tile earlier (a slot id read just before its copies would stall the warp
// for its latency).
template <int WIDTH, int STRIDE, int N = THREADS>
__device__ __forceinline__ void gather_rows(__nv_bfloat16 (*dst)[STRIDE], const __nv_bfloat16* pool, int slot,
                                            int tid = threadIdx.x) {
  constexpr int PER_ROW = N / BN;
  if (PROBE_SKIP_LOAD) return;
  const int r = tid / PER_ROW, j = tid % PER_ROW;
  const __nv_bfloat16* src = pool + static_cast<int64_t>(slot) * DIM;
#pragma unroll
  for (int i = 0; i < (WIDTH / 8 + PER_ROW - 1) / PER_ROW; ++i)
    if (j + PER_ROW * i < WIDTH / 8) vmla::cp_async_16(&dst[r][(j + PER_ROW * i) * 8], src + (j + PER_ROW * i) * 8, true);
}
template <int N = THREADS>  // the slot id of thread `tid`'s row of `tile`, in gather_rows<.., N>'s split
__device__ __forceinline__ int slot_of(const int* slots, int tile, int ntiles, int tid = threadIdx.x) {
  return tile < ntiles ? slots[tile * BN + tid / (N / BN)] : 0;
}
// A thread's m16n8k16 A fragment of one k16 step of Q: `row0` is its row g at its first dim (2 tq of the step).
__device__ __forceinline__ void q_fragment(uint32_t (&f)[4], const __nv_bfloat16* row0) {
  f[0] = *reinterpret_cast<const uint32_t*>(row0);
  f[1] = *reinterpret_cast<const uint32_t*>(row0 + 8 * DIM);
  f[2] = *reinterpret_cast<const uint32_t*>(row0 + 8);
  f[3] = *reinterpret_cast<const uint32_t*>(row0 + 8 * DIM + 8);
}

// The first STAGES - 1 tiles' rows (their first WIDTH dims) into `ring`; returns this thread's slot id of the next.
template <int WIDTH, int STRIDE>
__device__ __forceinline__ int ring_start(__nv_bfloat16 (*ring)[BN][STRIDE], const __nv_bfloat16* pool,
                                          const int* slots, int ntiles, bool on) {
  for (int i = 0; i < STAGES - 1; ++i) {
    if (on) gather_rows<WIDTH, STRIDE>(ring[i], pool, slot_of(slots, i, ntiles));
    vmla::cp_async_commit();
  }
  return slot_of(slots, STAGES - 1, ntiles);
}
// Tile t: waits until it has landed and every thread is past tile t - 1, refills that stage with tile
// t + STAGES - 1 (`slot_next`, read a tile earlier), and reads the slot id of the tile after it.
template <int WIDTH, int STRIDE, typename AfterWait>
__device__ __forceinline__ void ring_step(__nv_bfloat16 (*ring)[BN][STRIDE], const __nv_bfloat16* pool,
                                          const int* slots, int ntiles, int t, int& slot_next, bool on,
                                          AfterWait after_wait) {
  vmla::cp_async_wait<STAGES - 2>();
  __syncthreads();
  after_wait();  // before the refill is issued (the consumer frees its P stage here: the scorer waits on it)
  if (on && t + STAGES - 1 < ntiles) gather_rows<WIDTH, STRIDE>(ring[(t + STAGES - 1) % STAGES], pool, slot_next);
  vmla::cp_async_commit();
  slot_next = slot_of(slots, t + STAGES, ntiles);
}

// PROBE_DSPLIT 2: warps = 2 row groups of 32 x 2 key halves x 2 dim halves (partial scores summed through shared
// memory, the softmax on 4 warps); 1: 4 row groups of 16 x 2 key halves over all 576 dims (K read twice as often,
// no partial scores, the softmax on all 8 warps). Either way 144 Q registers a thread.
__device__ void producer(ProducerSmem& sm, const __nv_bfloat16* q, const __nv_bfloat16* pool, const int* slots,
                         int ntiles, float scale_log2) {
  constexpr int DS = PROBE_DSPLIT, MT = DS, GROUP = 16 * MT, KS = DIM / 16 / DS, ACC = 3 - DS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  constexpr int KW = BN / 2, NT = KW / 8;  // a warp's keys (one of two key halves) and their n8 tiles
  const int dh = DS == 2 ? warp & 1 : 0, kh = (warp / DS) & 1, rg = warp / (2 * DS), pair = rg * 2 + kh;
  ConsumerSmem& peer = reinterpret_cast<ConsumerSmem&>(sm);  // the same offsets, read as the consumer lays them out
  uint32_t qf[MT][KS][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      q_fragment(qf[mi][ks], q + (rg * GROUP + mi * 16 + g) * DIM + dh * (DIM / DS) + ks * 16 + 2 * tq);
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) m_run[mi][h] = -__int_as_float(0x7f800000), l_run[mi][h] = 0.f;
  int slot_next = ring_start<DIM, KSTRIDE>(sm.k, pool, slots, ntiles, true);
#pragma unroll 1
  for (int t = 0; t < ntiles; ++t) {
    const int s = t % STAGES;
    ring_step<DIM, KSTRIDE>(sm.k, pool, slots, ntiles, t, slot_next, true, [] {});
    float c[ACC][MT][2][4] = {};  // [..][ni]: NT of the 2 used
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t b[4];
      if (NT == 2) {
        vmla::ldmatrix_x4(b, &sm.k[s][kh * KW + (lane / 16) * 8 + lane % 8][dh * (DIM / DS) + ks * 16 + ((lane / 8) % 2) * 8]);
      } else {  // 8 keys: two k16 steps' fragments in one x4, the odd step's in b[2], b[3]
        if (ks % 2) continue;
        vmla::ldmatrix_x4(b, &sm.k[s][kh * KW + lane % 8][ks * 16 + (lane / 8) * 8]);
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        if (NT == 2) {
          vmla::mma_bf16(c[ks % ACC][mi][0], qf[mi][ks], b[0], b[1]);
          vmla::mma_bf16(c[ks % ACC][mi][1], qf[mi][ks], b[2], b[3]);
        } else {
          vmla::mma_bf16(c[0][mi][0], qf[mi][ks], b[0], b[1]);
          vmla::mma_bf16(c[1][mi][0], qf[mi][ks + 1], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int x = 1; x < ACC; ++x)
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) c[0][mi][ni][e] += c[x][mi][ni][e];
    float (&sc)[MT][2][4] = c[0];
    if (DS == 2) {
      if (dh == 1)
#pragma unroll
        for (int f = 0; f < 4; ++f)
          sm.partial[pair][lane][f] = make_float4(sc[f / 2][f % 2][0], sc[f / 2][f % 2][1], sc[f / 2][f % 2][2], sc[f / 2][f % 2][3]);
      __syncthreads();
      if (dh == 0)
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const float4 o = sm.partial[pair][lane][f];
          sc[f / 2][f % 2][0] += o.x, sc[f / 2][f % 2][1] += o.y, sc[f / 2][f % 2][2] += o.z, sc[f / 2][f % 2][3] += o.w;
        }
    }
    float tmax[MT][2];
    if (dh == 0) {
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x = fmaxf(sc[mi][0][2 * h], sc[mi][0][2 * h + 1]);
          if (NT == 2) x = fmaxf(x, fmaxf(sc[mi][1][2 * h], sc[mi][1][2 * h + 1]));
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
          tmax[mi][h] = x;
          if (tq == 0) sm.rowmax[kh][rg * GROUP + mi * 16 + h * 8 + g] = x;
        }
    }
    __syncthreads();
    if (dh == 0) {
      const int ps = t % PS;
      if (t >= PS && PROBE_ROLE_ONLY == 0) mbar_wait(&sm.p_empty[ps], (t / PS - 1) & 1);  // tile t - PS's P is free
      const uint32_t full = in_cta(&peer.p_full[ps], 1);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = rg * GROUP + mi * 16 + h * 8 + g;
          const float m_new = fmaxf(m_run[mi][h], fmaxf(tmax[mi][h], sm.rowmax[kh ^ 1][row]) * scale_log2);
          const float alpha = exp2f(m_run[mi][h] - m_new);
          float sum = 0.f;
#pragma unroll
          for (int ni = 0; ni < NT; ++ni) {
            const float p0 = exp2f(sc[mi][ni][2 * h] * scale_log2 - m_new);
            const float p1 = exp2f(sc[mi][ni][2 * h + 1] * scale_log2 - m_new);
            sum += p0 + p1;
            if (PROBE_ROLE_ONLY == 0) st_async(in_cta(&peer.p[ps][row][kh * KW + ni * 8 + 2 * tq], 1), pack_bf16(p0, p1), full);
          }
          l_run[mi][h] = l_run[mi][h] * alpha + sum;
          m_run[mi][h] = m_new;
          if (kh == 0 && tq == 0 && PROBE_ROLE_ONLY == 0) st_async(in_cta(&peer.alpha[ps][row], 1), __float_as_uint(alpha), full);
        }
    }
  }
  if (dh == 0)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x = l_run[mi][h];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        if (tq == 0) sm.rowsum[kh][rg * GROUP + mi * 16 + h * 8 + g] = x;
      }
  __syncthreads();
  if (threadIdx.x < ROWS && PROBE_ROLE_ONLY == 0) {
    const int row = threadIdx.x;
    st_async(in_cta(&peer.l[row], 1), __float_as_uint(sm.rowsum[0][row] + sm.rowsum[1][row]), in_cta(&peer.fin, 1));
  }
}

// PROBE_PINGPONG: two groups of 4 warps, group g scoring tiles t = g mod 2 from stage g, each warp 16 rows x all 32
// keys x all 576 dims (no partial scores, no row maxima across warps). A group's QK runs while the other one's
// softmax does; the softmax itself is a chain (tile t needs tile t - 1's running max and sum), handed from group
// to group through shared memory and a named barrier (ids 1 + group; the groups' own barriers are 3 + group).
__device__ void producer_pingpong(ProducerSmem& sm, const __nv_bfloat16* q, const __nv_bfloat16* pool,
                                  const int* slots, int ntiles, float scale_log2) {
  static_assert(!PROBE_PINGPONG || (BN == 32 && STAGES == 2), "a group a stage of 32 keys");
  constexpr int KS = DIM / 16, GT = 128;  // k16 steps; a group's threads
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int grp = warp / 4, rw = warp % 4, gtid = threadIdx.x % GT;
  ConsumerSmem& peer = reinterpret_cast<ConsumerSmem&>(sm);
  uint32_t qf[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) q_fragment(qf[ks], q + (rw * 16 + g) * DIM + ks * 16 + 2 * tq);
  auto gather = [&](int slot) { gather_rows<DIM, KSTRIDE, GT>(sm.k[grp], pool, slot, gtid); };  // the group's stage
  auto slot = [&](int t) { return slot_of<GT>(slots, t, ntiles, gtid); };
  auto group_sync = [&]() { asm volatile("bar.sync %0, %1;" ::"r"(3 + grp), "n"(GT) : "memory"); };
  if (grp < ntiles) gather(slot(grp));
  vmla::cp_async_commit();
  int slot_next = slot(grp + 2);
  if (threadIdx.x < ROWS) sm.state_m[threadIdx.x] = -__int_as_float(0x7f800000), sm.state_l[threadIdx.x] = 0.f;
  __syncthreads();
#pragma unroll 1
  for (int t = grp; t < ntiles; t += 2) {
    const int s = grp;
    vmla::cp_async_wait_all();
    group_sync();  // tile t landed in the group's stage
    float c[2][4][4] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        vmla::ldmatrix_x4(b, &sm.k[s][np * 16 + (lane / 16) * 8 + lane % 8][ks * 16 + ((lane / 8) % 2) * 8]);
        vmla::mma_bf16(c[ks % 2][2 * np], qf[ks], b[0], b[1]);
        vmla::mma_bf16(c[ks % 2][2 * np + 1], qf[ks], b[2], b[3]);
      }
    const int ps = t % PS;
    if (t >= PS && PROBE_ROLE_ONLY == 0) mbar_wait(&sm.p_empty[ps], (t / PS - 1) & 1);
    const uint32_t full = in_cta(&peer.p_full[ps], 1);
    if (PROBE_FWD_V) {  // this tile's V into the consumer's stage s, 16 B at a time, before the stage is refilled
#pragma unroll 4
      for (int i = gtid; i < BN * VDIM / 8; i += GT) {
        const int r = i / (VDIM / 8), c = i % (VDIM / 8);
        const uint4 v = *reinterpret_cast<const uint4*>(&sm.k[s][r][c * 8]);
        if (PROBE_ROLE_ONLY == 0) st_async_v4(in_cta(&peer.v[s][r][c * 8], 1), v, full);
      }
    }
    group_sync();  // the group is done reading its stage: the tile two ahead goes into it
    if (t + 2 < ntiles) gather(slot_next);
    vmla::cp_async_commit();
    slot_next = slot(t + 4);
    if (t > 0) asm volatile("bar.sync %0, %1;" ::"r"(1 + (grp ^ 1)), "n"(THREADS) : "memory");  // tile t-1's state
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rw * 16 + h * 8 + g;
      float x = -__int_as_float(0x7f800000);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        c[0][ni][2 * h] += c[1][ni][2 * h], c[0][ni][2 * h + 1] += c[1][ni][2 * h + 1];
        x = fmaxf(x, fmaxf(c[0][ni][2 * h], c[0][ni][2 * h + 1]));
      }
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
      const float m_prev = sm.state_m[row], m_new = fmaxf(m_prev, x * scale_log2), alpha = exp2f(m_prev - m_new);
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const float p0 = exp2f(c[0][ni][2 * h] * scale_log2 - m_new), p1 = exp2f(c[0][ni][2 * h + 1] * scale_log2 - m_new);
        sum += p0 + p1;
        if (PROBE_ROLE_ONLY == 0) st_async(in_cta(&peer.p[ps][row][ni * 8 + 2 * tq], 1), pack_bf16(p0, p1), full);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float l_new = sm.state_l[row] * alpha + sum;
      __syncwarp();  // every lane of the row has read the state before one writes it
      if (tq == 0) {
        sm.state_m[row] = m_new, sm.state_l[row] = l_new;
        if (PROBE_ROLE_ONLY == 0) st_async(in_cta(&peer.alpha[ps][row], 1), __float_as_uint(alpha), full);
      }
    }
    if (t + 1 < ntiles) asm volatile("bar.arrive %0, %1;" ::"r"(1 + grp), "n"(THREADS) : "memory");  // hand it on
  }
  __syncthreads();
  if (threadIdx.x < ROWS && PROBE_ROLE_ONLY == 0)
    st_async(in_cta(&peer.l[threadIdx.x], 1), __float_as_uint(sm.state_l[threadIdx.x]), in_cta(&peer.fin, 1));
}

__device__ void consumer(ConsumerSmem& sm, const __nv_bfloat16* pool, const int* slots, int ntiles, float* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, col0 = warp * 64;
  ProducerSmem& peer = reinterpret_cast<ProducerSmem&>(sm);
  float acc[4][8][4] = {};
  int slot_next = ring_start<VDIM, VSTRIDE>(sm.v, pool, slots, ntiles, !PROBE_FWD_V);
#pragma unroll 1
  for (int t = 0; t < ntiles; ++t) {
    const int s = t % STAGES;
    ring_step<VDIM, VSTRIDE>(sm.v, pool, slots, ntiles, t, slot_next, !PROBE_FWD_V, [&] {
      if (threadIdx.x == 0 && PROBE_ROLE_ONLY == 0) {  // every thread is done with tile t - 1's P
        if (t > 0) mbar_arrive_cluster(in_cta(&peer.p_empty[(t - 1) % PS], 0));
        mbar_expect_tx(&sm.p_full[t % PS], P_TX);
      }
    });
    const int ps = t % PS;
    if (PROBE_ROLE_ONLY == 0) mbar_wait(&sm.p_full[ps], (t / PS) & 1);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const float a0 = sm.alpha[ps][mi * 16 + g], a1 = sm.alpha[ps][mi * 16 + g + 8];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) acc[mi][ni][0] *= a0, acc[mi][ni][1] *= a0, acc[mi][ni][2] *= a1, acc[mi][ni][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) vmla::ldmatrix_x4(pa[mi], &sm.p[ps][mi * 16 + lane % 16][kk * 16 + (lane / 16) * 8]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t vb[4];
        vmla::ldmatrix_x4_trans(vb, &sm.v[s][kk * 16 + lane % 8 + ((lane / 8) % 2) * 8][col0 + np * 16 + (lane / 16) * 8]);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          vmla::mma_bf16(acc[mi][2 * np], pa[mi], vb[0], vb[1]);
          vmla::mma_bf16(acc[mi][2 * np + 1], pa[mi], vb[2], vb[3]);
        }
      }
    }
  }
  if (threadIdx.x == 0 && PROBE_ROLE_ONLY == 0) mbar_expect_tx(&sm.fin, ROWS * 4);
  if (PROBE_ROLE_ONLY == 0) mbar_wait(&sm.fin, 0);
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    const float inv0 = 1.f / sm.l[mi * 16 + g], inv1 = 1.f / sm.l[mi * 16 + g + 8];
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
      float* o = out + (mi * 16 + g) * VDIM + col0 + ni * 8 + 2 * tq;
      *reinterpret_cast<float2*>(o) = make_float2(acc[mi][ni][0] * inv0, acc[mi][ni][1] * inv0);
      *reinterpret_cast<float2*>(o + 8 * VDIM) = make_float2(acc[mi][ni][2] * inv1, acc[mi][ni][3] * inv1);
    }
  }
}
}  // namespace

// One 64-row tile a cluster: q [clusters][64][576], slots [clusters][nkeys], out [clusters][64][512] (fp32).
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS)
    pair_verify(const __nv_bfloat16* q, const __nv_bfloat16* pool, const int* slots, int nkeys, float scale_log2,
                float* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int cluster = blockIdx.x / 2, ntiles = nkeys / BN;
  const uint32_t rank = cluster_rank();
  if (threadIdx.x == 0) {
    if (rank == 0) {
      auto& sm = *reinterpret_cast<ProducerSmem*>(smem);
      for (int s = 0; s < PS; ++s) mbar_init(&sm.p_empty[s], 1);
    } else {
      auto& sm = *reinterpret_cast<ConsumerSmem*>(smem);
      for (int s = 0; s < PS; ++s) mbar_init(&sm.p_full[s], 1);
      mbar_init(&sm.fin, 1);
    }
    vmla::mbar_fence_init();
  }
  cluster_sync();
  slots += static_cast<int64_t>(cluster) * nkeys;
  if (rank == 0 && PROBE_ROLE_ONLY != 2) {
    auto& sm = *reinterpret_cast<ProducerSmem*>(smem);
    const __nv_bfloat16* tile_q = q + static_cast<int64_t>(cluster) * ROWS * DIM;
    if (PROBE_PINGPONG) producer_pingpong(sm, tile_q, pool, slots, ntiles, scale_log2);
    else producer(sm, tile_q, pool, slots, ntiles, scale_log2);
  }
  else if (rank == 1 && PROBE_ROLE_ONLY != 1)
    consumer(*reinterpret_cast<ConsumerSmem*>(smem), pool, slots, ntiles, out + static_cast<int64_t>(cluster) * ROWS * VDIM);
  cluster_sync();  // nothing arrives on, or is stored into, a CTA that has exited
}

extern "C" __global__ void pair_verify_smem_bytes(int* out) { *out = SMEM; }
