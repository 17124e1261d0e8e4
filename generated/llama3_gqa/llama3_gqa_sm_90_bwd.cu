// flashgen backward kernels, FA2-class (Dao 2023, "FlashAttention-2", Algorithm 2), for sm_80 and later.
// Spec: llama3_gqa   dtype bf16   head_dim 128/128   causal True
//
// Three kernels, one translation unit; P is recomputed from the saved lse, never stored:
//   flashgen_llama3_gqa_bwd_sm_90_pre   dsum = rowsum(dO * O), one warp per query row
//   flashgen_llama3_gqa_bwd_sm_90_dkdv  KV outer / Q inner: dV = P^T dO, dK = scale * dS^T Q, summed over the GQA group
//   flashgen_llama3_gqa_bwd_sm_90_dq    Q outer / KV inner: dQ = scale * dS K
// with dS = P * (dP - dsum) * d score_mod / d score and dP = dO V^T.  No atomics anywhere:
// each output element is owned by one thread, so gradients are bitwise reproducible.
//
// Glossary
//   KV_N, KV_M  dkdv: key rows per CTA (16 per warp); query rows per inner step
//   DSPLIT      dkdv: CTAs sharing one key block, each owning HEAD_DIM/DSPLIT columns of dK, dV
//   DQ_M, DQ_N  dq: query rows per CTA (16 per warp); key rows per inner step
//   acc_s       S (or S^T) for this warp's 16 rows, then P
//   acc_dp      dP (or dP^T), then dS
//   sLse        dkdv: the step's lse (async_stats: natural log as stored, scaled by log2(e) where read;
//               else lse * log2(e), +inf for rows with nothing to attend to)
// Block sparsity: fg_tile_class (flashgen/analysis/masktiles.py) classifies (query block, key block) tiles by interval
// arithmetic over the mask; both inner loops visit live (not EMPTY) blocks only, found with fg::iv::next_live
// and prefetched as such, and FULL tiles inside seqlen_k evaluate no mask.
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

// Tile class of spec llama3_gqa's mask (flashgen/analysis/masktiles.py; rules of maskinfo.py).
__host__ __device__ __forceinline__ int fg_tile_class(int q0, int q1, int k0, int k1, int b, int h, int h_kv, int seqlen_q, int seqlen_k) {
    (void)b; (void)h; (void)seqlen_q; (void)seqlen_k;
    const fg::iv::R q_r = fg::iv::range((double)q0, (double)q1);
    const fg::iv::R kv_r = fg::iv::range((double)k0, (double)k1);
    (void)q_r; (void)kv_r;
    const fg::iv::R e0 = fg::iv::exact((double)seqlen_k - (double)seqlen_q);
    const fg::iv::R e1 = fg::iv::add(q_r, e0);
    const fg::iv::T e2 = fg::iv::ge(e1, kv_r);
    return fg::iv::tile_class(e2);
}


