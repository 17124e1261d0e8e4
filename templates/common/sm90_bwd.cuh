{#- Device helpers of the Hopper backward (templates/sm_90/bwd.cu.j2), included where they are used: async
    copies and barriers with a bound, the vector reduction into dq_accum, and the wgmma forms with a transposed A.
    Rendered by Jinja (tt_ns, split_d, dkv_n, mma_t). -#}
namespace fg {
// fence.proxy.async: this thread's generic-proxy shared-memory writes become visible to the async proxy
// (wgmma operand reads) after the next barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// 4-byte global->shared async copy; !valid reads nothing and writes 0.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// fg::mbar_wait with a bound: a TMA load that never lands (a bad tensor map) traps ("unspecified launch
// failure") after 2^24 polls (each try_wait may suspend for a while) instead of hanging the GPU.
__device__ __forceinline__ void mbar_wait_or_trap(uint32_t bar, uint32_t phase) {
    uint32_t done = 0;
    for (uint32_t polls = 0; !done; ++polls) {
        asm volatile("{ .reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(bar), "r"(phase) : "memory");
        if (polls == (1u << 24)) __trap();
    }
}
// p[0..3] += v in global memory, result unused (PTX ISA 8.1, sm_90; p 16-byte aligned).
__device__ __forceinline__ void red_add_f32x4(float* p, float x, float y, float z, float w) {
    asm volatile("red.global.add.v4.f32 [%0], { %1, %2, %3, %4};\n" :: "l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
{% for n in tt_ns %}
// d[64 x {{ n }}] (+)= A[64 x 16] * B[16 x {{ n }}], both from shared memory and both MN-major (transposed):
// A stored K x M (M contiguous), B stored K x N (N contiguous).  scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_tt_n{{ n }}(float (&d)[{{ n // 2 }}], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, %{{ n // 2 + 2 }}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ mma_t }}.{{ mma_t }} "
                 "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last else "" }}{% endfor %}}, "
                 "%{{ n // 2 }}, %{{ n // 2 + 1 }}, p, 1, 1, 1, 1;\n}\n"
                 : {% for i in range(n // 2) %}"+f"(d[{{ i }}]){{ ", " if not loop.last else "" }}{% endfor %}

                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
{% endfor %}
{% if split_d %}
// d[64 x {{ dkv_n }}] += A[64 x 16] * B[16 x {{ dkv_n }}], both from shared memory: A K-major (as wgmma_ss), B MN-major
// (transposed: stored K x N, N contiguous, as wgmma_rs).
__device__ __forceinline__ void wgmma_st_n{{ dkv_n }}(float (&d)[{{ dkv_n // 2 }}], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{{ dkv_n }}k16.f32.{{ mma_t }}.{{ mma_t }} "
                 "{ {% for i in range(dkv_n // 2) %}%{{ i }}{{ ", " if not loop.last else "" }}{% endfor %}}, "
                 "%{{ dkv_n // 2 }}, %{{ dkv_n // 2 + 1 }}, p, 1, 1, 0, 1;\n}\n"
                 : {% for i in range(dkv_n // 2) %}"+f"(d[{{ i }}]){{ ", " if not loop.last else "" }}{% endfor %}

                 : "l"(desc_a), "l"(desc_b));
}
{% endif %}
}  // namespace fg
