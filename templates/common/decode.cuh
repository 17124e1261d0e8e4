// Shared pieces of the decode (split-KV) kernels: the split scheduler and the LSE merge
// (flashgen/families/decode.py).  __host__ __device__ where the host tests run them
// (tests/unit/test_decode_compile.py builds this file with the host compiler).
#ifndef FG_DECODE_CUH
#define FG_DECODE_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {
namespace dec {

// Minimum key blocks per split: a request with cnt live blocks uses min(num_splits, cnt / this) splits
// (at least 1), so a short request or a sliding window launches no empty splits' work and merges few
// partials.  Same constant as flashgen.families.decode.MIN_SPLIT_BLOCKS.
constexpr int MIN_SPLIT_BLOCKS = 2;
// A unit may pass its own minimum (flashgen.families.decode.Options.min_split_blocks).
__host__ __device__ __forceinline__ int effective_splits(int n_lo, int n_hi, int num_splits,
                                                         int min_blocks = MIN_SPLIT_BLOCKS) {
    const int cnt = n_hi > n_lo ? n_hi - n_lo : 0;
    const int e = cnt / min_blocks < num_splits ? cnt / min_blocks : num_splits;
    return e > 1 ? e : 1;
}

// Key blocks [begin, end) of split `split` of the live blocks [n_lo, n_hi), balanced: split s gets
// [n_lo + cnt * s / n, n_lo + cnt * (s + 1) / n), sizes differing by at most one block (no short tail
// split).  n = effective_splits: every split of a request with cnt >= n has a block.  Depends on the
// request's own blocks and the split count only: batch-invariant.  Same arithmetic as
// flashgen.families.decode.split_range.
struct Range { int begin, end; };
__host__ __device__ __forceinline__ Range split_range(int n_lo, int n_hi, int num_splits, int split) {
    const int cnt = n_hi > n_lo ? n_hi - n_lo : 0;
    const long long c = cnt;
    return {n_lo + (int)(c * split / num_splits), n_lo + (int)(c * (split + 1) / num_splits)};
}

// Exact merge of n partial results by their log-sum-exps (natural log), FlashAttention's
// flash_fwd_combine: m = max lse_i, lse = m + log(sum exp(lse_i - m)); the weight of partial i is
// exp(lse_i - lse).  All -inf (no key anywhere): lse = -inf, every weight 0.  A NaN partial (a NaN
// key or value in its live range) makes lse NaN and so every weight and o NaN, as one split would:
// fmaxf alone drops NaN, which once turned a NaN split into an empty one (o = 0, lse = -inf) and
// made the result depend on num_splits.  Fixed order.
__host__ __device__ __forceinline__ float merged_lse(const float* lse, int n, long long stride) {
    float m = -INFINITY;
    bool nan = false;
    for (int i = 0; i < n; ++i) {
        const float x = lse[i * stride];
        nan = nan || x != x;
        m = fmaxf(m, x);
    }
    if (nan) return NAN;
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
