// flashgen forward kernel for Hopper (sm_90a), FA3-class (Shah et al. 2024, "FlashAttention-3",
// sections 3.1-3.2): TMA loads into a shared-memory K/V ring, wgmma for both GEMMs, warp
// specialization (one producer warpgroup, NUM_CONSUMERS consumer warpgroups) with setmaxnreg.
// Spec: chunked_local   dtype bf16   head_dim 128   causal True
//
// Glossary
//   BLOCK_M   query rows per CTA; consumer warpgroup c owns rows [64c, 64c + 64)
//   BLOCK_N   key/value rows per step (one stage of the sK / sV ring)
//   STAGES    depth of the K/V ring; k_full/v_full[s] complete when TMA has landed stage s,
//             k_empty/v_empty[s] when every consumer warp is done reading it
//   sQ sK sV  tiles as [HEAD_DIM / 64][rows][64]: 128-byte rows, 128-byte swizzle (TMA writes it,
//             wgmma reads it through gmma_desc)
//   acc_s     S = Q K^T, a 64 x BLOCK_N wgmma accumulator per warpgroup (P after softmax)
//   acc_o     O = P V, 64 x HEAD_DIM, rescaled lazily, divided by row_sum at the end
//   fragment  thread (warp w, lane l) holds rows 16w + l/4 (+8) and, per 8-column tile j,
//             columns 8j + 2(l%4) + {0,1}: acc[4j + 2r + e]
// Softmax runs in the exp2 domain, one FFMA before each exp2: P = exp2(c * x - c * row max), with
// x = score_mod(softmax_scale * q.k) and c = log2(e), or (no score_mod) x = q.k and c = softmax_scale * log2(e).
// causal is bottom-right aligned: kv_idx <= q_idx + seqlen_k - seqlen_q.
// Block sparsity: the producer walks the live key blocks of its query block, EMPTY ones are never
// loaded, FULL ones inside seqlen_k evaluate no mask.  Classes come from fg_tile_class (flashgen/analysis/masktiles.py):
// interval arithmetic over the mask (causal included), walked warp-wide with fg::iv::WarpWalk.
// Warp-level tensor-core and async-copy primitives for sm_80+ (mma.sync, ldmatrix, cp.async).
// Fragment layouts follow the PTX ISA, "Matrix Fragments for mma.m16n8k16".
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace fg {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; rows past the end are zero-filled (src_bytes = 0 reads nothing).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 b16 matrices; thread t supplies the row address of matrix t/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    // d += a (16x16, row) * b (16x8, col), fp32 accumulators.
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};
template <> struct MmaOp<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

// The DSL's tanh: one MUFU op (sm_75+), relative error about 2^-11, far under a bf16/fp16 logit's
// rounding; the softcap score_mod (cap * tanh(score / cap)) is otherwise a ~20-instruction tanhf per element.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are `row_bytes` wide
// (a multiple of 64: head dims 32, 64, 96, ...).  The 8 rows an ldmatrix phase (or a warp's
// fragment store) touches at one column, rows 8i..8i+7, must land in 8 different 16-byte bank
// groups (a bank group is (byte address / 16) % 8):
//   row_bytes % 128 == 0: every row starts at bank group 0; XOR the chunk's low 3 bits with row % 8
//     (the permutation stays inside each aligned group of 8 chunks).
//   row_bytes % 128 == 64 (head dim 32, 96, 160, ...): odd rows start 4 groups later than even ones,
//     so XOR only the chunk's low 2 bits with (row / 2) % 4 (inside aligned groups of 4 chunks, i.e.
//     64 bytes): bank group = (chunk ^ (row/2 % 4)) % 4 + 4 * ((chunk / 4 + row) % 2), distinct for
//     the 8 rows.  No padding, no wasted shared memory, no padded tensor-core work.
// row_bytes is a compile-time constant at every kernel call, so the branch folds away.  __host__ too:
// tests/unit/test_swizzle.py checks these properties exhaustively in a host program built with nvcc.
__host__ __device__ __forceinline__ uint32_t swz(int row, int chunk, int row_bytes) {
    if (row_bytes % 128 == 0) return row * row_bytes + ((chunk ^ (row & 7)) << 4);
    return row * row_bytes + ((chunk ^ ((row >> 1) & 3)) << 4);
}

}  // namespace fg

