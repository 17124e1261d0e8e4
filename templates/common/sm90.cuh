// Hopper (sm_90a) primitives: mbarriers, TMA tile loads, wgmma and its shared-memory
// descriptors, warpgroup register reallocation, named barriers.  PTX ISA 8.x, sections
// "mbarrier", "cp.async.bulk.tensor", "Asynchronous Warpgroup Level Matrix Multiply-Accumulate".
// Rendered by Jinja: the wgmma wrappers are generated for the N extents in `wgmma_ns`.
{# for the operand type mma_t: K = 16 for 16-bit types, 32 for fp8, whose wgmma has no
   transposed forms; row_bytes: the swizzle span of the fp8 forward's Q and K tiles #}
{% set fp8 = fp8 is defined and fp8 %}
{% set mma_k = 32 if fp8 else 16 %}
{% set row_bytes = row_bytes if row_bytes is defined else 128 %}

namespace fg {

// A CUtensorMap (cuTensorMapEncodeTiled), passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaDesc { uint64_t opaque[16]; };

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of TMA traffic completing on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// Announce `bytes` of TMA traffic on this phase without arriving (the arrival comes later).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Block until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
    uint32_t done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    }
}

// ---------------------------------------------------------------- TMA
// Box of the 4-D tensor map at coordinates (c0 innermost .. c3) -> shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TmaDesc* map, int c0, int c1, int c2, int c3, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, { %2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---------------------------------------------------------------- warpgroups
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------- wgmma
// Shared-memory matrix descriptor, 128-byte swizzle (the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): start address, leading / stride byte offsets, all >> 4.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
{% if fp8 and (row_bytes == 64 or block_n == 64) %}
// The same for the 64-byte swizzle (CU_TENSOR_MAP_SWIZZLE_64B: rows of 64 bytes).
__device__ __forceinline__ uint64_t gmma_desc64(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (2ull << 62);
}
{% endif %}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Keep the compiler from moving accumulator reads/writes across wgmma issue/wait.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

{% for n in wgmma_ns %}
// d[64 x {{ n }}] (+)= A[64 x {{ mma_k }}] (shared, K-major) * B[{{ mma_k }} x {{ n }}] (shared, K-major); scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss_n{{ n }}(float (&d)[{{ n // 2 }}], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, %{{ n // 2 + 2 }}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{{ n }}k{{ mma_k }}.f32.{{ mma_t }}.{{ mma_t }} "
                 "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last else "" }}{% endfor %}}, "
                 "%{{ n // 2 }}, %{{ n // 2 + 1 }}, p, 1, 1{{ "" if fp8 else ", 0, 0" }};\n}\n"
                 : {% for i in range(n // 2) %}"+f"(d[{{ i }}]){{ ", " if not loop.last else "" }}{% endfor %}

                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d[64 x {{ n }}] += A[64 x {{ mma_k }}] (registers) * B[{{ mma_k }} x {{ n }}] (shared, {{ "K-major" if fp8 else "N-major: transposed" }}).
__device__ __forceinline__ void wgmma_rs_n{{ n }}(float (&d)[{{ n // 2 }}], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{{ n }}k{{ mma_k }}.f32.{{ mma_t }}.{{ mma_t }} "
                 "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last else "" }}{% endfor %}}, "
                 "{ %{{ n // 2 }}, %{{ n // 2 + 1 }}, %{{ n // 2 + 2 }}, %{{ n // 2 + 3 }}}, "
                 "%{{ n // 2 + 4 }}, p, 1, 1{{ "" if fp8 else ", 1" }};\n}\n"
                 : {% for i in range(n // 2) %}"+f"(d[{{ i }}]){{ ", " if not loop.last else "" }}{% endfor %}

                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
{% endfor %}

}  // namespace fg
