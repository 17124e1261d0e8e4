{#- The constant tiles of the diagonal form of the param gradients in the Hopper backward
    (Options.hopper_bwd.dparam_const_tiles; templates/common/dparam.j2, sm_90/bwd.cu.j2): a step whose tile reads one
    element of the table adds its thread sums into one running register per thread, which a warp adds into the
    gradient only when the element changes or the CTA's steps end.  Rendered only with the option on. -#}
namespace fg {
// The sum of a thread's N registers x (consumed: x[0] holds it after), pairwise: N - 1 adds in ceil(log2 N) rounds.
template <int N>
__device__ __forceinline__ float fold_sum(float (&x)[N]) {
    #pragma unroll
    for (int w = 1; w < N; w *= 2)
        #pragma unroll
        for (int i = 0; i + w < N; i += 2 * w) x[i] += x[i + w];
    return x[0];
}

// A warp's running sums of one element (v per lane): summed over the warp by shuffles, lane 0 adds the total into
// dst[off] (off < 0: no element held yet; a zero total adds nothing).  Every lane of the warp calls it.
__device__ __forceinline__ void warp_add_element(float v, float* dst, int64_t off, int lane) {
    #pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && off >= 0 && v != 0.f) atomicAdd(dst + off, v);
}
}  // namespace fg