namespace fg {
// A tensor-param read's row base (t + the offset of its tile-invariant subscripts, flashgen/codegen/cuda_expr.py
// _tensor_read) through a copy the compiler cannot see through: computed once per tile, and each element's
// address one IMAD.WIDE of its 32-bit offset.  (Without it NVVM re-associates the base into every element's
// 64-bit offset: a sign extension, an IMAD.WIDE and a LEA/LEA.HI.X pair per element.)  Not volatile: copies
// of one base are merged and hoisted.  Read it with __ldg (the copy hides the pointer's __restrict__).
template <class T> __device__ __forceinline__ const T* base_ptr(const T* p) {
    asm("mov.b64 %0, %0;\n" : "+l"(p));
    return p;
}
// A tensor-param index clamped into [0, n) (n >= 1: no kernel runs on an empty param): DSL reads never leave
// the param's declared shape.  In 32 bits (DSL indices and extents are int): two IMNMX; the offset that
// multiplies it out is 64-bit.
__device__ __forceinline__ int clamp_index(int i, int n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }
// The DSL's integer / and % by a run-time divisor: C's truncation, 0 for a zero divisor, and INT_MIN / -1
// wrapping to INT_MIN (remainder 0) as the reference and the mask analysis define it, never C's undefined
// behaviour (a divisor of -1 negates in unsigned arithmetic).
__device__ __forceinline__ int idiv(int a, int b) {
    return b == 0 ? 0 : (b == -1 ? (int)(0u - (uint32_t)a) : a / b);
}
__device__ __forceinline__ int imod(int a, int b) { return (b == 0 || b == -1) ? 0 : a % b; }
// The same / and % by a divisor fixed for the whole kernel (a scalar param): built once in the kernel's
// prologue, then a multiply-high, an add and a shift per division instead of the ~20-instruction run-time
// division (Granlund & Montgomery 1994, "Division by invariant integers using multiplication", sec. 4:
// m = 2^32 (2^l - |d|) / |d| + 1 with l = ceil(log2 |d|), |x| / |d| = (mulhi(|x|, m) + |x|) >> l, exact for
// |x| <= 2^31; the sum cannot wrap since mulhi(|x|, m) < |x|).  __host__ too: tests/unit/test_divisor.py
// checks it against C division in a host program.
struct Divisor {
    int d;
    uint32_t ad, magic;
    int shift;
    __host__ __device__ explicit Divisor(int d_) : d(d_) {
        ad = d < 0 ? 0u - (uint32_t)d : (uint32_t)d;
        shift = 0;
        while (shift < 32 && ((uint64_t)1 << shift) < ad) ++shift;
        magic = ad == 0 ? 0u : (uint32_t)(((uint64_t)1 << 32) * (((uint64_t)1 << shift) - ad) / ad + 1);
    }
    __host__ __device__ __forceinline__ int div(int x) const {
        const uint32_t ax = x < 0 ? 0u - (uint32_t)x : (uint32_t)x;
#ifdef __CUDA_ARCH__
        const uint32_t hi = __umulhi(ax, magic);
#else
        const uint32_t hi = (uint32_t)(((uint64_t)ax * magic) >> 32);
#endif
        const int q = (int)((hi + ax) >> shift);
        return ad == 0 ? 0 : ((x < 0) != (d < 0) ? -q : q);
    }
    __host__ __device__ __forceinline__ int mod(int x) const {
        return ad == 0 ? 0 : (int)((uint32_t)x - (uint32_t)div(x) * (uint32_t)d);
    }
    // x >= 0 and d >= 1, which the lowering proves (flashgen/codegen/cuda_expr.py, hopper_fwd.nonneg_div):
    // the multiply-high and a shift, no sign or zero handling.
    __host__ __device__ __forceinline__ int div_nn(int x) const {
#ifdef __CUDA_ARCH__
        const uint32_t hi = __umulhi((uint32_t)x, magic);
#else
        const uint32_t hi = (uint32_t)(((uint64_t)(uint32_t)x * magic) >> 32);
#endif
        return (int)((hi + (uint32_t)x) >> shift);
    }
    __host__ __device__ __forceinline__ int mod_nn(int x) const { return x - div_nn(x) * d; }
};
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
}  // namespace fg
// Hopper (sm_90a) primitives: mbarriers, TMA tile loads, wgmma and its shared-memory
// descriptors, warpgroup register reallocation, named barriers.  PTX ISA 8.x, sections
// "mbarrier", "cp.async.bulk.tensor", "Asynchronous Warpgroup Level Matrix Multiply-Accumulate".
// Rendered by Jinja: the wgmma wrappers are generated for the N extents in `wgmma_ns`.

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

// d[64 x 128] (+)= A[64 x 16] (shared, K-major) * B[16 x 128] (shared, K-major); scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d[64 x 128] += A[64 x 16] (registers) * B[16 x 128] (shared, N-major: transposed).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{ %64, %65, %66, %67}, "
                 "%68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// d[64 x 160] (+)= A[64 x 16] (shared, K-major) * B[16 x 160] (shared, K-major); scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss_n160(float (&d)[80], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, %82, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 "
                 "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, "
                 "%80, %81, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d[64 x 160] += A[64 x 16] (registers) * B[16 x 160] (shared, N-major: transposed).
