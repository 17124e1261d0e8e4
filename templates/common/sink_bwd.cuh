// The attention sink in the backward's pre kernel (the fused-sink forward, Options.fa2_fwd / hopper_fwd.fused_sink;
// flashgen/ops/sink.py has the math).  The forward's O is o_keys * sigmoid(lse - sink), lse the keys' alone; the
// backward rebuilds P against the sink-inclusive normaliser and gives the sink's gradient row by row.
// __host__ __device__: the host tests run it (tests/unit/test_prefill_sink_bwd.py).
#ifndef FG_SINK_BWD_CUH
#define FG_SINK_BWD_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {

// The row's lse with the sink joined, logaddexp(lse, sink) (natural log): the sink where the row has no key (lse =
// -inf), -inf when neither exists, +inf if either is; a NaN in either gives NaN.
__host__ __device__ __forceinline__ float sink_lse(float lse, float sink) {
    if (lse != lse || sink != sink) return lse + sink;
    const float m = fmaxf(lse, sink);
    return isinf(m) ? m : m + log1pf(expf(-fabsf(lse - sink)));
}

// The row's term of d sink, -sigmoid(sink - lse) * d with d = rowsum(dO * O): 0 for a row with no key (lse = -inf:
// o = 0, no share of the sink to differentiate).
__host__ __device__ __forceinline__ float sink_row_grad(float lse, float sink, float d) {
    return lse == -INFINITY ? 0.f : -d / (1.f + expf(lse - sink));
}

}  // namespace fg
#endif