namespace {
constexpr int HEAD_DIM = 128;
constexpr int HEAD_DIM_V = 128;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;
// Byte sizes follow the element type (the plan's dtype record: elem_t and its elem_bytes, with which the
// plan sized the kernels' shared memory).  The mma.sync m16n8k16 / ldmatrix .b16 fragments take 16-bit
// elements: a 16-column fragment is two 16-byte chunks (the fragment indices below count so).
constexpr int ELEM_BYTES = sizeof(elem_t);
constexpr int CHUNK_ELEMS = 16 / ELEM_BYTES;  // elements per 16-byte chunk (cp.async, an ldmatrix row, fg::swz)
static_assert(sizeof(elem_t) == sizeof(uint16_t), "mma.sync m16n8k16 and ldmatrix .b16: 16-bit elements");
constexpr int QK_ROW_BYTES = HEAD_DIM * ELEM_BYTES;
constexpr int V_ROW_BYTES = HEAD_DIM_V * ELEM_BYTES;
constexpr bool IS_CAUSAL = true;
constexpr float LOG2E = 1.4426950408889634f;

constexpr int PRE_WARPS = 8;
constexpr int KV_N = 64;
constexpr int KV_M = 32;
constexpr int KV_WARPS = 4;
constexpr int DSPLIT = 1;
constexpr int DK_COLS = HEAD_DIM / DSPLIT;
constexpr int DV_COLS = HEAD_DIM_V / DSPLIT;
constexpr int DQ_M = 64;
constexpr int DQ_N = 32;
constexpr int DQ_WARPS = 4;
static_assert(KV_N == 16 * KV_WARPS && DQ_M == 16 * DQ_WARPS, "one 16-row mma tile per warp");
static_assert(KV_M % 16 == 0 && DQ_N % 16 == 0 && DK_COLS % 16 == 0 && DV_COLS % 16 == 0, "tiles");
static_assert(QK_ROW_BYTES % 64 == 0 && V_ROW_BYTES % 64 == 0, "rows of a multiple of 64 bytes (fg::swz)");

// ROWS x COLS elements (row stride `stride`) into a swizzled tile by THREADS threads; rows >= valid_rows read 0.
// When THREADS covers whole rows: a compile-time trip count and one pointer per thread (see fwd.cu.j2).
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t dst, const elem_t* src, int64_t stride, int valid_rows) {
    constexpr int CHUNKS_PER_ROW = COLS / CHUNK_ELEMS;
    constexpr int ROW_BYTES = COLS * ELEM_BYTES;
    if constexpr (THREADS % CHUNKS_PER_ROW == 0 && ROWS % (THREADS / CHUNKS_PER_ROW) == 0) {
        constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
        const int row0 = threadIdx.x / CHUNKS_PER_ROW, chunk = threadIdx.x % CHUNKS_PER_ROW;
        const elem_t* g0 = src + row0 * stride + chunk * CHUNK_ELEMS;
        #pragma unroll
        for (int it = 0; it < ROWS / ROW_STEP; ++it) {
            const int row = row0 + it * ROW_STEP;
            const bool valid = row < valid_rows;
            fg::cp_async_16(dst + fg::swz(row, chunk, ROW_BYTES), valid ? g0 + it * ROW_STEP * stride : src, valid);
        }
        return;
    }
    #pragma unroll
    for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
        const int row = i / CHUNKS_PER_ROW, chunk = i % CHUNKS_PER_ROW;
        const bool valid = row < valid_rows;
        fg::cp_async_16(dst + fg::swz(row, chunk, ROW_BYTES), src + (valid ? row * stride + chunk * CHUNK_ELEMS : 0), valid);
    }
}

// fg::swz(row0 + r, chunk0 + c, row_bytes) for row0 % 8 == 0, even chunk0, per-lane r < 16 and c in {0, 1}.
// Rows a multiple of 128 bytes (bwd_hoisted_swizzle): the lane's part fg::swz(r, c) is XORed with a constant
// and offset by an immediate instead of re-deriving the swizzle per fragment (see swz_at in fwd.cu.j2).
__device__ __forceinline__ uint32_t swz_lane(int row0, int chunk0, int r, int c, int row_bytes) {
    if (row_bytes % 128 == 0)
        return (fg::swz(r, c, row_bytes) ^ ((chunk0 & 7) << 4)) + row0 * row_bytes + (chunk0 & ~7) * 16;
    return fg::swz(row0 + r, chunk0 + c, row_bytes);
}

