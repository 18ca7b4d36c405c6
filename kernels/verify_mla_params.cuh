// The host-device contract of verify_mla_fwd and verify_mla_merge: each kernel's parameter list, written once.
//
// VMLA_FWD_PARAMS and VMLA_MERGE_PARAMS list (kind, type, name) in parameter order; a pointer's type is its pointee.
// Expanded with VMLA_KERNEL_PARAM they are the kernels' signatures (every pointer __restrict__, as before the lists:
// the parameter bytes and the code are those of the hand-written lists); expanded with VMLA_STRUCT_MEMBER they are
// vmla::FwdParams and vmla::MergeParams, whose layout is the kernels' parameter buffer (each member at its natural
// alignment, in order, as the CUDA ABI places kernel parameters). kdtree/kernel/launch.py fills a ctypes mirror of
// each struct in one place (`fwd_params`, `merge_params`) and launches with its members in order;
// tests/test_params.py compiles static_asserts that the mirrors' sizes and offsets are these structs'.
//
// Why not the struct itself by value: NVRTC keeps __restrict__ only on a kernel's own pointer parameters, not on a
// struct's members, so the read-only arrays' loads lose their non-coherent (LDG.CONSTANT) form and the code changes.
#pragma once

#include <cuda_bf16.h>

// (one parameter a line, its shape beside it: kept out of clang-format)
// clang-format off
#define VMLA_FWD_PARAMS(PTR, VAL, SEP)                                                                              \
  PTR(const __nv_bfloat16, q) SEP          /* [T * H, 576] */                                                       \
  PTR(const __nv_bfloat16, kv_buffer) SEP  /* [pool rows, 576] */                                                   \
  PTR(const int, qo_indptr) SEP            /* [bs + 1] */                                                           \
  PTR(const int, kv_indptr) SEP            /* [bs + 1]  combined: prefix_len + N */                                 \
  PTR(const int, kv_indices) SEP           /* combined slot lists */                                                \
  PTR(const int, prefix_lens) SEP          /* [bs] */                                                               \
  PTR(const int, tree_mask) SEP            /* [T, mask_words] */                                                    \
  VAL(int, mask_words) SEP                                                                                          \
  VAL(int, num_heads) SEP                                                                                           \
  VAL(float, sm_scale) SEP                                                                                          \
  VAL(float, logit_cap) SEP                                                                                         \
  PTR(__nv_bfloat16, o) SEP                /* [T * H, 512] */                                                       \
  PTR(float, lse) SEP                      /* [T * H] or null */                                                    \
  PTR(const int, cta_unit_start) SEP       /* [grid + 1] */                                                         \
  PTR(const int, cta_first_rt) SEP         /* [grid] */                                                             \
  PTR(const int, rt_unit_start) SEP        /* [row tiles + 1] */                                                    \
  PTR(const int, rt_request) SEP           /* [row tiles] */                                                        \
  PTR(const int, rt_row0) SEP              /* [row tiles] first row within its request */                           \
  PTR(const int, rt_first_cta) SEP         /* [row tiles] block holding the tile's first unit */                    \
  PTR(const int, rt_seg_base) SEP          /* [row tiles + 1] partial slots of each tile */                         \
  PTR(float, part_o) SEP                   /* [segments, BM, 512] */                                                \
  PTR(float, part_lse) SEP                 /* [segments, BM] */                                                     \
  PTR(int, rt_counter)                     /* [row tiles] zeros, or null: no fused merge */

#define VMLA_MERGE_PARAMS(PTR, VAL, SEP)                                                                            \
  PTR(const int2, row_merge) SEP  /* [rows] (first slot * BM + row in tile, partials), from the plan */             \
  PTR(const float, part_o) SEP    /* [segments, BM, 512] */                                                         \
  PTR(const float, part_lse) SEP  /* [segments, BM] */                                                              \
  PTR(__nv_bfloat16, o) SEP       /* [T * H, 512] */                                                                \
  PTR(float, lse)                 /* [T * H] or null */
// clang-format on

#define VMLA_KERNEL_PTR(type, name) type* __restrict__ name
#define VMLA_KERNEL_VAL(type, name) type name
#define VMLA_COMMA ,
#define VMLA_SEMICOLON ;
// A kernel's parameter list: verify_mla_fwd(VMLA_KERNEL_PARAMS(VMLA_FWD_PARAMS))
#define VMLA_KERNEL_PARAMS(LIST) LIST(VMLA_KERNEL_PTR, VMLA_KERNEL_VAL, VMLA_COMMA)

#define VMLA_MEMBER_PTR(type, name) type* name
#define VMLA_MEMBER_VAL(type, name) type name

namespace vmla {
struct FwdParams {
  VMLA_FWD_PARAMS(VMLA_MEMBER_PTR, VMLA_MEMBER_VAL, VMLA_SEMICOLON);
};
struct MergeParams {
  VMLA_MERGE_PARAMS(VMLA_MEMBER_PTR, VMLA_MEMBER_VAL, VMLA_SEMICOLON);
};
}  // namespace vmla
