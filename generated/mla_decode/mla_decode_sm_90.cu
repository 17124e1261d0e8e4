// flashgen decode unit (FlashDecoding split-KV over a dense or paged KV cache, GQA packing), sm_80+.
// Spec: mla_decode   dtype bf16   head_dim 576/512   causal True
// Kernels (flashgen/families/decode.py):
//   flashgen_mla_decode_decode_sm_90_attn     grid (row blocks x splits, kv heads, batch): one split of one request's live key
//                            blocks for the packed query rows (row = s * group + g) of one kv head; with
//                            splits, the last CTA of a (row block, head, request) to finish merges the
//                            splits' fp32 partials (the exact LSE merge, fused: no second kernel)
//   flashgen_mla_decode_decode_sm_90_append   k_new / v_new written into the cache at cache_seqlens[b]
//
// Glossary
//   BLOCK_M   packed query rows per CTA (one m16n8k16 row tile, shared by all warps)
//   BLOCK_N   keys per stage of the cp.async ring; warp w takes columns w * KW .. w * KW + KW - 1
//   STAGES    ring depth: the loads of blocks i + 1 .. i + STAGES - 1 are in flight during block i's math
//   L         the request's live keys (seqlen_k of the mask); seqlen_q = Sq_new, q_idx = s in [0, Sq_new)
//   pages     paged cache [num_pages, page_size, Hkv, D] through block_table[b, :] (strides k_sp / k_ss /
//             k_sh); dense [B, Hkv, S, D] is the same with page = b and page_size = S (no block_table)
// A key row past L or on a page index outside [0, num_pages) is zero-filled and masked to -inf before the
// max: garbage (NaN, inf) in unused slots never reaches the result.
// v_from_k (MLA): one latent cache; V is the first HEAD_DIM_V columns of the K rows.  The ring holds K only and
// P V reads V through the K rows (same swizzle); the append writes the K row only.
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
// Shared pieces of the decode (split-KV) kernels: the split scheduler and the LSE merge
// (flashgen/families/decode.py).  __host__ __device__ where the host tests run them
// (tests/unit/test_decode_compile.py builds this file with the host compiler).
#ifndef FG_DECODE_CUH
#define FG_DECODE_CUH
#ifndef __CUDACC__
#include <math.h>
#endif

namespace fg {
namespace dec {

// Minimum key blocks per split: a request with cnt live blocks uses min(num_splits, cnt / this) splits
// (at least 1), so a short request or a sliding window launches no empty splits' work and merges few
// partials.  Same constant as flashgen.families.decode.MIN_SPLIT_BLOCKS.
constexpr int MIN_SPLIT_BLOCKS = 2;
// A unit may pass its own minimum (flashgen.families.decode.Options.min_split_blocks).
__host__ __device__ __forceinline__ int effective_splits(int n_lo, int n_hi, int num_splits,
                                                         int min_blocks = MIN_SPLIT_BLOCKS) {
    const int cnt = n_hi > n_lo ? n_hi - n_lo : 0;
    const int e = cnt / min_blocks < num_splits ? cnt / min_blocks : num_splits;
    return e > 1 ? e : 1;
}

// Key blocks [begin, end) of split `split` of the live blocks [n_lo, n_hi), balanced: split s gets
// [n_lo + cnt * s / n, n_lo + cnt * (s + 1) / n), sizes differing by at most one block (no short tail
// split).  n = effective_splits: every split of a request with cnt >= n has a block.  Depends on the
// request's own blocks and the split count only: batch-invariant.  Same arithmetic as
// flashgen.families.decode.split_range.
struct Range { int begin, end; };
__host__ __device__ __forceinline__ Range split_range(int n_lo, int n_hi, int num_splits, int split) {
    const int cnt = n_hi > n_lo ? n_hi - n_lo : 0;
    const long long c = cnt;
    return {n_lo + (int)(c * split / num_splits), n_lo + (int)(c * (split + 1) / num_splits)};
}

// Exact merge of n partial results by their log-sum-exps (natural log), FlashAttention's
// flash_fwd_combine: m = max lse_i, lse = m + log(sum exp(lse_i - m)); the weight of partial i is
// exp(lse_i - lse).  All -inf (no key anywhere): lse = -inf, every weight 0.  A NaN partial (a NaN
// key or value in its live range) makes lse NaN and so every weight and o NaN, as one split would:
// fmaxf alone drops NaN, which once turned a NaN split into an empty one (o = 0, lse = -inf) and
// made the result depend on num_splits.  Fixed order.
__host__ __device__ __forceinline__ float merged_lse(const float* lse, int n, long long stride) {
    float m = -INFINITY;
    bool nan = false;
    for (int i = 0; i < n; ++i) {
        const float x = lse[i * stride];
        nan = nan || x != x;
        m = fmaxf(m, x);
    }
    if (nan) return NAN;
    if (m == -INFINITY) return -INFINITY;
    float sum = 0.f;
    for (int i = 0; i < n; ++i) sum += expf(lse[i * stride] - m);
    return m + logf(sum);
}
__host__ __device__ __forceinline__ float merge_weight(float lse_i, float lse) {
    return lse == -INFINITY ? 0.f : expf(lse_i - lse);
}

}  // namespace dec
}  // namespace fg

