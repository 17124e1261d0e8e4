// The helpers of the exact softmax (flashgen.options.Options.exact_softmax), rendered only into the units planned
// with it: the backwards' capped exponent and decode's normalized split merge.  __host__ __device__: the host test
// of the merge (tests/unit/test_decode_compile.py) builds this file with decode.cuh.
#ifndef FG_EXACT_SOFTMAX_CUH
#define FG_EXACT_SOFTMAX_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {

// The exponent of a backward's P = exp2(x - lse): at most 0 (P <= 1), NaN kept.  x - lse <= 0 in exact arithmetic,
// but lse's round trip through the natural log (and a contracted FFMA) leave a residual of a few ulps of lse, 2^14
// and more at logits near 1e11, whose exp2 overflowed P to inf (dS NaN).
__host__ __device__ __forceinline__ float capped_exponent(float d) { return d > 0.f ? 0.f : d; }

namespace dec {

// The split merge normalized by its own sum: m = max lse_i, sum = sum exp(lse_i - m), lse = m + log(sum), and the
// weight of partial i is exp(lse_i - m) / sum (normalized_weight), not exp(lse_i - lse) (merge_weight in
// decode.cuh): at huge lse (logits near 1e11, an ulp of 2^14) log(sum) is lost in lse's rounding, and two equal
// splits then weighed 1 each (o doubled).  All -inf (no key anywhere): lse = -inf, every weight 0.  A NaN partial
// makes lse, every weight and o NaN, as merged_lse does.  Fixed order.
struct Merged { float m, sum, lse; };
__host__ __device__ __forceinline__ Merged merge_stats(const float* lse, int n, long long stride) {
    float m = -INFINITY;
    bool nan = false;
    for (int i = 0; i < n; ++i) {
        const float x = lse[i * stride];
        nan = nan || x != x;
        m = fmaxf(m, x);
    }
    if (nan) return {NAN, NAN, NAN};
    if (m == -INFINITY) return {-INFINITY, 0.f, -INFINITY};
    float sum = 0.f;
    for (int i = 0; i < n; ++i) sum += expf(lse[i * stride] - m);
    return {m, sum, m + logf(sum)};
}
__host__ __device__ __forceinline__ float normalized_weight(float lse_i, const Merged& s) {
    return s.lse == -INFINITY ? 0.f : expf(lse_i - s.m) / s.sum;
}

}  // namespace dec
}  // namespace fg
#endif
