{#- Device helpers of the Hopper backward (templates/sm_90/bwd.cu.j2), included where they are used: async
    copies that an mbarrier tracks, TMA reductions and bulk async-groups, the vector reduction into dq_accum,
    the wgmma forms with a transposed A, and the stores of 16-bit A fragments to swizzled shared memory.
    Rendered by Jinja (tt_ns, split_d, dq_rows_split, dkv_n, mma_t, ordered_dq,
    ordered_hull, ordered_desc, stagger_steps). -#}
namespace fg {
{% if ordered_desc and not ordered_hull %}
// Options.hopper_bwd.ordered_descending, no mask or causal: the last key block that sees query block [m0, m0 + BLOCK_M)
// (causal is bottom-right aligned: kv_idx <= q_idx + seqlen_k - seqlen_q), whose CTA adds into it first.  Called only
// for a block some key block sees, so the causal bound is not negative.
template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ int last_key_block(int m0, int seqlen_q, int seqlen_k) {
    const int n_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
    if (!CAUSAL) return n_blocks - 1;
    return min(n_blocks - 1, (min(m0 + BLOCK_M, seqlen_q) - 1 + seqlen_k - seqlen_q) / BLOCK_N);
}
{% endif %}
{% if stagger_steps %}
// Options.hopper_bwd.stagger_steps: the hull position a CTA's j-th step of a head visits, j rotated by its key block,
// so the key blocks of one head load and reduce into different query blocks at a time (under no mask they would all
// walk the hull from its first block together).
__device__ __forceinline__ int staggered(int j, int n_block, int per_head) {
    const int r = j + n_block % per_head;
    return r >= per_head ? r - per_head : r;
}
{% endif %}
// fence.proxy.async: this thread's generic-proxy shared-memory writes become visible to the async proxy
// (wgmma operand reads) after the next barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// 4-byte global->shared async copy; !valid reads nothing and writes 0.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// One arrival on the mbarrier `bar` once this thread's earlier cp.async copies have landed (.noinc: `bar`'s expected
// count includes this arrival).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], { %1, %2};\n" :: "r"(addr), "f"(x), "f"(y) : "memory");
}
{% if dq_swap %}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(x) : "memory");
}
// Four 8x8 16-bit matrices, transposed, to shared memory (stmatrix .trans, sm_90): register i holds matrix i in the
// mma fragment layout (lane l: row l / 4, columns 2 (l % 4) + {0, 1}); lane 8 i + k gives the address of row k of the
// stored (transposed) matrix i, 16 bytes.
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], { %1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
{% endif %}
// The box of the 4-D tensor map at (c0 innermost .. c3) += the shared-memory box at src, by TMA in this thread's
// bulk async-group (PTX ISA 8.0, cp.reduce.async.bulk.tensor; the map's element type, here fp32; elements outside
// the tensor are not written).
__device__ __forceinline__ void tma_reduce_add_4d(const TmaDesc* map, uint32_t src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, { %2, %3, %4, %5}], [%1];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// The ordered dQ's semaphores: an acquire load and a release store at GPU scope, and the fence between the
// generic proxy (the semaphore) and the async proxy (the TMA reductions) on global memory.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
{% if split_d and ordered_dq %}
// fence.acq_rel at GPU scope: this thread's earlier global writes and reductions are performed before its later
// ones (and, through a barrier, before another thread's release).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
// *p += v at GPU scope with release semantics (the split head-dim layout's ordered dQ counts its warpgroups in).
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
{% endif %}
{% if ordered_hull %}
// The ordered dQ's published hulls (64-bit words, ~0 until published).
__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_gpu_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.global.b64 [%0], %1;\n" :: "l"(p), "l"(v) : "memory");
}
{% endif %}
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's bulk async-groups still read their shared-memory source.
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// Wait until at most N of this thread's bulk async-groups are incomplete (their global writes done).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}
// Element e of the float pair at p (shared memory, 8-byte aligned): both elements come from one 8-byte load.
__device__ __forceinline__ float ld_shared_pair(const float* p, int e) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    return e ? v.y : v.x;
}
// p[0..3] += (x, y, z, w) in global memory, result unused (PTX ISA 8.1, sm_90; p 16-byte aligned).
__device__ __forceinline__ void red_add_f32x4(float* p, float x, float y, float z, float w) {
    asm volatile("red.global.add.v4.f32 [%0], { %1, %2, %3, %4};\n" :: "l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
// dq_accum in fragment order (the Hopper backward at head_dim 256): a 64-row tile of dQ, 64 x D fp32, holds warpgroup c's m64n(D/2)
// accumulator (columns [c D/2, (c + 1) D/2)) in its floats [c 32 D, (c + 1) 32 D), thread t's acc[4j .. 4j + 3] (J = D / 16
// 8-column tiles j) as its float4 number j * 128 + t: each reduction 16 bytes, each warp's 512 contiguous bytes.
// Float4 f of a tile holds dQ(row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1), DqFragCoords of f.
struct DqFragCoords { int row, col; };
template <int D>
__device__ __forceinline__ DqFragCoords dq_frag_coords(int f) {
    const int c = f / (8 * D), j = (f / 128) % (D / 16), t = f % 128;
    return {(t / 32) * 16 + (t % 32) / 4, c * (D / 2) + 8 * j + 2 * (t % 4)};
}
// dq_accum's tile (this warpgroup's half at dq_half) += a wgmma accumulator of dQ (J 8-column tiles) in fragment order:
// J 4-column reductions per thread, no predicates (the tile's rows past seqlen_q are padding the convert kernel skips).
template <int J, int N>
__device__ __forceinline__ void red_add_dq_frag(float* dq_half, int t, const float (&acc)[N]) {
    static_assert(4 * J <= N, "J 8-column tiles of acc");
    #pragma unroll
    for (int j = 0; j < J; ++j)
        red_add_f32x4(dq_half + 4 * (j * 128 + t), acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
}
// 16-bit A fragments (frag[kk][t], as packed from a wgmma accumulator) to shared memory with the 128-byte swizzle,
// four registers (8x8 matrices) per stmatrix (sm_90): frag[kk][t] holds row row0 + 8 (t % 2) + lane / 4 and the
// 16-byte chunk chunk0 + 2 kk + t / 2 of the row's 128 bytes; row0 is the warp's first row (a multiple of 8), and lane
// 8 t + r addresses row row0 + 8 (t % 2) + r of matrix t (its chunk swizzled with r).  Rows wider than 128 bytes
// (KK > 4, chunk0 = 0) continue in the next column box, box_bytes further.
template <int KK>
__device__ __forceinline__ void stsm_frag_swizzled(uint32_t base, int row0, int chunk0, const uint32_t (&frag)[KK][4], int lane,
                                                   uint32_t box_bytes = 0) {
    const int t = lane / 8, r = lane % 8;
    const uint32_t row_addr = base + (row0 + 8 * (t % 2) + r) * 128;
    #pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        const int chunk = chunk0 + 2 * kk + t / 2;
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4};\n"
                     :: "r"(row_addr + (chunk / 8) * box_bytes + (((chunk % 8) ^ r) << 4)),
                        "r"(frag[kk][0]), "r"(frag[kk][1]), "r"(frag[kk][2]), "r"(frag[kk][3]) : "memory");
    }
}
{% if sdp_wg %}
// The inverse of stsm_frag_swizzled (ldmatrix, sm_75+): frag[kk][t] gets back what register t of frag[kk] stored.
template <int KK>
__device__ __forceinline__ void ldsm_frag_swizzled(uint32_t base, int row0, int chunk0, uint32_t (&frag)[KK][4], int lane) {
    static_assert(KK <= 4, "one 128-byte swizzle box (no box_bytes, unlike stsm_frag_swizzled)");
    const int t = lane / 8, r = lane % 8;
    const uint32_t row_addr = base + (row0 + 8 * (t % 2) + r) * 128;
    #pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        const int chunk = chunk0 + 2 * kk + t / 2;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
                     : "=r"(frag[kk][0]), "=r"(frag[kk][1]), "=r"(frag[kk][2]), "=r"(frag[kk][3])
                     : "r"(row_addr + (((chunk % 8) ^ r) << 4)) : "memory");
    }
}
{% endif %}
{# wgmma_mn_a(name, n, trans_b): d[64 x n] (+)= A * B, both from shared memory, A MN-major (trans-a 1), B as trans_b
    says (0 K-major, 1 MN-major); scale_d = 0 overwrites d. #}
{% macro wgmma_mn_a(name, n, trans_b) -%}
__device__ __forceinline__ void {{ name }}_n{{ n }}(float (&d)[{{ n // 2 }}], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, %{{ n // 2 + 2 }}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ mma_t }}.{{ mma_t }} "
                 "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last else "" }}{% endfor %}}, "
                 "%{{ n // 2 }}, %{{ n // 2 + 1 }}, p, 1, 1, 1, {{ trans_b }};\n}\n"
                 : {% for i in range(n // 2) %}"+f"(d[{{ i }}]){{ ", " if not loop.last else "" }}{% endfor %}

                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
{%- endmacro %}
{% for n in ts_ns %}
// d[64 x {{ n }}] (+)= A[64 x 16] * B[16 x {{ n }}], both from shared memory: A MN-major (stored K x M, M contiguous),
// B K-major (as wgmma_ss).  scale_d = 0 overwrites d.
{{ wgmma_mn_a("wgmma_ts", n, 0) }}
{% endfor %}
{% for n in tt_ns %}
// d[64 x {{ n }}] (+)= A[64 x 16] * B[16 x {{ n }}], both from shared memory and both MN-major (transposed):
// A stored K x M (M contiguous), B stored K x N (N contiguous).  scale_d = 0 overwrites d.
{{ wgmma_mn_a("wgmma_tt", n, 1) }}
{% endfor %}
{% if ds_from_frag %}
// Element e (0: lo, 1: hi) of an MmaOp<elem_t>::pack()ed pair, back to fp32.
__device__ __forceinline__ float unpack16(uint32_t v, int e) {
{% if mma_t == "bf16" %}
    return __uint_as_float(e ? v & 0xffff0000u : v << 16);
{% else %}
    return __half2float(__ushort_as_half((unsigned short)(e ? v >> 16 : v & 0xffffu)));
{% endif %}
}
{% endif %}
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
