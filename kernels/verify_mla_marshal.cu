// SGLang's TARGET_VERIFY metadata -> the verify kernel's arguments, on the GPU, once per step: what
// kdtree/marshal.py does (and kdtree/device_marshal.py in torch ops), as one launch whose grid depends only on
// the batch size, so it can be recorded in a CUDA graph and replayed with other prefix lengths.
//
// Block (b, y) of request b writes the combined slot list (prefix slots ++ the drafts' out_cache_loc) at
// combined_indptr[b] = prefix slots before b + drafts before b, and the draft block of custom_mask (row stride
// prefix_len + N) packed to bits: word w of node i's row holds bit j % 32 for draft node j = 32 w + (bit).
// custom_mask null: the drafts form a causal chain. Two sources of the prefix slots:
// - verify_mla_marshal_{i64,i32}: the Triton backend's CSR metadata (qo_indptr, kv_indptr, kv_indices,
//   mask_indptr);
// - verify_mla_marshal_table_{i32,i64}: SGLang's own page table, req_to_token[req_pool_indices[b], :seq_lens[b]]
//   (the untranslated read stream), with qo_indptr = b * N and mask_indptr = the sum of N (seq_lens + N) before
//   b computed here: no Triton metadata at all. Mask reads stay inside its mask_len cells (the last cell
//   repeats, as kdtree/device_marshal.py clamps): a padded scratch row may lie past the real rows' mask.

struct Request {
  int p;            // prefix length
  int p0, q0;       // prefix slots and draft tokens before this request
  long long mask0;  // custom_mask offset of this request's first row
};

template <typename Source>
__device__ __forceinline__ void marshal_request(const Request& r, int n, const Source& prefix_slot,
                                                const long long* __restrict__ out_cache_loc,
                                                const unsigned char* __restrict__ custom_mask, long long mask_len,
                                                int mask_words, int* __restrict__ combined,
                                                int* __restrict__ tree_mask) {
  const int dst0 = r.p0 + r.q0, p = r.p;
  const int stride = gridDim.y * blockDim.x;
  const int first = blockIdx.y * blockDim.x + threadIdx.x;
  for (int j = first; j < p + n; j += stride)
    combined[dst0 + j] = j < p ? prefix_slot(j) : static_cast<int>(out_cache_loc[r.q0 + j - p]);
  for (int k = first; k < n * mask_words; k += stride) {  // (node i, word w)
    const int i = k / mask_words, w = k % mask_words;
    unsigned word = 0;
    const long long row = custom_mask != nullptr ? r.mask0 + static_cast<long long>(i) * (p + n) + p : 0;
    for (int bit = 0; bit < 32; ++bit) {
      const int j = w * 32 + bit;
      if (j >= n) break;
      const bool seen = custom_mask != nullptr ? custom_mask[min(row + j, mask_len - 1)] != 0 : j <= i;
      word |= static_cast<unsigned>(seen) << bit;
    }
    tree_mask[static_cast<long long>(r.q0 + i) * mask_words + w] = static_cast<int>(word);
  }
}

template <typename Index>
struct CsrSlots {
  const Index* kv_indices;
  int p0;
  __device__ int operator()(int j) const { return static_cast<int>(kv_indices[p0 + j]); }
};

template <typename Index>
struct TableSlots {
  const Index* row;
  __device__ int operator()(int j) const { return static_cast<int>(row[j]); }
};

#define VMLA_MARSHAL_KERNEL(NAME, INDEX)                                                                             \
  extern "C" __global__ void NAME(const int* qo_indptr, const int* kv_indptr, const INDEX* kv_indices,               \
                                  const long long* out_cache_loc, const unsigned char* custom_mask,                  \
                                  const long long* mask_indptr, int mask_words, int* combined_indptr, int* combined, \
                                  int* prefix_lens, int* tree_mask, int bs) {                                        \
    const int b = blockIdx.x;                                                                                        \
    const Request r{kv_indptr[b + 1] - kv_indptr[b], kv_indptr[b], qo_indptr[b],                                     \
                    custom_mask != nullptr ? mask_indptr[b] : 0};                                                    \
    if (blockIdx.y == 0 && threadIdx.x == 0) {                                                                       \
      combined_indptr[b] = r.p0 + r.q0;                                                                              \
      prefix_lens[b] = r.p;                                                                                          \
      if (b == bs - 1) combined_indptr[bs] = kv_indptr[bs] + qo_indptr[bs];                                          \
    }                                                                                                                \
    marshal_request(r, qo_indptr[b + 1] - r.q0, CsrSlots<INDEX>{kv_indices, r.p0}, out_cache_loc, custom_mask,       \
                    0x7fffffffffffffffLL, mask_words, combined, tree_mask);                                          \
  }
VMLA_MARSHAL_KERNEL(verify_mla_marshal_i64, long long)
VMLA_MARSHAL_KERNEL(verify_mla_marshal_i32, int)

// The prefix slots before request b (and so its mask offset): each block sums seq_lens[0 .. b) itself.
__device__ __forceinline__ long long prefix_before(const long long* __restrict__ seq_lens, int b) {
  __shared__ long long partial[32];
  long long s = 0;
  for (int j = threadIdx.x; j < b; j += blockDim.x) s += seq_lens[j];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += partial[w];
  return total;
}

#define VMLA_MARSHAL_TABLE_KERNEL(NAME, INDEX)                                                                       \
  extern "C" __global__ void NAME(                                                                                   \
      const INDEX* req_to_token, long long row_stride, const long long* req_pool_indices, const long long* seq_lens, \
      const long long* out_cache_loc, const unsigned char* custom_mask, long long mask_len, int n, int mask_words,   \
      int* qo_indptr, int* combined_indptr, int* combined, int* prefix_lens, int* tree_mask, int bs) {               \
    const int b = blockIdx.x;                                                                                        \
    const long long before = prefix_before(seq_lens, b);                                                             \
    const Request r{static_cast<int>(seq_lens[b]), static_cast<int>(before), b * n,                                  \
                    static_cast<long long>(n) * (before + static_cast<long long>(b) * n)};                           \
    if (blockIdx.y == 0 && threadIdx.x == 0) {                                                                       \
      qo_indptr[b] = r.q0;                                                                                           \
      combined_indptr[b] = r.p0 + r.q0;                                                                              \
      prefix_lens[b] = r.p;                                                                                          \
      if (b == bs - 1) {                                                                                             \
        qo_indptr[bs] = bs * n;                                                                                      \
        combined_indptr[bs] = r.p0 + r.p + bs * n;                                                                   \
      }                                                                                                              \
    }                                                                                                                \
    marshal_request(r, n, TableSlots<INDEX>{req_to_token + req_pool_indices[b] * row_stride}, out_cache_loc,         \
                    custom_mask, mask_len, mask_words, combined, tree_mask);                                         \
  }
VMLA_MARSHAL_TABLE_KERNEL(verify_mla_marshal_table_i32, int)
VMLA_MARSHAL_TABLE_KERNEL(verify_mla_marshal_table_i64, long long)
