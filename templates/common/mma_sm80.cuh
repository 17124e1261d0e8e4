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