#ifdef __CUDACC__
namespace fg {
namespace dec {
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
}  // namespace dec
}  // namespace fg
#endif
#endif

// Tile class of spec mla_decode's mask (flashgen/analysis/masktiles.py; rules of maskinfo.py).
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
constexpr int HEAD_DIM = 576;
constexpr int HEAD_DIM_V = 512;
constexpr int BLOCK_M = 16;
constexpr int BLOCK_N = 64;
constexpr int KEY_WARPS = 4;              // warps along a key block's columns
constexpr int DV_SPLIT = 2;   // warps along the output's columns (wide heads: 2)
constexpr int NUM_WARPS = KEY_WARPS * DV_SPLIT;
static_assert(NUM_WARPS == 8, "warps: flashgen.families.decode");
constexpr int STAGES = 2;
constexpr int THREADS = NUM_WARPS * 32;
constexpr int KW = BLOCK_N / KEY_WARPS;   // key columns per warp
constexpr int NT = KW / 8;                // 8-column score tiles per warp
constexpr int DT = HEAD_DIM_V / 8 / DV_SPLIT;  // 8-column output tiles per warp
constexpr int Q_ROW_BYTES = HEAD_DIM * 2;
constexpr int V_ROW_BYTES = HEAD_DIM_V * 2;
constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int SK_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int SV_BYTES = 0;  // v_from_k: no V stage
constexpr int RING_BYTES = STAGES * (SK_BYTES + SV_BYTES);
constexpr int MERGE_BYTES = KEY_WARPS * BLOCK_M * HEAD_DIM_V * 4 + 2 * KEY_WARPS * BLOCK_M * 4;
constexpr int BODY_BYTES = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
constexpr bool IS_CAUSAL = true;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;
static_assert(SQ_BYTES + BODY_BYTES + STAGES * BLOCK_N == 166016,
              "dynamic shared memory: flashgen.families.decode.smem_bytes must match");
static_assert(BLOCK_M == 16 && KW % 16 == 0 && HEAD_DIM % 32 == 0 && HEAD_DIM_V % (32 * DV_SPLIT) == 0,
              "tile shape");