__device__ __forceinline__ void wgmma_rs_n160(float (&d)[80], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile("{ .reg .pred p;\n"
                 "setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 "
                 "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, "
                 "{ %80, %81, %82, %83}, "
                 "%84, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

}  // namespace fg
// Interval arithmetic for tile classification (flashgen/analysis/masktiles.py emits the classifier that
// calls these).  Same rules, one for one, as the host analysis in flashgen/analysis/maskinfo.py (Cousot &
// Cousot's interval domain): a number is a range [lo, hi] (double, may be infinite), a boolean is
// (can be true, can be false).  __host__ __device__ so the CPU tests can run the emitted classifier.
// Also: searches for the next / previous non-empty block along one axis over aligned power-of-two block
// ranges (EMPTY runs are skipped and FULL runs taken in O(log n) range checks).
#ifndef __CUDACC_RTC__
#include <math.h>
#endif

#define FG_HD __host__ __device__ __forceinline__

namespace fg {
namespace iv {

constexpr int EMPTY = 0, PARTIAL = 1, FULL = 2;

struct R { double lo, hi; };  // every value lies in [lo, hi]
struct T { bool t, f; };      // can be true, can be false

FG_HD R exact(double v) { return {v, v}; }
FG_HD R range(double lo, double hi) { return {lo, hi}; }
FG_HD R any() { return {-INFINITY, INFINITY}; }
FG_HD T truth(bool v) { return {v, !v}; }
FG_HD T maybe() { return {true, true}; }

FG_HD T lnot(T a) { return {a.f, a.t}; }
FG_HD T land(T a, T b) { return {a.t && b.t, a.f || b.f}; }
FG_HD T lor(T a, T b) { return {a.t || b.t, a.f && b.f}; }

FG_HD R neg(R a) { return {-a.hi, -a.lo}; }
FG_HD R add(R a, R b) { return {a.lo + b.lo, a.hi + b.hi}; }
FG_HD R sub(R a, R b) { return {a.lo - b.hi, a.hi - b.lo}; }
// An integer result that may leave int32 (the kernels compute in C int) is unknown.
FG_HD R i32(R a) { return (a.lo < -2147483648.0 || a.hi > 2147483647.0) ? any() : a; }

FG_HD R corners(double w, double x, double y, double z) {
    if (isnan(w) || isnan(x) || isnan(y) || isnan(z)) return any();
    return {fmin(fmin(w, x), fmin(y, z)), fmax(fmax(w, x), fmax(y, z))};
}
FG_HD double mul0(double x, double y) { return (x == 0.0 || y == 0.0) ? 0.0 : x * y; }  // 0 * inf = 0
FG_HD R mul(R a, R b) {
    return corners(mul0(a.lo, b.lo), mul0(a.lo, b.hi), mul0(a.hi, b.lo), mul0(a.hi, b.hi));
}
// C integer division (truncates toward zero) on integer-valued doubles, y != 0.  Finite operands are
// int32 values (i32 makes a larger integer unknown), divided as ints: a double division is a call to
// a slow path in SASS, whose ABI made ptxas spill in the Hopper forward.  NAN (unknown) otherwise.
FG_HD double trunc_div(double x, double y) {
    if (isinf(x)) return isinf(y) ? NAN : ((x > 0) == (y > 0) ? INFINITY : -INFINITY);
    if (isinf(y)) return 0.0;
    if (y == -1.0) return -x;  // exact; int would overflow at -2^31 / -1
    if (!(x >= -2147483648.0 && x <= 2147483647.0 && y >= -2147483648.0 && y <= 2147483647.0)) return NAN;
    return (double)((int)x / (int)y);
}
FG_HD R div(R a, R b, bool is_int) {
    if (b.lo <= 0 && 0 <= b.hi) return any();
    if (b.lo == b.hi && !isinf(b.lo) && !isnan(a.lo) && !isnan(a.hi)) {  // one divisor: monotone, 2 divisions
        const double lo = is_int ? trunc_div(a.lo, b.lo) : a.lo / b.lo;
        const double hi = is_int ? trunc_div(a.hi, b.lo) : a.hi / b.lo;
        if (isnan(lo) || isnan(hi)) return any();
        return b.lo > 0 ? R{lo, hi} : R{hi, lo};
    }
    if (is_int)
        return corners(trunc_div(a.lo, b.lo), trunc_div(a.lo, b.hi), trunc_div(a.hi, b.lo), trunc_div(a.hi, b.hi));
    return corners(a.lo / b.lo, a.lo / b.hi, a.hi / b.lo, a.hi / b.hi);
}
// C % / fmodf (the sign of the dividend), by an exact divisor.
FG_HD R mod(R a, R b, bool is_int) {
    if (b.lo != b.hi || b.lo == 0 || isinf(b.lo)) return any();
    const double c = fabs(b.lo);
    // (integer-valued doubles: x - c * floor(x / c) is x % c for x >= 0, and exact)
    if (is_int && a.lo >= 0 && !isinf(a.hi)) {
        const double ql = floor(a.lo / c), qh = floor(a.hi / c);
        if (ql == qh) return {a.lo - c * ql, a.hi - c * qh};
    }
    if (is_int && a.hi <= 0 && !isinf(a.lo)) {
        const double ql = floor(-a.lo / c), qh = floor(-a.hi / c);
        if (ql == qh) return {-(-a.lo - c * ql), -(-a.hi - c * qh)};
    }
    const double edge = is_int ? c - 1 : c;
    return {a.lo >= 0 ? 0.0 : -edge, a.hi <= 0 ? 0.0 : edge};
}

// float32 rounding (the kernels evaluate a mask's f32 math in float, these bounds in double): a
// float result's range widened by `rel` of its magnitude plus a subnormal step, so the float the
// kernel computes (each op within an ulp, 2^-23; expf/logf 2 ulps; tanh.approx.f32 about 2^-11)
// lies inside; a comparison of such ranges then never claims EMPTY or FULL on a rounding.
FG_HD double fl_lo(double x, double rel) { return isinf(x) ? x : x - fabs(x) * rel - 1e-37; }
FG_HD double fl_hi(double x, double rel) { return isinf(x) ? x : x + fabs(x) * rel + 1e-37; }
FG_HD R fl(R a, double rel) {
    if (isnan(a.lo) || isnan(a.hi)) return any();
    return {fl_lo(a.lo, rel), fl_hi(a.hi, rel)};
}
// an int converted to float: exact up to 2^24
FG_HD R fl_int(R a) {
    return (fabs(a.lo) <= 16777216.0 && fabs(a.hi) <= 16777216.0) ? a : fl(a, 0x1p-22);
}

FG_HD T lt(R a, R b) { return {a.lo < b.hi, a.hi >= b.lo}; }
FG_HD T le(R a, R b) { return {a.lo <= b.hi, a.hi > b.lo}; }
FG_HD T gt(R a, R b) { return {a.hi > b.lo, a.lo <= b.hi}; }
FG_HD T ge(R a, R b) { return {a.hi >= b.lo, a.lo < b.hi}; }
FG_HD T eq(R a, R b) {
    const bool overlap = a.lo <= b.hi && b.lo <= a.hi;
    const bool same = a.lo == a.hi && b.lo == b.hi && a.lo == b.lo;
    return {overlap, !same};
}
FG_HD T ne(R a, R b) { return lnot(eq(a, b)); }
FG_HD T eq(T a, T b) { return {(a.t && b.t) || (a.f && b.f), (a.t && b.f) || (a.f && b.t)}; }
FG_HD T ne(T a, T b) { return lnot(eq(a, b)); }

// c ? x : y, with x (y) only counted where c can be true (false).
FG_HD R cond(T c, R x, R y) {
    if (!c.t) return y;
    if (!c.f) return x;
    return {fmin(x.lo, y.lo), fmax(x.hi, y.hi)};
}
FG_HD T cond(T c, T x, T y) {
    if (!c.t) return y;
    if (!c.f) return x;
    return {x.t || y.t, x.f || y.f};
}

FG_HD R fabs_(R a) {
    if (a.lo >= 0) return a;
    if (a.hi <= 0) return {-a.hi, -a.lo};
    return {0.0, fmax(-a.lo, a.hi)};
}
FG_HD R min_(R a, R b) { return {fmin(a.lo, b.lo), fmin(a.hi, b.hi)}; }
FG_HD R max_(R a, R b) { return {fmax(a.lo, b.lo), fmax(a.hi, b.hi)}; }
FG_HD double exp_(double x) { return x < 700 ? exp(x) : INFINITY; }
FG_HD R exp_(R a) { return {exp_(a.lo), exp_(a.hi)}; }
FG_HD R log_(R a) {
    if (a.lo < 0) return any();
    return {a.lo == 0 ? -INFINITY : log(a.lo), a.hi == 0 ? -INFINITY : log(a.hi)};
}
FG_HD R sqrt_(R a) { return a.lo < 0 ? any() : R{sqrt(a.lo), sqrt(a.hi)}; }
FG_HD R tanh_(R a) { return {tanh(a.lo), tanh(a.hi)}; }

// x, through an empty volatile asm on the device: the compiler cannot hoist what depends on it out of a loop.
FG_HD int opaque(int x) {
#ifdef __CUDA_ARCH__
    int r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
#else
    return x;
#endif
}

FG_HD int tile_class(T keep) { return !keep.t ? EMPTY : (keep.f ? PARTIAL : FULL); }

// Flags on a PARTIAL class (flashgen/analysis/masktiles.py, causal_bits; the Hopper forward): the mask is
// exactly `causal` on the tile (CAUSAL_ONLY: with causal := true it is FULL there, with causal :=
// false EMPTY), or `causal` holds on every pair of the tile (NO_CAUSAL).  A class with a flag is
// neither EMPTY nor FULL, so the block searches treat it as PARTIAL.
constexpr int CAUSAL_ONLY = 4, NO_CAUSAL = 8;
FG_HD int causal_bits(int cls, T causal, T keep_t, T keep_f) {
    if (cls != PARTIAL) return cls;
    if (keep_t.t && !keep_t.f && !keep_f.t) return cls | CAUSAL_ONLY;
    return causal.f ? cls : (cls | NO_CAUSAL);
}

// Smallest power of two >= n (n >= 1).
FG_HD int ceil_pow2(int n) {
    int s = 1;
    while (s < n) s <<= 1;
    return s;
}

// Block searches along one axis.  tile(i0, i1) classifies blocks i0..i1 (inclusive) as one range.  A live
// block costs one single-block check; a FULL one also tries the aligned power-of-two ranges beyond it,
// halving, and the largest FULL one is remembered in `full`: its blocks cost nothing; an EMPTY one starts a
// crossing of the EMPTY run by aligned ranges, skipped when EMPTY and halved otherwise.  So a run of n EMPTY
// or FULL blocks costs O(log n) range checks, a PARTIAL block one.  Correct for any mask: a range is only
// skipped when EMPTY and only taken as FULL when FULL.  Successive calls of one walk must move one way
// (`full` is valid between the last block returned and the end of its run); start `full` at -1
// (next_live) / INT_MAX (prev_live), and again for a new walk.

// Smallest block i in [j, n) that is not EMPTY, or n; `cls` gets its class.
template <class Tile>
FG_HD int next_live(int j, int n, int& cls, int& full, Tile&& tile) {
    if (j >= n) return n;
    if (j <= full) { cls = FULL; return j; }
    cls = tile(j, j);
    if (cls == FULL) {  // extend the run over the largest FULL aligned range starting at j
        for (int s = j ? (j & -j) : ceil_pow2(n); s > 1; s >>= 1) {
            const int e = (j + s < n ? j + s : n) - 1;
            if (e > j && tile(j, e) == FULL) { full = e; break; }
        }
    }
    if (cls != EMPTY) return j;
    for (++j; j < n;) {  // cross the EMPTY run
        for (int s = j & -j;; s >>= 1) {
            const int e = (j + s < n ? j + s : n) - 1;
            const int c = tile(j, e);
            if (c == EMPTY) { j += s; break; }
            if (c == FULL) { full = e; cls = FULL; return j; }
            if (s == 1) { cls = c; return j; }
        }
    }
    return n;
}

// Largest block i <= j that is not EMPTY, or -1; `cls` gets its class.  Mirror of next_live.
template <class Tile>
FG_HD int prev_live(int j, int& cls, int& full, Tile&& tile) {
    if (j < 0) return -1;
    if (j >= full) { cls = FULL; return j; }
    cls = tile(j, j);
    if (cls == FULL) {  // extend the run over the largest FULL aligned range ending at j
        for (int s = (j + 1) & -(j + 1); s > 1; s >>= 1)
            if (tile(j + 1 - s, j) == FULL) { full = j + 1 - s; break; }
    }
    if (cls != EMPTY) return j;
    for (--j; j >= 0;) {  // cross the EMPTY run
        for (int s = (j + 1) & -(j + 1);; s >>= 1) {
            const int c = tile(j + 1 - s, j);
            if (c == EMPTY) { j -= s; break; }
            if (c == FULL) { full = j + 1 - s; cls = FULL; return j; }
            if (s == 1) { cls = c; return j; }
        }
    }
    return -1;
}

#ifdef __CUDACC__
// Warp-wide walk of the live key blocks of one query block, last to first (the Hopper forward's
// producer; every warp once for the first block).  The 32 lanes classify 32 blocks at once: lane l
// holds the class of block hi - l of the current window, so a window costs one classifier call per
// lane and a step inside it a ballot; a window that is all EMPTY is crossed by ranges of 32 blocks per
// lane, 1024 blocks per step.  The classes are those of single-block tile(j, j), as in prev_live.  All
// 32 lanes call prev_live with the same arguments (it ballots and shuffles), successive calls with
// decreasing j.
struct WarpWalk {
    int hi = -1;           // window: blocks hi - 31 .. hi
    int lane_cls = EMPTY;  // this lane's class of block hi - lane (EMPTY below block 0)

    // Largest block i <= j that is not EMPTY, or -1; `cls` gets its class.
    template <class Tile>
    __device__ __forceinline__ int prev_live(int j, int& cls, Tile&& tile) {
        const int lane = threadIdx.x % 32;
        while (j >= 0) {
            if (j > hi || j < hi - 31) {  // j left the window: classify blocks j - 31 .. j
                hi = j;
                lane_cls = j - lane >= 0 ? tile(j - lane, j - lane) : EMPTY;
            }
            const unsigned live = __ballot_sync(0xffffffffu, lane >= hi - j && lane_cls != EMPTY);
            if (live) {
                const int l = __ffs(live) - 1;  // the lowest lane holds the largest block
                cls = __shfl_sync(0xffffffffu, lane_cls, l);
                return hi - l;
            }
            // Blocks hi - 31 .. j are EMPTY: find the highest range of 32 blocks below that is not.
            for (j = hi - 32; j >= 0; j -= 1024) {
                const int top = j - 32 * lane, bot = top - 31 > 0 ? top - 31 : 0;
                const unsigned any = __ballot_sync(0xffffffffu, top >= 0 && tile(bot, top) != EMPTY);
                if (any) {
                    j -= 32 * (__ffs(any) - 1);
                    break;
                }
            }
        }
        cls = EMPTY;
        return -1;
    }
};
#endif

}  // namespace iv
}  // namespace fg
// The order in which a forward kernel's CTAs (or a persistent CTA's work tiles) take the
// (batch * heads_q + head, query block) pairs: heads in groups that share L2, query-block major
// within a group.  With causal-like masks the blocks are reversed after this (heaviest first), so
// every head of a group starts its heaviest block before any of them starts a lighter one: no
// head's longest rows are left for the end (head-major order left the last heads' ones there, an
// idle tail of ~5% at B=2, S=8k), while the group's K and V stay in L2 (m-major order over all
// heads lost 3-4% to L2 misses at S=16k).  FA3's LPT tile scheduler groups heads the same way.
// lower.tile_coord and lower.head_group mirror both functions.
namespace fg {

struct TileCoord {
    int m_rev;  // query block, in the kernel's order (reversed after this for causal-like masks)
    int bh;     // batch * heads_q + head
};

// Tile t of num_m_blocks * num_bh, heads in ceil(num_bh / group) groups of as equal sizes as can
// be (the first num_bh % n hold one more head; a small last group would leave its heaviest blocks
// for the end), block m_rev of each head of a group in turn.  Needs t < num_m_blocks * num_bh
// (so num_bh >= 1) and group >= 1; no intermediate exceeds num_m_blocks * num_bh, so any grid of
// at most 2^31 - 1 tiles decodes without int overflow (tests/unit/test_tile_order_host.py).
__device__ __forceinline__ TileCoord tile_coord(int t, int num_m_blocks, int num_bh, int group) {
    const int n = (num_bh - 1) / group + 1;  // ceil(num_bh / group), not overflowing for any group
    const int q = num_bh / n, rem = num_bh % n;
    const int big_heads = q * rem + rem;      // the heads of the groups of q + 1
    const int big = big_heads * num_m_blocks;  // and their tiles
    const int size = t < big ? q + 1 : q;
    const int u = t < big ? t : t - big;
    const int g = u / (size * num_m_blocks), r = u - g * size * num_m_blocks;
    const int start = t < big ? g * size : big_heads + g * size;
    return {r / size, start + r % size};
}

// tile_coord's order carried by the launch grid (lower.grouped_grid): gridDim = (size *
// num_m_blocks, n groups), blockIdx.y the group, blockIdx.x = m_rev * size + the head in it, size
// the larger groups' head count.  A smaller group's CTAs of head size - 1 are holes: bh = -1.
// Two dependent divisions by run-time values where head_group and tile_coord chain five, on the
// path to the CTA's first TMA load (with bh / heads_q and h / q_per_kv after them: 1.7K cycles
// before, 1.3K now; docs/perf-notes.md, session 9).  (x, g) = (blockIdx.x, blockIdx.y), n = gridDim.y.
__device__ __forceinline__ TileCoord grid_tile_coord(int num_bh, int n, int x, int g) {
    const int q = num_bh / n, rem = num_bh - q * n;  // rem groups of q + 1 heads first, then q
    const int size = rem ? q + 1 : q;
    const int m_rev = x / size, head = x - m_rev * size;
    if (head >= (g < rem ? q + 1 : q)) return {m_rev, -1};
    return {m_rev, g * q + min(g, rem) + head};
}

// The most heads a group may hold: the K/V heads whose seqlen rows of kv_row_bytes fit l2_bytes,
// times the q_per_kv query heads sharing each; at least 1, at most num_bh.
__device__ __forceinline__ int head_group(long long l2_bytes, int seqlen_k, int kv_row_bytes, int q_per_kv, int num_bh) {
    const long long kv_head_bytes = (long long)max(seqlen_k, 1) * kv_row_bytes;
    const long long heads = max(l2_bytes / kv_head_bytes, 1LL) * q_per_kv;
    return (int)min(heads, (long long)max(num_bh, 1));
}

}  // namespace fg

// Tile class of spec chunked_local's mask (flashgen/analysis/masktiles.py; rules of maskinfo.py).
__host__ __device__ __forceinline__ int fg_tile_class(int q0, int q1, int k0, int k1, int b, int h, int h_kv, int seqlen_q, int seqlen_k, int p_chunk) {
    (void)b; (void)h; (void)seqlen_q; (void)seqlen_k;
    (void)p_chunk;
    const fg::iv::R q_r = fg::iv::range((double)q0, (double)q1);
    const fg::iv::R kv_r = fg::iv::range((double)k0, (double)k1);
    (void)q_r; (void)kv_r;
    const fg::iv::R e0 = fg::iv::exact((double)seqlen_k - (double)seqlen_q);
    const fg::iv::R e1 = fg::iv::add(q_r, e0);
    const fg::iv::T e2 = fg::iv::ge(e1, kv_r);
    const fg::iv::R e3 = fg::iv::exact((double)seqlen_k);
    const fg::iv::R e4 = fg::iv::i32(fg::iv::add(q_r, e3));
    const fg::iv::R e5 = fg::iv::exact((double)seqlen_q);
    const fg::iv::R e6 = fg::iv::i32(fg::iv::sub(e4, e5));
    const fg::iv::R e7 = fg::iv::exact((double)p_chunk);
    const fg::iv::R e8 = fg::iv::div(e6, e7, true);
    const fg::iv::R e9 = fg::iv::exact((double)p_chunk);
    const fg::iv::R e10 = fg::iv::div(kv_r, e9, true);
    const fg::iv::T e11 = fg::iv::eq(e8, e10);
    const fg::iv::T e12 = fg::iv::land(e2, e11);
    const fg::iv::R e13 = fg::iv::exact((double)seqlen_k - (double)seqlen_q);
    const fg::iv::R e14 = fg::iv::add(q_r, e13);
    const fg::iv::T e15 = fg::iv::ge(e14, kv_r);
    const fg::iv::T e16 = fg::iv::truth(true);
    const fg::iv::T e17 = fg::iv::land(e16, e11);
    const fg::iv::T e18 = fg::iv::truth(false);
    const fg::iv::T e19 = fg::iv::land(e18, e11);
    return fg::iv::causal_bits(fg::iv::tile_class(e12), e15, e17, e19);
}


namespace {
constexpr int HEAD_DIM = 128;
constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 160;
constexpr int NUM_CONSUMERS = 2;
constexpr int STAGES = 2;
constexpr int THREADS = 128 * (NUM_CONSUMERS + 1);
constexpr int DCB = HEAD_DIM / 64;   // 64-column blocks of a row (one TMA box each)
constexpr int NS = BLOCK_N / 8;      // 8-column tiles of S
constexpr int NO = HEAD_DIM / 8;     // 8-column tiles of O
constexpr uint32_t SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr uint32_t SKV_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr bool IS_CAUSAL = true;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;
static_assert(BLOCK_M == 64 * NUM_CONSUMERS && BLOCK_N % 16 == 0 && HEAD_DIM % 64 == 0, "tile shape");
}  // namespace
extern "C" __global__ void __launch_bounds__(THREADS, 1) flashgen_chunked_local_fwd_sm_90(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    __nv_bfloat16* __restrict__ o,
    float* __restrict__ lse,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t o_sb,
    int64_t o_sh,
    int64_t o_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale,
    int p_chunk,
    const __grid_constant__ fg::TmaDesc tma_q,
    const __grid_constant__ fg::TmaDesc tma_k,
    const __grid_constant__ fg::TmaDesc tma_v
) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t sQ = (fg::smem_u32(smem_raw) + 1023u) & ~1023u;  // 128-byte swizzle wants 1 KiB alignment
    const uint32_t sK = sQ + SQ_BYTES;
    const uint32_t sV = sK + STAGES * SKV_BYTES;
    const uint32_t bars = sV + STAGES * SKV_BYTES;
    const uint32_t q_full = bars;
    auto k_full = [&](int s) { return bars + 8u * (1 + s); };
    auto v_full = [&](int s) { return bars + 8u * (1 + STAGES + s); };
    auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * STAGES + s); };
    // Per ring stage, written by the producer before it arms k_full: the key block, its tile class, last?
    int* stage_info = reinterpret_cast<int*>(smem_raw + (bars + 8u * (1 + 4 * STAGES) - fg::smem_u32(smem_raw)));
    int* first_slot = stage_info + 2 * STAGES;  // the first live key block, from warp 0's walk

    // Thread 0 readies the barriers first: Q goes out as soon as the CTA knows its tile.
    if (threadIdx.x == 0) {
        fg::tma_prefetch_desc(&tma_q);
        fg::tma_prefetch_desc(&tma_k);
        fg::tma_prefetch_desc(&tma_v);
        fg::mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            fg::mbar_init(k_full(s), 1);
            fg::mbar_init(v_full(s), 1);
            fg::mbar_init(k_empty(s), NUM_CONSUMERS * 4);
            fg::mbar_init(v_empty(s), NUM_CONSUMERS * 4);
        }
        fg::fence_barrier_init();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's TMA sees them
    }
    // Which (batch, head, query block) this CTA computes (common/tile_order.cuh); heaviest causal blocks first.
    const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const fg::TileCoord tc = fg::grid_tile_coord(batch * heads_q, gridDim.y, blockIdx.x, blockIdx.y);  // the grid holds the order (common/tile_order.cuh)
    if (tc.bh < 0) return;  // a hole: this CTA's group has one head fewer
    const int m_rev = tc.m_rev, bh = tc.bh;
    const int m_block = num_m_blocks - 1 - m_rev;
    const int b = bh / heads_q;
    const int h = bh % heads_q;
    const int h_kv = h / (heads_q / heads_kv);
    const int m0 = m_block * BLOCK_M;
    // Q before the walk, which it does not need (a CTA without live blocks waits for it to land
    // before its epilogue stages O in sQ).
    if (threadIdx.x == 0) {
        fg::mbar_arrive_expect_tx(q_full, SQ_BYTES);
        #pragma unroll
        for (int c = 0; c < DCB; ++c)
            fg::tma_load_4d(sQ + c * BLOCK_M * 128, &tma_q, c * 64, m0, h, b, q_full);
    }
    // Key blocks are visited last to first, live ones only: prev_live(j, c) is the last live key block
    // at or before j (-1 if none) and sets c to its class.
    const int n_kv_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
    // kv_class(j0, j1): the class of this CTA's query rows against key blocks j0..j1 (clipped to
    // seqlen_k) under the whole mask.
    const int m_last = min(m0 + BLOCK_M, seqlen_q) - 1;
    auto kv_class = [&](int j0, int j1) {
        const int k0 = j0 * BLOCK_N, k1 = min((j1 + 1) * BLOCK_N, seqlen_k) - 1;
        return fg_tile_class(m0, m_last, k0, k1, b, h, h_kv, seqlen_q, seqlen_k, p_chunk);
    };
    // Warp 0 finds the first block (one classifier call per lane for 32 blocks) and its walk goes
    // on from there; the other warps read the block after the barrier (flashgen/families/hopper_fwd.py, single_walk:
    // all twelve classifying at once shared the issue slots of warp 0's walk).
    fg::iv::WarpWalk walk;
    auto prev_live = [&](int j, int& c) { return walk.prev_live(j, c, kv_class); };
    int cls = fg::iv::EMPTY;
    // causal: the key blocks past the one of the last row's diagonal are EMPTY (flashgen/families/hopper_fwd.py,
    // walk_from_diagonal): the walk starts there.
    const int diag_k = m_last + seqlen_k - seqlen_q;  // the last key the last row may keep
    const int walk_start = diag_k < 0 ? -1 : min(n_kv_blocks - 1, diag_k / BLOCK_N);
    int first_block = -1;
    if (threadIdx.x < 32) {
        first_block = prev_live(walk_start, cls);
        if (threadIdx.x == 0) *first_slot = first_block;  // read after __syncthreads below
    }

    // Publish key block n_block (class c) in ring stage it % STAGES and load it (warp 0, lane 0
    // issuing), STAGES ahead of the consumers; the walk first finds the next live block, returned
    // (c becomes its class).  after_k() runs between the K and the V load (the persistent kernel
    // hands a tile over there, after the tile's first K).
    auto load_block = [&](int it, int n_block, int& c, auto&& after_k) {
        const int n0 = n_block * BLOCK_N, n_cls = c;
        const int n_next = prev_live(n_block - 1, c);
        const int s = it % STAGES;
        const uint32_t phase = (it / STAGES) & 1;
        fg::mbar_wait(k_empty(s), phase ^ 1);
        if (threadIdx.x == 0) {
            stage_info[2 * s] = n0;
            stage_info[2 * s + 1] = n_cls | (n_next < 0 ? 0x100 : 0);
            fg::mbar_arrive_expect_tx(k_full(s), SKV_BYTES);  // releases stage_info[s] with the K tile
            #pragma unroll
            for (int c = 0; c < DCB; ++c)
                fg::tma_load_4d(sK + s * SKV_BYTES + c * BLOCK_N * 128, &tma_k, c * 64, n0, h_kv, b, k_full(s));
        }
        after_k();
        fg::mbar_wait(v_empty(s), phase ^ 1);
        if (threadIdx.x == 0) {
            fg::mbar_arrive_expect_tx(v_full(s), SKV_BYTES);
            #pragma unroll
            for (int c = 0; c < DCB; ++c)
                fg::tma_load_4d(sV + s * SKV_BYTES + c * BLOCK_N * 128, &tma_v, c * 64, n0, h_kv, b, v_full(s));
        }
        return n_next;
    };
    // The first block goes out before the barrier (its ring stage is free), and before the
    // walk to the next live block, which its stage_info's last flag needs: k_full(0) expects
    // K's bytes at once and gets its arrival once stage_info[0] is written, so the consumers
    // see the two together, and the walk runs while K and V are in flight.
    int next_block = -1;
    if (threadIdx.x < 32 && first_block >= 0) {
        __syncwarp();  // every lane of warp 0 sees thread 0's barrier init
        const int n0 = first_block * BLOCK_N, n_cls = cls;
        if (threadIdx.x == 0) {
            fg::mbar_expect_tx(k_full(0), SKV_BYTES);
            #pragma unroll
            for (int c = 0; c < DCB; ++c)
                fg::tma_load_4d(sK + c * BLOCK_N * 128, &tma_k, c * 64, n0, h_kv, b, k_full(0));
            fg::mbar_arrive_expect_tx(v_full(0), SKV_BYTES);
            #pragma unroll
            for (int c = 0; c < DCB; ++c)
                fg::tma_load_4d(sV + c * BLOCK_N * 128, &tma_v, c * 64, n0, h_kv, b, v_full(0));
        }
        next_block = prev_live(first_block - 1, cls);
        if (threadIdx.x == 0) {
            stage_info[0] = n0;
            stage_info[1] = n_cls | (next_block < 0 ? 0x100 : 0);
            fg::mbar_arrive(k_full(0));  // releases stage_info[0]
        }
    }
    __syncthreads();
    if (threadIdx.x >= 32) first_block = *first_slot;

    if (threadIdx.x < 128) {
        // ------------------------------------------------------------ producer warpgroup
        fg::setmaxnreg_dec<56>();
        // Warp 0 walks the key blocks, all lanes together (the walk is warp-wide); lane 0 issues the
        // TMA loads and the arrivals.
        if (threadIdx.x < 32 && first_block >= 0) {
            // Walk the KV blocks last to first (the causal diagonal block first).
            for (int it = 1, n_block = next_block; n_block >= 0; ++it) n_block = load_block(it, n_block, cls, [] {});
        }
        return;
    }

    // ---------------------------------------------------------------- consumer warpgroups
    // Per KV block j (FA3 Algorithm 2 with ping-pong, section 3.1-3.2): issue S_j = Q K_j^T and
    // O += P_{j-1} V_{j-1} together, then the softmax of S_j runs while the second GEMM (and the
    // other consumer warpgroup's GEMMs) occupy the tensor cores.  Named barriers PP0/PP1 make the
    // two consumer warpgroups take turns issuing GEMMs.
    fg::setmaxnreg_inc<224>();
    const int cg = threadIdx.x / 128 - 1;          // consumer warpgroup
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row_base = cg * 64 + warp * 16 + lane / 4;  // this thread's rows: row_base, row_base + 8
    const float scale_log2 = softmax_scale * LOG2E;
    // Kernel-invariant divisors of the mask / score_mod (lower.Invariants), computed once.
    const fg::Divisor fg_inv0(p_chunk);

    constexpr int PP_BARRIER = 3;                   // named barriers 3 and 4: "consumer c may issue"
    auto pp_wait = [&]() { fg::named_barrier_sync(PP_BARRIER + cg, 256); };
    auto pp_pass = [&]() { fg::named_barrier_arrive(PP_BARRIER + (1 - cg), 256); };

    float acc_o[NO * 4];
    float acc_s[NS * 4];
    uint32_t frag_p[BLOCK_N / 16][4];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
    #pragma unroll
    for (int i = 0; i < NO * 4; ++i) acc_o[i] = 0.f;

    // S = Q K^T for ring stage s: HEAD_DIM / 16 wgmmas, operands straight from the swizzled tiles.
    auto issue_s = [&](int s) {
        fg::wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            const uint32_t col = (kk / 4) * 128u, sub = (kk % 4) * 32u;
            const uint64_t da = fg::gmma_desc(sQ + col * BLOCK_M + cg * 64 * 128 + sub, 16, 1024);
            const uint64_t db = fg::gmma_desc(sK + s * SKV_BYTES + col * BLOCK_N + sub, 16, 1024);
            fg::wgmma_ss_n160(acc_s, da, db, kk > 0);
        }
        fg::wgmma_commit();
    };
    // O = alpha * O + P V for ring stage s: BLOCK_N / 16 wgmmas, V read N-major (transposed).
    auto issue_pv = [&](int s) {
        #pragma unroll
        for (int j = 0; j < NO; ++j)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[4 * j + i] *= alpha[i / 2];
        fg::fence_regs(acc_o);
        fg::wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            fg::wgmma_rs_n128(acc_o, frag_p[kk], fg::gmma_desc(sV + s * SKV_BYTES + kk * 16 * 128, BLOCK_N * 128, 1024));
        fg::wgmma_commit();
    };
    // Online softmax of S (block at key n0) in raw score units: only edge blocks (past seqlen_k,
    // or not FULL under the mask) evaluate the mask; scale and max fold into one FFMA per
    // element, P = exp2(s * scale_log2 - max * scale_log2).  row_max is in raw units.
    auto softmax = [&](int n0, int tile_cls) {
        if (tile_cls != fg::iv::FULL || n0 + BLOCK_N > seqlen_k) {
            if (tile_cls & fg::iv::CAUSAL_ONLY) {  // the mask is causal on this tile
            int col_lim[2];
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q_row = m0 + fg::iv::opaque(row_base) + r * 8;  // opaque: not hoisted out of the key loop
                int lim = seqlen_k - 1;
                lim = min(lim, q_row + seqlen_k - seqlen_q);
                col_lim[r] = lim - n0 - (lane % 4) * 2;
            }

            #pragma unroll
            for (int j = 0; j < NS; ++j) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int q_raw = m0 + row_base + (i / 2) * 8;
                    const int kv_raw = n0 + j * 8 + (lane % 4) * 2 + (i % 2);
                    (void)q_raw; (void)kv_raw;
                    const bool keep = (j * 8 + i % 2 <= col_lim[i / 2]);
                    if (!keep) acc_s[4 * j + i] = -INFINITY;
                }
            }

            } else if (tile_cls & fg::iv::NO_CAUSAL) {  // causal holds on the whole tile
            int col_lim[2];
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q_row = m0 + fg::iv::opaque(row_base) + r * 8;  // opaque: not hoisted out of the key loop
                int lim = seqlen_k - 1;
                col_lim[r] = lim - n0 - (lane % 4) * 2;
            }

            #pragma unroll
            for (int j = 0; j < NS; ++j) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int q_raw = m0 + row_base + (i / 2) * 8;
                    const int kv_raw = n0 + j * 8 + (lane % 4) * 2 + (i % 2);
                    // The DSL sees indices clamped into range (and float twins); out-of-range pairs
                    // are dropped anyway (a mask without tensor reads sees kv_raw: the column limit drops the columns past seqlen_k before their value counts).
                    const int q_idx = min(q_raw, seqlen_q - 1);
                    const int kv_idx = kv_raw;
                    const float q_idx_f = (float)q_idx;
                    const float kv_idx_f = (float)kv_idx;
                    (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f;
                    (void)q_raw; (void)kv_raw;
                    const bool keep = (j * 8 + i % 2 <= col_lim[i / 2])
                                      & ((fg_inv0.div(((q_idx + seqlen_k) - seqlen_q)) == fg_inv0.div_nn(kv_idx)));
                    if (!keep) acc_s[4 * j + i] = -INFINITY;
                }
            }

            } else {
            int col_lim[2];
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q_row = m0 + fg::iv::opaque(row_base) + r * 8;  // opaque: not hoisted out of the key loop
                int lim = seqlen_k - 1;
                if (IS_CAUSAL) lim = min(lim, q_row + seqlen_k - seqlen_q);
                col_lim[r] = lim - n0 - (lane % 4) * 2;
            }

            #pragma unroll
            for (int j = 0; j < NS; ++j) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int q_raw = m0 + row_base + (i / 2) * 8;
                    const int kv_raw = n0 + j * 8 + (lane % 4) * 2 + (i % 2);
                    // The DSL sees indices clamped into range (and float twins); out-of-range pairs
                    // are dropped anyway (a mask without tensor reads sees kv_raw: the column limit drops the columns past seqlen_k before their value counts).
                    const int q_idx = min(q_raw, seqlen_q - 1);
                    const int kv_idx = kv_raw;
                    const float q_idx_f = (float)q_idx;
                    const float kv_idx_f = (float)kv_idx;
                    (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f;
                    (void)q_raw; (void)kv_raw;
                    const bool keep = (j * 8 + i % 2 <= col_lim[i / 2])
                                      & ((fg_inv0.div(((q_idx + seqlen_k) - seqlen_q)) == fg_inv0.div_nn(kv_idx)));
                    if (!keep) acc_s[4 * j + i] = -INFINITY;
                }
            }

            }

        }
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
            #pragma unroll
            for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float base = mx == -INFINITY ? 0.f : mx * scale_log2;  // a fully masked row so far stays at 0
            alpha[r] = fg::exp2_approx(row_max[r] * scale_log2 - base);
            row_max[r] = mx;
            float sum = 0.f;
            #pragma unroll
            for (int j = 0; j < NS; ++j)
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = fg::exp2_approx(fmaf(acc_s[4 * j + 2 * r + e], scale_log2, -base));
                    acc_s[4 * j + 2 * r + e] = p;
                    sum += p;
                }
            row_sum[r] = row_sum[r] * alpha[r] + sum;
        }
    };
    auto row_max_log2 = [&](int r) { return row_max[r] * scale_log2; };
    // P to 16-bit A fragments: the accumulator layout of two 8-column tiles is the A layout of one k16 step.
    auto pack_p = [&]() {
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            frag_p[kk][0] = Mma::pack(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
            frag_p[kk][1] = Mma::pack(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
            frag_p[kk][2] = Mma::pack(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
            frag_p[kk][3] = Mma::pack(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
        }
    };

    if (first_block >= 0) {
        if (cg == 1) fg::named_barrier_arrive(PP_BARRIER, 256);  // consumer 0 issues first
        // The first live block: S only.  The producer tells each stage's block and class (stage_info).
        fg::mbar_wait(q_full, 0);
        fg::mbar_wait(k_full(0), 0);
        int info_n0 = stage_info[0], info_cls = stage_info[1];
        pp_wait();
        issue_s(0);
        pp_pass();
        fg::wgmma_wait<0>();
        fg::fence_regs(acc_s);
        if (lane == 0) fg::mbar_arrive(k_empty(0));
        softmax(info_n0, info_cls & 0xff);
        pack_p();
        int it = 1;
        for (bool more = !(info_cls & 0x100); more; ++it) {
            const int s = it % STAGES, s_prev = (it - 1) % STAGES;
            fg::mbar_wait(k_full(s), (it / STAGES) & 1);
            info_n0 = stage_info[2 * s];
            info_cls = stage_info[2 * s + 1];
            more = !(info_cls & 0x100);
            pp_wait();
            issue_s(s);
            fg::mbar_wait(v_full(s_prev), ((it - 1) / STAGES) & 1);
            issue_pv(s_prev);
            pp_pass();
            fg::wgmma_wait<1>();       // S_it has landed; P_{it-1} V_{it-1} may still run
            fg::fence_regs(acc_s);
            if (lane == 0) fg::mbar_arrive(k_empty(s));
            softmax(info_n0, info_cls & 0xff);
            fg::wgmma_wait<0>();
            fg::fence_regs(acc_o);
            if (lane == 0) fg::mbar_arrive(v_empty(s_prev));
            pack_p();
        }
        // Last P V.
        const int s_last = (it - 1) % STAGES;
        fg::mbar_wait(v_full(s_last), ((it - 1) / STAGES) & 1);
        issue_pv(s_last);
        fg::wgmma_wait<0>();
        fg::fence_regs(acc_o);
        if (lane == 0) fg::mbar_arrive(v_empty(s_last));
        if (cg == 0) pp_wait();  // consume consumer 1's last pass: the barriers end balanced
    }
    else {
        fg::mbar_wait(q_full, 0);  // Q went out before the walk: it lands before the epilogue stages O in sQ
    }

    // Epilogue: O / row_sum into this warpgroup's rows of sQ (same swizzle), then 16-byte stores.
    const int64_t lse_row0 = (int64_t)bh * seqlen_q;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        const bool empty = sum == 0.f || row_max[r] == -INFINITY;
        const float inv = empty ? 0.f : 1.f / sum;
        const int row = row_base + r * 8;
        #pragma unroll
        for (int j = 0; j < NO; ++j) {
            const uint32_t packed = Mma::pack(acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv);
            const uint32_t addr = sQ + (j / 8) * BLOCK_M * 128 + row * 128 + (((j % 8) ^ (row % 8)) << 4) + (lane % 4) * 4;
            asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(packed));
        }
        if (lane % 4 == 0 && m0 + row < seqlen_q)
            lse[lse_row0 + m0 + row] = empty ? -INFINITY : (row_max_log2(r) + __log2f(sum)) * LN2;
    }
    fg::named_barrier_sync(1 + cg, 128);
    elem_t* o_blk = o + b * o_sb + h * o_sh + (int64_t)m0 * o_ss;
    const int t = threadIdx.x % 128;
    #pragma unroll
    for (int i = t; i < 64 * NO; i += 128) {
        const int row = cg * 64 + i / NO, chunk = i % NO;
        if (m0 + row < seqlen_q) {
            uint4 val;
            const uint32_t addr = sQ + (chunk / 8) * BLOCK_M * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
            asm volatile("ld.shared.v4.b32 { %0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(addr));
            *reinterpret_cast<uint4*>(o_blk + row * o_ss + chunk * 8) = val;
        }
    }
}