// acc (16 x 8*NT, this warp) = A (16 x K rows of `a_tile` starting at a_row) * B^T (8*NT rows of `b_tile`), K = 16*KSTEPS.
template <int NT, int KSTEPS>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], uint32_t a_tile, int a_row, uint32_t b_tile, int row_bytes, int lane) {
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        fg::ldmatrix_x4(a, a_tile + swz_lane(a_row, kk * 2, lane % 16, lane / 16, row_bytes));
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            fg::ldmatrix_x4(b, b_tile + swz_lane(np * 16, kk * 2, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2, row_bytes));
            Mma::run(acc[2 * np], a, b[0], b[1]);
            Mma::run(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x 8*DT) += P (16 x 8*NT, registers) * B (8*NT rows of `b_tile`, columns from chunk c0 on).
template <int NT, int DT>
__device__ __forceinline__ void gemm_pb(float (&acc)[DT][4], const float (&p)[NT][4], uint32_t b_tile, int c0, int row_bytes, int lane) {
    #pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        uint32_t a[4];
        a[0] = Mma::pack(p[2 * kk][0], p[2 * kk][1]);
        a[1] = Mma::pack(p[2 * kk][2], p[2 * kk][3]);
        a[2] = Mma::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = Mma::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        #pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            uint32_t b[4];
            fg::ldmatrix_x4_trans(b, b_tile + swz_lane(kk * 16, c0 + dp * 2, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16, row_bytes));
            Mma::run(acc[2 * dp], a, b[0], b[1]);
            Mma::run(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// Store a warp's 16 x 8*DT accumulator tile, times `scale`, as elem_t pairs; rows >= valid_rows skipped.
template <int DT>
__device__ __forceinline__ void store_acc(elem_t* dst, int64_t row_stride, const float (&acc)[DT][4], float scale, int valid_rows, int lane) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = lane / 4 + r * 8;
        if (row < valid_rows) {
            #pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const uint32_t packed = Mma::pack(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
                *reinterpret_cast<uint32_t*>(dst + row * row_stride + dt * 8 + (lane % 4) * 2) = packed;
            }
        }
    }
}

__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * LOG2E; }

// 4-byte global->shared async copy; !valid reads nothing and writes 0.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
}  // namespace


extern "C" __global__ void __launch_bounds__(PRE_WARPS * 32) flashgen_llama3_gqa_bwd_sm_90_pre(
    const __nv_bfloat16* __restrict__ o,
    const __nv_bfloat16* __restrict__ dout,
    float* __restrict__ dsum,
    int64_t o_sb,
    int64_t o_sh,
    int64_t o_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int batch,
    int heads_q,
    int seqlen_q
) {
    const int64_t row = (int64_t)blockIdx.x * PRE_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (int64_t)batch * heads_q * seqlen_q) return;
    const int64_t s = row % seqlen_q, bh = row / seqlen_q;
    const int64_t bb = bh / heads_q, hh = bh % heads_q;
    const elem_t* o_row = o + bb * o_sb + hh * o_sh + s * o_ss;
    const elem_t* do_row = dout + bb * dout_sb + hh * dout_sh + s * dout_ss;
    float acc = 0.f;
    #pragma unroll
    for (int c = lane * 2; c < HEAD_DIM_V; c += 64)
        acc += fg::to_float(o_row[c]) * fg::to_float(do_row[c]) + fg::to_float(o_row[c + 1]) * fg::to_float(do_row[c + 1]);
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane == 0) dsum[row] = acc;
}

extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, 1) flashgen_llama3_gqa_bwd_sm_90_dkdv(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse,
    const float* __restrict__ dsum,
    __nv_bfloat16* __restrict__ dk,
    __nv_bfloat16* __restrict__ dv,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int64_t dk_sb,
    int64_t dk_sh,
    int64_t dk_ss,
    int64_t dv_sb,
    int64_t dv_sh,
    int64_t dv_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale
) {
    constexpr int THREADS = KV_WARPS * 32;
    constexpr int NT = KV_M / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sK = fg::smem_u32(smem);
    const uint32_t sV = sK + KV_N * QK_ROW_BYTES;
    const uint32_t sQ0 = sV + KV_N * V_ROW_BYTES;                 // stage s: sQ0 + s * STAGE_BYTES
    constexpr int STAGE_BYTES = KV_M * (QK_ROW_BYTES + V_ROW_BYTES);
    float* sLse = reinterpret_cast<float*>(smem + KV_N * (QK_ROW_BYTES + V_ROW_BYTES) + 2 * STAGE_BYTES);
    float* sDsum = sLse + 2 * KV_M;
    static_assert(KV_N * (QK_ROW_BYTES + V_ROW_BYTES) + 2 * STAGE_BYTES + 4 * KV_M * 4 == 66048,
                  "dynamic shared memory: the plan's smem_bytes must match this layout");

    // Which (batch, kv head, key block, column split) this CTA owns.
    const int n_blocks = (seqlen_k + KV_N - 1) / KV_N;
    const int split = blockIdx.x % DSPLIT;
    const int rest = blockIdx.x / DSPLIT;
    const int n_block = rest % n_blocks;
    const int bhkv = rest / n_blocks;
    const int b = bhkv / heads_kv, h_kv = bhkv % heads_kv;
    const int group = heads_q / heads_kv;
    const int n0 = n_block * KV_N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Steps: (query head h_kv * group + hg, query block mb) pairs whose tile with this key block is live.
    // q_class(h, i0, i1): class of query blocks i0..i1 of head h (clipped to seqlen_q) against this key block.
    const int m_blocks = (seqlen_q + KV_M - 1) / KV_M;
    const int n_last_row = min(n0 + KV_N, seqlen_k) - 1;
    // The key bounds pass through fg::iv::opaque: the classifier's key-only terms are then recomputed per call
    // instead of being hoisted out of the loop into registers this kernel does not have.
    auto q_class = [&](int h, int i0, int i1) {
        const int q0 = i0 * KV_M, q1 = min((i1 + 1) * KV_M, seqlen_q) - 1;
        return fg_tile_class(q0, q1, fg::iv::opaque(n0), fg::iv::opaque(n_last_row), b, h, h_kv, seqlen_q, seqlen_k);
    };
    // The first live step at or after (hg, mb), in head-major order; hg == group when there is none.
    // full: query blocks of head hg up to this one are FULL (reset for each head).
    int full = -1;
    auto next_step = [&](int& hg, int& mb, int& cls) {
        for (; hg < group; ++hg, mb = 0, full = -1) {
            const int hh = h_kv * group + hg;
            mb = fg::iv::next_live(mb, m_blocks, cls, full, [&](int i0, int i1) { return q_class(hh, i0, i1); });
            if (mb < m_blocks) return;
        }
    };

    load_tile<KV_N, HEAD_DIM, THREADS>(sK, k + b * k_sb + h_kv * k_sh + (int64_t)n0 * k_ss, k_ss, seqlen_k - n0);
    load_tile<KV_N, HEAD_DIM_V, THREADS>(sV, v + b * v_sb + h_kv * v_sh + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
    fg::cp_async_commit();

    // Load step (query head hh, query block mb) into `stage`.
    auto issue = [&](int hh, int mb, int stage) {
        const int m0 = mb * KV_M;
        const uint32_t sQ = sQ0 + stage * STAGE_BYTES;
        load_tile<KV_M, HEAD_DIM, THREADS>(sQ, q + b * q_sb + hh * q_sh + (int64_t)m0 * q_ss, q_ss, seqlen_q - m0);
        load_tile<KV_M, HEAD_DIM_V, THREADS>(sQ + KV_M * QK_ROW_BYTES, dout + b * dout_sb + hh * dout_sh + (int64_t)m0 * dout_ss, dout_ss, seqlen_q - m0);
        const int64_t stat0 = ((int64_t)b * heads_q + hh) * seqlen_q + m0;
        // Raw lse and dsum ride in the same cp.async group as Q and dO (no global-load stall here);
        // rows past seqlen_q read as 0, harmless: their logits are -inf, or on a FULL tile (keep = true) their
        // Q and dO rows are zero-filled, so their P and dS add nothing.
        for (int i = threadIdx.x; i < KV_M; i += THREADS) {
            const bool valid = m0 + i < seqlen_q;
            cp_async_4(fg::smem_u32(sLse + stage * KV_M + i), lse + (valid ? stat0 + i : 0), valid);
            cp_async_4(fg::smem_u32(sDsum + stage * KV_M + i), dsum + (valid ? stat0 + i : 0), valid);
        }
    };
    int hg = 0, mb = 0, cls = fg::iv::EMPTY;
    next_step(hg, mb, cls);
    if (hg < group) issue(h_kv * group + hg, mb, 0);
    fg::cp_async_commit();

    float acc_dk[DK_COLS / 8][4], acc_dv[DV_COLS / 8][4];
    #pragma unroll
    for (int dt = 0; dt < DK_COLS / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dk[dt][i] = 0.f;
    #pragma unroll
    for (int dt = 0; dt < DV_COLS / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dv[dt][i] = 0.f;

    for (int stage = 0; hg < group; stage ^= 1) {
        // Prefetch the next live step into the other stage, then wait for this one.
        int hg_next = hg, mb_next = mb + 1, cls_next = fg::iv::EMPTY;
        next_step(hg_next, mb_next, cls_next);
        if (hg_next < group) {
            issue(h_kv * group + hg_next, mb_next, stage ^ 1);
            fg::cp_async_commit();
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            fg::cp_async_wait_all();
        }
        __syncthreads();
        const int h = h_kv * group + hg;
        const int m0 = mb * KV_M;
        const uint32_t sQ = sQ0 + stage * STAGE_BYTES;
        const uint32_t sDO = sQ + KV_M * QK_ROW_BYTES;
        const float* lse_s = sLse + stage * KV_M;
        const float* dsum_s = sDsum + stage * KV_M;

        // S^T = K Q^T and dP^T = V dO^T for this warp's 16 key rows.
        float acc_s[NT][4], acc_dp[NT][4];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) { acc_s[nt][i] = 0.f; acc_dp[nt][i] = 0.f; }
        gemm_abt<NT, HEAD_DIM / 16>(acc_s, sK, warp * 16, sQ, QK_ROW_BYTES, lane);
        gemm_abt<NT, HEAD_DIM_V / 16>(acc_dp, sV, warp * 16, sDO, V_ROW_BYTES, lane);

        // P^T from the saved lse; dS^T = P^T (dP^T - dsum) * d score_mod / d score.  The mask only on tiles
        // that are not FULL, or cross seqlen_k.
        if (cls != fg::iv::FULL || n0 + KV_N > seqlen_k) {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int qi = nt * 8 + (lane % 4) * 2 + (i % 2);
                const int q_idx = min((m0 + qi), seqlen_q - 1);
                const int kv_idx = min((n0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_k - 1);
                const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;  // float twins
                const bool keep = (m0 + qi) < seqlen_q && (n0 + warp * 16 + lane / 4 + (i / 2) * 8) < seqlen_k
                                  && (!IS_CAUSAL || (n0 + warp * 16 + lane / 4 + (i / 2) * 8) <= (m0 + qi) + seqlen_k - seqlen_q);
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f; (void)g;

                // lse is -inf only on rows that attend to nothing, where keep is false everywhere.
                const float p = keep ? fg::exp2_approx(x - lse_s[qi] * LOG2E) : 0.f;
                acc_s[nt][i] = p;
                acc_dp[nt][i] = p * (acc_dp[nt][i] - dsum_s[qi]) * g;
            }
        } else {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int qi = nt * 8 + (lane % 4) * 2 + (i % 2);
                const int q_idx = min((m0 + qi), seqlen_q - 1);
                const int kv_idx = min((n0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_k - 1);
                const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;  // float twins
                constexpr bool keep = true;
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f; (void)g;

                // lse is -inf only on rows that attend to nothing, where keep is false everywhere.
                const float p = keep ? fg::exp2_approx(x - lse_s[qi] * LOG2E) : 0.f;
                acc_s[nt][i] = p;
                acc_dp[nt][i] = p * (acc_dp[nt][i] - dsum_s[qi]) * g;
            }
        }

        // dV += P^T dO and dK += dS^T Q (this CTA's column split).
        gemm_pb<NT, DV_COLS / 8>(acc_dv, acc_s, sDO, split * (DV_COLS / CHUNK_ELEMS), V_ROW_BYTES, lane);
        gemm_pb<NT, DK_COLS / 8>(acc_dk, acc_dp, sQ, split * (DK_COLS / CHUNK_ELEMS), QK_ROW_BYTES, lane);
        __syncthreads();  // this stage is refilled by the prefetch two live steps on
        hg = hg_next;
        mb = mb_next;
        cls = cls_next;
    }
    fg::cp_async_wait_all();

    const int row0 = n0 + warp * 16;
    store_acc<DK_COLS / 8>(dk + b * dk_sb + h_kv * dk_sh + (int64_t)row0 * dk_ss + split * DK_COLS, dk_ss, acc_dk, softmax_scale, seqlen_k - row0, lane);
    store_acc<DV_COLS / 8>(dv + b * dv_sb + h_kv * dv_sh + (int64_t)row0 * dv_ss + split * DV_COLS, dv_ss, acc_dv, 1.f, seqlen_k - row0, lane);
}

extern "C" __global__ void __launch_bounds__(DQ_WARPS * 32, 1) flashgen_llama3_gqa_bwd_sm_90_dq(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse,
    const float* __restrict__ dsum,
    __nv_bfloat16* __restrict__ dq,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int64_t dq_sb,
    int64_t dq_sh,
    int64_t dq_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale
) {
    constexpr int THREADS = DQ_WARPS * 32;
    constexpr int NT = DQ_N / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = fg::smem_u32(smem);
    const uint32_t sDO = sQ + DQ_M * QK_ROW_BYTES;
    const uint32_t sK0 = sDO + DQ_M * V_ROW_BYTES;                 // stage s: sK0 + s * STAGE_BYTES
    constexpr int STAGE_BYTES = DQ_N * (QK_ROW_BYTES + V_ROW_BYTES);
    static_assert(DQ_M * (QK_ROW_BYTES + V_ROW_BYTES) + 2 * STAGE_BYTES == 65536,
                  "dynamic shared memory: the plan's smem_bytes must match this layout");

    const int m_blocks = (seqlen_q + DQ_M - 1) / DQ_M;
    const int m_rev = blockIdx.x % m_blocks;
    const int m_block = m_blocks - 1 - m_rev;  // masked: last blocks first
    const int bh = blockIdx.x / m_blocks;
    const int b = bh / heads_q, h = bh % heads_q;
    const int h_kv = h / (heads_q / heads_kv);
    const int m0 = m_block * DQ_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Key blocks visited first to last, live ones only: kv_class(j0, j1) is the class of this CTA's query
    // rows against key blocks j0..j1 (clipped to seqlen_k).
    const int n_blocks = (seqlen_k + DQ_N - 1) / DQ_N;
    const int m_last = min(m0 + DQ_M, seqlen_q) - 1;
    auto kv_class = [&](int j0, int j1) {
        const int k0 = j0 * DQ_N, k1 = min((j1 + 1) * DQ_N, seqlen_k) - 1;
        return fg_tile_class(m0, m_last, k0, k1, b, h, h_kv, seqlen_q, seqlen_k);
    };
    int cls = fg::iv::EMPTY, full = -1;  // full: blocks from the last one visited up to here are FULL
    int n_block = fg::iv::next_live(0, n_blocks, cls, full, kv_class);

    load_tile<DQ_M, HEAD_DIM, THREADS>(sQ, q + b * q_sb + h * q_sh + (int64_t)m0 * q_ss, q_ss, seqlen_q - m0);
    load_tile<DQ_M, HEAD_DIM_V, THREADS>(sDO, dout + b * dout_sb + h * dout_sh + (int64_t)m0 * dout_ss, dout_ss, seqlen_q - m0);
    fg::cp_async_commit();
    const elem_t* k_head = k + b * k_sb + h_kv * k_sh;
    const elem_t* v_head = v + b * v_sb + h_kv * v_sh;
    auto issue = [&](int n_block, int stage) {
        const int n0 = n_block * DQ_N;
        const uint32_t sK = sK0 + stage * STAGE_BYTES;
        load_tile<DQ_N, HEAD_DIM, THREADS>(sK, k_head + (int64_t)n0 * k_ss, k_ss, seqlen_k - n0);
        load_tile<DQ_N, HEAD_DIM_V, THREADS>(sK + DQ_N * QK_ROW_BYTES, v_head + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
    };
    if (n_block < n_blocks) issue(n_block, 0);
    fg::cp_async_commit();

    // This thread's two rows: lse (log2 domain) and dsum.
    float row_lse[2], row_dsum[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + lane / 4 + r * 8;
        const int64_t stat = ((int64_t)b * heads_q + h) * seqlen_q + row;
        row_lse[r] = row < seqlen_q ? lse_log2(lse[stat]) : INFINITY;
        row_dsum[r] = row < seqlen_q ? dsum[stat] : 0.f;
    }

    float acc_dq[HEAD_DIM / 8][4];
    #pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dq[dt][i] = 0.f;

    for (int stage = 0; n_block < n_blocks; stage ^= 1) {
        int cls_next = fg::iv::EMPTY;
        const int n_next = fg::iv::next_live(n_block + 1, n_blocks, cls_next, full, kv_class);
        if (n_next < n_blocks) {
            issue(n_next, stage ^ 1);
            fg::cp_async_commit();
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            fg::cp_async_wait_all();
        }
        __syncthreads();
        const int n0 = n_block * DQ_N;
        const uint32_t sK = sK0 + stage * STAGE_BYTES;
        const uint32_t sV = sK + DQ_N * QK_ROW_BYTES;

        // S = Q K^T and dP = dO V^T for this warp's 16 query rows.
        float acc_s[NT][4], acc_dp[NT][4];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) { acc_s[nt][i] = 0.f; acc_dp[nt][i] = 0.f; }
        gemm_abt<NT, HEAD_DIM / 16>(acc_s, sQ, warp * 16, sK, QK_ROW_BYTES, lane);
        gemm_abt<NT, HEAD_DIM_V / 16>(acc_dp, sDO, warp * 16, sV, V_ROW_BYTES, lane);

        // dS = P (dP - dsum) * d score_mod / d score, P recomputed from lse; the mask only on tiles that are
        // not FULL, or cross seqlen_k.
        if (cls != fg::iv::FULL || n0 + DQ_N > seqlen_k) {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int q_idx = min((m0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_q - 1);
                const int kv_idx = min((n0 + nt * 8 + (lane % 4) * 2 + (i % 2)), seqlen_k - 1);
                const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;  // float twins
                const bool keep = (m0 + warp * 16 + lane / 4 + (i / 2) * 8) < seqlen_q && (n0 + nt * 8 + (lane % 4) * 2 + (i % 2)) < seqlen_k
                                  && (!IS_CAUSAL || (n0 + nt * 8 + (lane % 4) * 2 + (i % 2)) <= (m0 + warp * 16 + lane / 4 + (i / 2) * 8) + seqlen_k - seqlen_q);
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f; (void)g;

                const float p = fg::exp2_approx(x - row_lse[i / 2]);
                acc_dp[nt][i] = p * (acc_dp[nt][i] - row_dsum[i / 2]) * g;
            }
        } else {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int q_idx = min((m0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_q - 1);
                const int kv_idx = min((n0 + nt * 8 + (lane % 4) * 2 + (i % 2)), seqlen_k - 1);
                const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;  // float twins
                constexpr bool keep = true;
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)q_idx_f; (void)kv_idx_f; (void)g;

                const float p = fg::exp2_approx(x - row_lse[i / 2]);
                acc_dp[nt][i] = p * (acc_dp[nt][i] - row_dsum[i / 2]) * g;
            }
        }

        // dQ += dS K.
        gemm_pb<NT, HEAD_DIM / 8>(acc_dq, acc_dp, sK, 0, QK_ROW_BYTES, lane);
        __syncthreads();  // this stage is refilled by the prefetch two live blocks on
        n_block = n_next;
        cls = cls_next;
    }
    fg::cp_async_wait_all();

    const int row0 = m0 + warp * 16;
    store_acc<HEAD_DIM / 8>(dq + b * dq_sb + h * dq_sh + (int64_t)row0 * dq_ss, dq_ss, acc_dq, softmax_scale, seqlen_q - row0, lane);
}