constexpr int KC = HEAD_DIM / 8, VC = HEAD_DIM_V / 8;  // 16-byte chunks per K / V row
// Fast load path: a thread keeps one column chunk and walks rows ROW_STEP apart (one page lookup per row).
constexpr bool ROW_LOADS = THREADS % KC == 0 && BLOCK_N % (THREADS / KC) == 0 && KC == VC;
constexpr int ROW_STEP = ROW_LOADS ? THREADS / KC : 1;
constexpr int ROWS_PER_THREAD = ROW_LOADS ? BLOCK_N / ROW_STEP : 1;  // key rows a thread copies per block
constexpr int MAX_SPLITS = 128;
constexpr int MIN_SPLIT_BLOCKS = 2;  // fewest key blocks per split (Options)
constexpr int MIN_CTAS_PER_SM = 1;        // launch bounds: registers leave room for these
constexpr int C4 = HEAD_DIM_V / 4;                            // float4 column groups of an output row
constexpr int MERGE_ITEMS = (BLOCK_M * C4 + THREADS - 1) / THREADS;  // (row, c4) per thread in the merge
static_assert((MAX_SPLITS + 1) * BLOCK_M * 4 <= MERGE_BYTES, "split merge weights fit the merge area");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_PER_SM) flashgen_mla_decode_decode_sm_90_attn(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache,
    __nv_bfloat16* __restrict__ o,
    float* __restrict__ lse,
    const int* __restrict__ cache_seqlens,
    const int* __restrict__ block_table,
    float* __restrict__ o_part,
    float* __restrict__ lse_part,
    int* __restrict__ counters,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sp,
    int64_t k_ss,
    int64_t k_sh,
    int64_t v_sp,
    int64_t v_ss,
    int64_t v_sh,
    int64_t bt_sb,
    int max_pages,
    int num_pages,
    int page_size,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int num_splits,
    int new_keys,
    int group,
    float softmax_scale
) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = fg::smem_u32(smem);
    const uint32_t sRing = sQ + SQ_BYTES;
    unsigned char* s_ok = smem + SQ_BYTES + BODY_BYTES;  // [STAGES][BLOCK_N]: key row usable

    const int split = blockIdx.x % num_splits, m_block = blockIdx.x / num_splits;
    const int hy = blockIdx.y, b = blockIdx.z;
    const int h0 = hy * group;                       // first query head of this CTA's rows
    const int h_kv = h0 / (heads_q / heads_kv);
    const int rows = group * seqlen_q;               // packed rows of this kv head (group x Sq_new)
    const int m0 = m_block * BLOCK_M;
    const int warp = threadIdx.x / 32 % KEY_WARPS, lane = threadIdx.x % 32;
    const int dh = threadIdx.x / 32 / KEY_WARPS;  // this warp's share of the output columns
    const int dcol0 = dh * DT;                    // its first 8-column output tile
    const bool paged = block_table != nullptr;
    const int capacity = paged ? max_pages * page_size : page_size;
    int live = cache_seqlens[b] + new_keys;
    live = live < 0 ? 0 : (live > capacity ? capacity : live);
    const int seqlen_k = live;
    (void)batch;

    // This CTA's query positions s (q_idx) and heads: rows m0 .. m0 + 15 are s = row / group.
    const int m_last = min(m0 + BLOCK_M, rows) - 1;
    const int s_lo = m0 / group, s_hi = m_last / group;

    // Live key blocks of these rows: the first and last the mask's classifier does not prove EMPTY.
    const int n_total = (live + BLOCK_N - 1) / BLOCK_N;
    const int h = h0;
    auto kv_class = [&](int j0, int j1) {
        const int k0 = j0 * BLOCK_N, k1 = min((j1 + 1) * BLOCK_N, seqlen_k) - 1;
        return fg_tile_class(s_lo, s_hi, k0, k1, b, h, h_kv, seqlen_q, seqlen_k);
    };
    int n_lo = n_total, n_hi = 0;
    if (n_total > 0 && m0 < rows) {
        int c0 = fg::iv::EMPTY, f0 = -1, c1 = fg::iv::EMPTY, f1 = 0x7fffffff;
        n_lo = fg::iv::next_live(0, n_total, c0, f0, kv_class);
        n_hi = n_lo < n_total ? fg::iv::prev_live(n_total - 1, c1, f1, kv_class) + 1 : n_lo;
    }
    // This request's splits (fewer than num_splits when it has few live blocks): the others return now.
    const int eff_splits = fg::dec::effective_splits(n_lo, n_hi, num_splits, MIN_SPLIT_BLOCKS);
    if (split >= eff_splits) return;
    const fg::dec::Range mine = fg::dec::split_range(n_lo, n_hi, eff_splits, split);

    // Per-row constants of this thread's two fragment rows (lane / 4 and lane / 4 + 8).
    int row_s[2], row_h[2];
    bool row_ok[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + lane / 4 + r * 8;
        row_ok[r] = row < rows;
        row_s[r] = min(row / group, seqlen_q - 1);
        row_h[r] = h0 + row % group;
    }

    // Q rows (zero past `rows`), loaded once.
    for (int i = threadIdx.x; i < BLOCK_M * KC; i += THREADS) {
        const int r = i / KC, c = i % KC, row = m0 + r;
        const bool ok = row < rows;
        const elem_t* src = q + b * q_sb + (int64_t)(h0 + row % group) * q_sh + (int64_t)(row / group) * q_ss + c * 8;
        fg::cp_async_16(sQ + fg::swz(r, c, Q_ROW_BYTES), ok ? src : q, ok);
    }

    const int* bt_row = paged ? block_table + b * bt_sb : nullptr;
    const fg::Divisor pdiv(page_size > 0 ? page_size : 1);
    const elem_t* k_head = k_cache + h_kv * k_sh;
    const elem_t* v_head = v_cache + h_kv * v_sh;
    // The cache offsets of key row kv (without the head) on page pg; false (offsets 0) past L or on a bad page.
    auto locate_on = [&](int kv, int pg, int64_t& ko, int64_t& vo) {
        int slot = kv;
        if (paged) slot = kv - pdiv.div_nn(kv) * page_size;
        const bool ok = kv < live && (unsigned)pg < (unsigned)num_pages;
        ko = ok ? pg * k_sp + slot * k_ss : 0;
        vo = ok ? pg * v_sp + slot * v_ss : 0;
        return ok;
    };
    auto page_of = [&](int kv) { return paged ? (kv < live ? __ldg(bt_row + pdiv.div_nn(kv)) : -1) : b; };
    auto locate = [&](int kv, int64_t& ko, int64_t& vo) { return locate_on(kv, page_of(kv), ko, vo); };
    // Fast path: the page index of each of this thread's rows of the next block to load, read one block
    // ahead (plain loads whose latency hides behind a block's wait and math), so a block's cp.async are
    // issued without first waiting on the block table (page size 1: one table entry per key row).
    int pg_next[ROWS_PER_THREAD];
    auto fetch_pages = [&](int j) {
        if constexpr (ROW_LOADS) {
            #pragma unroll
            for (int it = 0; it < ROWS_PER_THREAD; ++it)
                pg_next[it] = page_of(j * BLOCK_N + threadIdx.x / KC + it * ROW_STEP);
        }
    };
    // Issue the K and V loads of key block j into ring stage st (ROW_LOADS: on pg_next, then fetch the
    // page indices of block j + 1).
    auto load_block = [&](int j, int st) {
        const uint32_t dK = sRing + st * (SK_BYTES + SV_BYTES);
        unsigned char* ok_row = s_ok + st * BLOCK_N;
        const int n0 = j * BLOCK_N;
        if constexpr (ROW_LOADS) {
            const int r0 = threadIdx.x / KC, c = threadIdx.x % KC;
            #pragma unroll
            for (int it = 0; it < ROWS_PER_THREAD; ++it) {
                const int r = r0 + it * ROW_STEP;
                int64_t ko, vo;
                const bool ok = locate_on(n0 + r, pg_next[it], ko, vo);
                fg::cp_async_16(dK + fg::swz(r, c, Q_ROW_BYTES), k_head + ko + c * 8, ok);
                if (c == 0) ok_row[r] = ok;
            }
            fetch_pages(j + 1);
        } else {
            for (int i = threadIdx.x; i < BLOCK_N * KC; i += THREADS) {
                const int r = i / KC, c = i % KC;
                int64_t ko, vo;
                const bool ok = locate(n0 + r, ko, vo);
                fg::cp_async_16(dK + fg::swz(r, c, Q_ROW_BYTES), k_head + ko + c * 8, ok);
                if (c == 0) ok_row[r] = ok;
            }
        }
    };

    // The split's blocks in order; the loader runs STAGES - 1 blocks ahead of the math.  (Blocks inside
    // [n_lo, n_hi) are visited whole: the shipped masks' live key ranges are intervals, and a hole of an
    // exotic mask is masked per element; no classifier runs in the loop, whose doubles would take the
    // registers of the accumulators.)
    int ld_j = mine.begin, j = mine.begin;
    fetch_pages(ld_j);
    #pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (ld_j < mine.end) load_block(ld_j++, st);
        fg::cp_async_commit();  // one group per stage, empty or not: the wait counts stay uniform
    }

    const float scale_log2 = softmax_scale * LOG2E;
    const int q_r = lane % 16, q_c = lane / 16;
    const int k_r = (lane % 8) + (lane / 16) * 8, k_c = (lane / 8) % 2;
    const int v_r = (lane % 8) + ((lane / 8) % 2) * 8, v_c = lane / 16;

    float acc_o[DT][4];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    #pragma unroll
    for (int dt = 0; dt < DT; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_o[dt][i] = 0.f;

    int stage = 0;
    while (j < mine.end) {
        fg::dec::cp_async_wait<STAGES - 2>();
        __syncthreads();  // block j has landed; every warp is done with the stage refilled next
        {
            const int st = stage + STAGES - 1 >= STAGES ? stage - 1 : stage + STAGES - 1;
            if (ld_j < mine.end) load_block(ld_j++, st);
            fg::cp_async_commit();
        }
        const uint32_t sK = sRing + stage * (SK_BYTES + SV_BYTES), sV = sK;
        const unsigned char* ok_row = s_ok + stage * BLOCK_N;
        const int n0 = j * BLOCK_N;
        const int kw0 = warp * KW;  // this warp's first column in the block

        // S = Q K^T for this warp's KW keys.
        float acc_s[NT][4];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc_s[nt][i] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            uint32_t a[4];
            fg::ldmatrix_x4(a, sQ + fg::swz(q_r, kk * 2 + q_c, Q_ROW_BYTES));
            #pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                uint32_t bk[4];
                fg::ldmatrix_x4(bk, sK + fg::swz(kw0 + np * 16 + k_r, kk * 2 + k_c, Q_ROW_BYTES));
                Mma::run(acc_s[2 * np], a, bk[0], bk[1]);
                Mma::run(acc_s[2 * np + 1], a, bk[2], bk[3]);
            }
        }

        // Scores -> log2 domain (score_mod), masked: row in range, key live and on a good page, causal,
        // and the residual mask.
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int col = kw0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                const int kv_raw = n0 + col;
                const int q_idx = row_s[i / 2];
                const int kv_idx = min(kv_raw, seqlen_k - 1);
                const int h = row_h[i / 2];
                const float q_idx_f = (float)q_idx;
                const float kv_idx_f = (float)kv_idx;
                (void)q_idx_f; (void)kv_idx_f; (void)h;
                float x = acc_s[nt][i] * scale_log2;
                bool keep = row_ok[i / 2] && kv_raw < seqlen_k && ok_row[col] != 0
                            && (!IS_CAUSAL || kv_raw <= q_idx + seqlen_k - seqlen_q);
                acc_s[nt][i] = keep ? x : -INFINITY;
            }

        // Online softmax over this warp's columns (rows are shared by the quad: lanes 4r .. 4r + 3).
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float base = mx == -INFINITY ? 0.f : mx;
            const float alpha = fg::exp2_approx(row_max[r] - base);
            row_max[r] = mx;
            float sum = 0.f;
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = fg::exp2_approx(acc_s[nt][2 * r + e] - base);
                    acc_s[nt][2 * r + e] = p;
                    sum += p;
                }
            row_sum[r] = row_sum[r] * alpha + sum;
            #pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc_o[dt][2 * r] *= alpha;
                acc_o[dt][2 * r + 1] *= alpha;
            }
        }

        // O += P V over this warp's KW keys.
        #pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
            uint32_t a[4];
            a[0] = Mma::pack(acc_s[2 * kk][0], acc_s[2 * kk][1]);
            a[1] = Mma::pack(acc_s[2 * kk][2], acc_s[2 * kk][3]);
            a[2] = Mma::pack(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
            a[3] = Mma::pack(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
            #pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                uint32_t bv[4];
                fg::ldmatrix_x4_trans(bv, sV + fg::swz(kw0 + kk * 16 + v_r, dcol0 + dp * 2 + v_c, Q_ROW_BYTES));
                Mma::run(acc_o[2 * dp], a, bv[0], bv[1]);
                Mma::run(acc_o[2 * dp + 1], a, bv[2], bv[3]);
            }
        }
        ++j;
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }

    // Merge the warps' partial states (each saw a quarter of every block's columns) through shared
    // memory, in warp order: per row M = max_w m_w, sum = sum_w l_w 2^(m_w - M), o = sum_w 2^(m_w - M) o_w.
    fg::cp_async_wait_all();
    __syncthreads();
    float* s_o = reinterpret_cast<float*>(smem + SQ_BYTES);              // [KEY_WARPS][BLOCK_M][Dv]
    float* s_m = s_o + KEY_WARPS * BLOCK_M * HEAD_DIM_V;                  // [KEY_WARPS][BLOCK_M]
    float* s_l = s_m + KEY_WARPS * BLOCK_M;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        const int row = lane / 4 + r * 8;
        if (lane % 4 == 0 && dh == 0) {
            s_m[warp * BLOCK_M + row] = row_max[r];
            s_l[warp * BLOCK_M + row] = sum;
        }
        float* dst = s_o + (warp * BLOCK_M + row) * HEAD_DIM_V + dcol0 * 8 + (lane % 4) * 2;
        #pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc_o[dt][2 * r], acc_o[dt][2 * r + 1]);
    }
    __syncthreads();
    const bool direct = eff_splits == 1;
    const int64_t total = (int64_t)batch * heads_q * seqlen_q;  // rows of o: [B, Hq, Sq_new]
    for (int i = threadIdx.x; i < BLOCK_M * C4; i += THREADS) {
        const int row = i / C4, c4 = i % C4, prow = m0 + row;
        if (prow >= rows) continue;
        float mw[KEY_WARPS], M = -INFINITY;
        #pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) { mw[w] = s_m[w * BLOCK_M + row]; M = fmaxf(M, mw[w]); }
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float sum = 0.f;
        #pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) {
            // M = -inf: every warp's keys were masked (l_w = 0, o_w = 0) or NaN (l_w NaN): weight 1
            // keeps a NaN (fmaxf drops it from M) instead of turning the row empty.
            const float f = M == -INFINITY ? 1.f : fg::exp2_approx(mw[w] - M);
            sum += f * s_l[w * BLOCK_M + row];
            const float4 v = *reinterpret_cast<const float4*>(s_o + (w * BLOCK_M + row) * HEAD_DIM_V + c4 * 4);
            acc.x += f * v.x; acc.y += f * v.y; acc.z += f * v.z; acc.w += f * v.w;
        }
        const bool empty = M == -INFINITY || sum == 0.f;
        const float inv = empty ? 0.f : 1.f / sum;
        const float lse_row = empty ? -INFINITY : (M + __log2f(sum)) * LN2;
        const int s = prow / group, h = h0 + prow % group;
        const int64_t out_row = ((int64_t)b * heads_q + h) * seqlen_q + s;  // [B, Hq, Sq_new]
        if (direct) {
            elem_t* dst = o + out_row * HEAD_DIM_V + c4 * 4;
            uint2 packed;
            packed.x = Mma::pack(acc.x * inv, acc.y * inv);
            packed.y = Mma::pack(acc.z * inv, acc.w * inv);
            *reinterpret_cast<uint2*>(dst) = packed;
            if (c4 == 0) lse[out_row] = lse_row;
        } else {
            const int64_t prow_ws = (int64_t)split * total + out_row;  // [num_splits, B * Hq * Sq_new]
            *reinterpret_cast<float4*>(o_part + prow_ws * HEAD_DIM_V + c4 * 4) =
                make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
            if (c4 == 0) lse_part[prow_ws] = lse_row;
        }
    }
    if (direct) return;

    // Fused combine (FlashAttention's flash_fwd_combine, in the attention kernel): the partials are
    // published (fence), then one thread counts this CTA in; the last of the request's eff_splits CTAs of
    // this (row block, kv head) resets the counter for the next launch and merges all partials in split
    // order, so the result is the same whichever CTA comes last (bitwise reproducible).
    __threadfence();
    __syncthreads();
    volatile int* s_last = reinterpret_cast<volatile int*>(s_ok);
    if (threadIdx.x == 0) {
        const int tile = ((int)blockIdx.z * gridDim.y + hy) * (gridDim.x / num_splits) + m_block;
        const int done = atomicAdd(counters + tile, 1);
        const int last = done == eff_splits - 1;
        if (last) counters[tile] = 0;
        *s_last = last;
    }
    __syncthreads();
    if (!*s_last) return;
    __threadfence();  // the other CTAs' partials, read below through L2 (__ldcg)
    float* s_w = reinterpret_cast<float*>(smem + SQ_BYTES);  // [eff_splits][BLOCK_M]: lse, then weights
    float* s_lse = s_w + MAX_SPLITS * BLOCK_M;                 // [BLOCK_M]: the merged lse
    auto out_row_of = [&](int prow) {
        return ((int64_t)b * heads_q + h0 + prow % group) * seqlen_q + prow / group;
    };
    for (int i = threadIdx.x; i < eff_splits * BLOCK_M; i += THREADS) {
        const int sp = i / BLOCK_M, row = i % BLOCK_M, prow = m0 + row;
        s_w[i] = prow < rows ? __ldcg(lse_part + sp * total + out_row_of(prow)) : -INFINITY;
    }
    __syncthreads();
    if (threadIdx.x < BLOCK_M) {
        const float l = fg::dec::merged_lse(s_w + threadIdx.x, eff_splits, BLOCK_M);
        for (int sp = 0; sp < eff_splits; ++sp)
            s_w[sp * BLOCK_M + threadIdx.x] = fg::dec::merge_weight(s_w[sp * BLOCK_M + threadIdx.x], l);
        s_lse[threadIdx.x] = l;
    }
    __syncthreads();
    // o = sum_sp w_sp o_sp, in split order; every (row, column group) of a thread loads in the same step,
    // and four splits at a time, so up to 4 * MERGE_ITEMS float4 loads are in flight per thread.
    float4 acc[MERGE_ITEMS];
    int64_t src[MERGE_ITEMS];
    #pragma unroll
    for (int it = 0; it < MERGE_ITEMS; ++it) {
        acc[it] = make_float4(0.f, 0.f, 0.f, 0.f);
        const int i = threadIdx.x + it * THREADS, row = i / C4, prow = m0 + row;
        src[it] = i < BLOCK_M * C4 && prow < rows ? out_row_of(prow) * HEAD_DIM_V + (i % C4) * 4 : -1;
    }
    const int64_t split_stride = total * HEAD_DIM_V;
    #pragma unroll 4
    for (int sp = 0; sp < eff_splits; ++sp) {
        #pragma unroll
        for (int it = 0; it < MERGE_ITEMS; ++it) {
            if (src[it] < 0) continue;
            const int row = (threadIdx.x + it * THREADS) / C4;
            const float w = s_w[sp * BLOCK_M + row];
            const float4 v = __ldcg(reinterpret_cast<const float4*>(o_part + sp * split_stride + src[it]));
            acc[it].x += w * v.x; acc[it].y += w * v.y; acc[it].z += w * v.z; acc[it].w += w * v.w;
        }
    }
    #pragma unroll
    for (int it = 0; it < MERGE_ITEMS; ++it) {
        if (src[it] < 0) continue;
        const int i = threadIdx.x + it * THREADS, row = i / C4, c4 = i % C4;
        uint2 packed;
        packed.x = Mma::pack(acc[it].x, acc[it].y);
        packed.y = Mma::pack(acc[it].z, acc[it].w);
        *reinterpret_cast<uint2*>(o + src[it]) = packed;
        if (c4 == 0) lse[src[it] / HEAD_DIM_V] = s_lse[row];
    }
}

