// Shared pieces of the decode (split-KV) kernels: the split scheduler and the LSE merge
// (flashgen/families/decode.py).  __host__ __device__ where the host tests run them
// (tests/unit/test_decode_host.py builds this file with the host compiler).
#ifndef FG_DECODE_CUH
#define FG_DECODE_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {
namespace dec {

// Key blocks [begin, end) of split `split` of the live blocks [n_lo, n_hi): ceil(count / splits) per
// split, in order; trailing splits may be empty (begin == end).  Depends on the request's own blocks
// and the split count only: batch-invariant.  Same arithmetic as flashgen.families.decode.split_range.
struct Range { int begin, end; };
__host__ __device__ __forceinline__ Range split_range(int n_lo, int n_hi, int num_splits, int split) {
    const int hi = n_hi > n_lo ? n_hi : n_lo;
    const int cnt = hi - n_lo;
    const int per = (cnt + num_splits - 1) / num_splits;
    int begin = n_lo + split * per;
    begin = begin < hi ? begin : hi;
    const int end = begin + per < hi ? begin + per : hi;
    return {begin, end};
}

// Exact merge of n partial results by their log-sum-exps (natural log), FlashAttention's
// flash_fwd_combine: m = max lse_i, lse = m + log(sum exp(lse_i - m)); the weight of partial i is
// exp(lse_i - lse).  All -inf (no key anywhere): lse = -inf, every weight 0.  Fixed order.
__host__ __device__ __forceinline__ float merged_lse(const float* lse, int n, long long stride) {
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) m = fmaxf(m, lse[i * stride]);
    if (m == -INFINITY) return -INFINITY;
    float sum = 0.f;
    for (int i = 0; i < n; ++i) sum += expf(lse[i * stride] - m);
    return m + logf(sum);
}
__host__ __device__ __forceinline__ float merge_weight(float lse_i, float lse) {
    return lse == -INFINITY ? 0.f : expf(lse_i - lse);
}

}  // namespace dec
}  // namespace fg

#ifdef __CUDACC__
namespace fg {
namespace dec {
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
}  // namespace dec
}  // namespace fg
#endif
#endif
