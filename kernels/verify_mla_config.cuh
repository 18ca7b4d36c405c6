// Tile configuration of verify_mla.cu. Each can be overridden with -DNAME=value (kdtree.kernel passes
// `defines`); the static_asserts in the body headers (verify_mla_body_*.cuh, verify_mla_wgmma_common.cuh) say which
// combinations are valid.
#pragma once

#ifndef VMLA_DIM
#define VMLA_DIM 576  // kv_lora_rank 512 + qk_rope_head_dim 64
#endif
#ifndef VMLA_VDIM
#define VMLA_VDIM 512  // V = first 512 columns of the pool row
#endif
#ifndef VMLA_BM
#define VMLA_BM 32  // query rows (node, head) per block
#endif
#ifndef VMLA_BN
#define VMLA_BN 32  // keys per pipeline stage
#endif
#ifndef VMLA_STAGES
#define VMLA_STAGES 2  // cp.async stages of BN pool rows
#endif
#ifndef VMLA_WARPS
#define VMLA_WARPS 8
#endif
#ifndef VMLA_DSLICES
#define VMLA_DSLICES 4  // QK: the 576 dims split across warps ...
#endif
#ifndef VMLA_RGROUPS
#define VMLA_RGROUPS 1  // ... the BM rows in groups ...
#endif
#ifndef VMLA_KHALVES
#define VMLA_KHALVES 2  // ... and the BN keys in parts (DSLICES x RGROUPS x KHALVES = WARPS)
#endif
#ifndef VMLA_WGMMA
#define VMLA_WGMMA 0  // 1: the Hopper warpgroup-MMA segment (verify_mla_body_*.cuh; sm_90a only, BM 64)
#endif
#ifndef VMLA_WG_PIPE
#define VMLA_WG_PIPE 0  // wgmma body: 1 = QK of tile t and P V of tile t-1 in flight together (3 stages)
#endif
#ifndef VMLA_SPLIT_KEYS
// wgmma body: 1 = split_keys, each warpgroup scores its own 32-key tile of a 64-key step over all 576 dims (no partial
// scores to exchange; 4 stages); 0 = dims_split, both split one tile's dims
#define VMLA_SPLIT_KEYS 0
#endif
#ifndef VMLA_BLOCKS64
// split_keys layout: 1 = blocks64, FlashMLA's schedule on 64-key blocks (verify_segment_blocks64)
#define VMLA_BLOCKS64 0
#endif
#ifndef VMLA_KPASSES
#define VMLA_KPASSES 1  // QK of a warp's keys in this many passes (fewer live score registers)
#endif
#ifndef VMLA_PV_GROUP
#define VMLA_PV_GROUP 8  // P.V: the n8 tiles of output columns taken per pass over the keys (bounds live V fragments)
#endif
#ifndef VMLA_BLOCKS_PER_SM
#define VMLA_BLOCKS_PER_SM 1  // resident blocks per SM the persistent grid counts on (__launch_bounds__)
#endif
#ifndef VMLA_Q_SMEM
#define VMLA_Q_SMEM 0  // 0: Q fragments live in registers (BM 32); 1: Q stays in shared memory (BM 64, big smem)
#endif

#ifndef VMLA_S_PAD
#define VMLA_S_PAD 8  // fp32 padding of a partial-score row (8: conflict-free fragment stores at BN 16 and 32)
#endif

#ifndef VMLA_FAST_MASK
// the softmax step's tree mask as one bit word per thread (<= 2 mask loads, no branches per key): -4 to -6 % on the
// H200, same bits (0: the mask read key by key)
#define VMLA_FAST_MASK 1
#endif
#ifndef VMLA_FEW_ROWS
// wgmma body: row tiles of at most this many rows (<= 16) run the mma.sync few-row segment (verify_segment_few) instead
// of a 64-row wgmma tile; 0: none
#define VMLA_FEW_ROWS 0
#endif
#ifndef VMLA_LAST_SEGMENT_FIRST
// a block runs its last segment (the head of a row tile, from key 0) first, then the others in order, so a request's
// blocks read its keys together and they stay in L2 (0: in unit order); same bits
#define VMLA_LAST_SEGMENT_FIRST 1
#endif
#ifndef VMLA_FUSED_MERGE_SEGS
#define VMLA_FUSED_MERGE_SEGS 4  // split row tiles of at most this many partials may be merged by their last block
#endif
