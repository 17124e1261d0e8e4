// The attention sink of the decode kernels (Options.decode.fused_sink; flashgen/ops/sink.py has the
// math): one logit per (request, query head) joins the row's softmax denominator and nothing else.
// __host__ __device__: the host tests run it (tests/unit/test_decode_sink.py).
#ifndef FG_DECODE_SINK_CUH
#define FG_DECODE_SINK_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {
namespace dec {

// The keys' share of a row's mass with the sink in its denominator, exp(lse) / (exp(lse) + exp(sink)) =
// sigmoid(lse - sink), so o = o_keys * share (lse: the keys' alone, natural log).  A row with no key (lse =
// -inf) has share 0 whatever the sink (o = 0, not 0 x NaN at sink = -inf); a NaN lse or sink gives NaN.
__host__ __device__ __forceinline__ float sink_share(float lse, float sink) {
    return lse == -INFINITY ? 0.f : 1.f / (1.f + expf(sink - lse));
}

}  // namespace dec
}  // namespace fg
#endif