// k_new / v_new row (b, h_kv, s) -> the cache slot cache_seqlens[b] + s (dropped past the request's pages or
// on a page index outside [0, num_pages)).  One row per CTA, 16 bytes per thread and step.
extern "C" __global__ void __launch_bounds__(32) flashgen_mla_decode_decode_sm_90_append(
    const __nv_bfloat16* __restrict__ k_new,
    const __nv_bfloat16* __restrict__ v_new,
    __nv_bfloat16* __restrict__ k_cache,
    __nv_bfloat16* __restrict__ v_cache,
    const int* __restrict__ cache_seqlens,
    const int* __restrict__ block_table,
    int64_t kn_sb,
    int64_t kn_sh,
    int64_t kn_ss,
    int64_t vn_sb,
    int64_t vn_sh,
    int64_t vn_ss,
    int64_t k_sp,
    int64_t k_ss,
    int64_t k_sh,
    int64_t v_sp,
    int64_t v_ss,
    int64_t v_sh,
    int64_t bt_sb,
    int max_pages,
    int num_pages,
    int page_size,
    int heads_kv,
    int seqlen_q
) {
    const int s = blockIdx.x % seqlen_q, bh = blockIdx.x / seqlen_q;
    const int hk = bh % heads_kv, b = bh / heads_kv;
    const int pos = cache_seqlens[b] + s;
    if (pos < 0) return;
    int pg = b, slot = pos;
    if (block_table != nullptr) {
        const int pi = pos / page_size;
        if (pi >= max_pages) return;
        pg = block_table[b * bt_sb + pi];
        slot = pos - pi * page_size;
    } else if (pos >= page_size) {
        return;
    }
    if (pg < 0 || pg >= num_pages) return;
    const uint4* ks = reinterpret_cast<const uint4*>(k_new + b * kn_sb + hk * kn_sh + s * kn_ss);
    const uint4* vs = reinterpret_cast<const uint4*>(v_new + b * vn_sb + hk * vn_sh + s * vn_ss);
    uint4* kd = reinterpret_cast<uint4*>(k_cache + pg * k_sp + slot * k_ss + hk * k_sh);
    uint4* vd = reinterpret_cast<uint4*>(v_cache + pg * v_sp + slot * v_ss + hk * v_sh);
    for (int c = threadIdx.x; c < HEAD_DIM / 8; c += 32) kd[c] = ks[c];
    (void)vd; (void)vs;  // v_from_k: the values are the K row just written
}
