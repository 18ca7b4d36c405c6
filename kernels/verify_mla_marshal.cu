// SGLang's TARGET_VERIFY metadata -> the verify kernel's arguments, on the GPU, once per step: what
// kdtree/marshal.py does (and kdtree/device_marshal.py in torch ops), as one launch whose grid depends only on
// the batch size, so it can be recorded in a CUDA graph and replayed with other prefix lengths.
//
// Block (b, y) of request b: the combined slot list kv_indices[kv_indptr[b] ..] ++ out_cache_loc[qo_indptr[b] ..]
// at combined_indptr[b] = kv_indptr[b] + qo_indptr[b], and the draft block of custom_mask (row stride
// prefix_len + N) packed to bits: word w of node i's row holds bit j % 32 for draft node j = 32 w + (bit).
// custom_mask null: the drafts form a causal chain.


template <typename Index>
__device__ __forceinline__ void marshal_request(const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,
                                                const Index* __restrict__ kv_indices,
                                                const long long* __restrict__ out_cache_loc,
                                                const unsigned char* __restrict__ custom_mask,
                                                const long long* __restrict__ mask_indptr, int mask_words,
                                                int* __restrict__ combined_indptr, int* __restrict__ combined,
                                                int* __restrict__ prefix_lens, int* __restrict__ tree_mask, int bs) {
  const int b = blockIdx.x;
  const int p0 = kv_indptr[b], p = kv_indptr[b + 1] - p0;
  const int q0 = qo_indptr[b], n = qo_indptr[b + 1] - q0;
  const int dst0 = p0 + q0;
  const int stride = gridDim.y * blockDim.x;
  const int first = blockIdx.y * blockDim.x + threadIdx.x;
  if (first == 0) {
    combined_indptr[b] = dst0;
    prefix_lens[b] = p;
    if (b == bs - 1) combined_indptr[bs] = kv_indptr[bs] + qo_indptr[bs];
  }
  for (int j = first; j < p + n; j += stride)
    combined[dst0 + j] = j < p ? static_cast<int>(kv_indices[p0 + j]) : static_cast<int>(out_cache_loc[q0 + j - p]);
  for (int k = first; k < n * mask_words; k += stride) {  // (node i, word w)
    const int i = k / mask_words, w = k % mask_words;
    unsigned word = 0;
    const long long row = custom_mask != nullptr ? mask_indptr[b] + static_cast<long long>(i) * (p + n) + p : 0;
    for (int bit = 0; bit < 32; ++bit) {
      const int j = w * 32 + bit;
      if (j >= n) break;
      const bool seen = custom_mask != nullptr ? custom_mask[row + j] != 0 : j <= i;
      word |= static_cast<unsigned>(seen) << bit;
    }
    tree_mask[static_cast<long long>(q0 + i) * mask_words + w] = static_cast<int>(word);
  }
}

#define VMLA_MARSHAL_KERNEL(NAME, INDEX)                                                                          \
  extern "C" __global__ void NAME(const int* qo_indptr, const int* kv_indptr, const INDEX* kv_indices,           \
                                  const long long* out_cache_loc, const unsigned char* custom_mask,               \
                                  const long long* mask_indptr, int mask_words, int* combined_indptr, int* combined, \
                                  int* prefix_lens, int* tree_mask, int bs) {                                    \
    marshal_request<INDEX>(qo_indptr, kv_indptr, kv_indices, out_cache_loc, custom_mask, mask_indptr, mask_words, \
                           combined_indptr, combined, prefix_lens, tree_mask, bs);                               \
  }
VMLA_MARSHAL_KERNEL(verify_mla_marshal_i64, long long)
VMLA_MARSHAL_KERNEL(verify_mla_marshal_i32, int)
