// flashgen forward kernel, FA2-class (Dao 2023, "FlashAttention-2", Algorithm 1), for sm_80 and later.
// Spec: bidir_d256   dtype bf16   head_dim 256/256   causal False
//
// Glossary
//   BLOCK_M   query rows per CTA (the sQ tile); each warp owns WARP_M = BLOCK_M / NUM_WARPS of them
//   BLOCK_N   key/value rows per inner step (the sK and sV tiles)
//   MT        16-row mma tiles per warp (WARP_M / 16)
//   NT        8-column tiles of the score block S (BLOCK_N / 8)
//   DT        8-column tiles of the output O (HEAD_DIM_V / 8)
//   sQ sK sV  shared-memory tiles, rows of 16-byte chunks, XOR-swizzled (fg::swz)
//   acc_s     S = Q K^T for this warp's rows, fp32 (then P, in place)
//   acc_o     O = P V accumulator, fp32, rescaled lazily, divided by row_sum once at the end
//   row_max   running max of the log2-domain scores; row_sum running sum of exp2(x - row_max)
// Softmax runs in the exp2 domain: x = log2(e) * score_mod(softmax_scale * q.k).  Without a score_mod
// (fold_scale) acc_s keeps the raw q.k and log2(e) * softmax_scale is folded into exp2's FFMA (as FA2).
// causal is bottom-right aligned: kv_idx <= q_idx + seqlen_k - seqlen_q.
// Block sparsity: fg_tile_class (flashgen/analysis/masktiles.py) classifies (query block, key blocks) by interval
// arithmetic over the mask; EMPTY key blocks are never loaded (fg::iv::prev_live finds the next live one,
// crossing runs of empty blocks in O(log) range checks), FULL ones inside seqlen_k evaluate no mask.
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

// Tile class of spec bidir_d256's mask (flashgen/analysis/masktiles.py; rules of maskinfo.py).
__host__ __device__ __forceinline__ int fg_tile_class(int q0, int q1, int k0, int k1, int b, int h, int h_kv, int seqlen_q, int seqlen_k) {
    (void)q0; (void)q1; (void)k0; (void)k1; (void)b; (void)h;
    (void)seqlen_q; (void)seqlen_k;
    return fg::iv::FULL;
}


namespace {
constexpr int HEAD_DIM = 256;
constexpr int HEAD_DIM_V = 256;
constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 64;
constexpr int NUM_WARPS = 8;
constexpr int THREADS = NUM_WARPS * 32;
constexpr int WARP_M = BLOCK_M / NUM_WARPS;
constexpr int MT = WARP_M / 16;
constexpr int NT = BLOCK_N / 8;
constexpr int DT = HEAD_DIM_V / 8;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;
// Byte sizes follow the element type (the plan's dtype record: elem_t and its elem_bytes, with which the
// plan sized smem_bytes).  The mma.sync m16n8k16 / ldmatrix .b16 fragments take 16-bit elements: a 16-column
// fragment is two 16-byte chunks and an 8-column tile one (the fragment indices below count so).
constexpr int ELEM_BYTES = sizeof(elem_t);
constexpr int CHUNK_ELEMS = 16 / ELEM_BYTES;  // elements per 16-byte chunk (cp.async, an ldmatrix row, fg::swz)
static_assert(sizeof(elem_t) == sizeof(uint16_t), "mma.sync m16n8k16 and ldmatrix .b16: 16-bit elements");
constexpr int Q_ROW_BYTES = HEAD_DIM * ELEM_BYTES;
constexpr int V_ROW_BYTES = HEAD_DIM_V * ELEM_BYTES;
constexpr int SQ_BYTES = BLOCK_M * (HEAD_DIM > HEAD_DIM_V ? HEAD_DIM : HEAD_DIM_V) * ELEM_BYTES;  // also stages O
constexpr int SK_BYTES = BLOCK_N * HEAD_DIM * ELEM_BYTES;
constexpr int SV_BYTES = BLOCK_N * HEAD_DIM_V * ELEM_BYTES;
constexpr bool IS_CAUSAL = false;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr int TAB_BYTES = 0;  // block-table row staging (masks that read tensors)
static_assert(SQ_BYTES + SK_BYTES + SV_BYTES + TAB_BYTES == 131072,
              "dynamic shared memory: the plan's smem_bytes (flashgen.families.fa2_fwd.plan) must match sQ + sK + sV + table");
// Rows of a multiple of 64 bytes (head dims that are multiples of 32), which fg::swz keeps bank-conflict free.
static_assert(WARP_M % 16 == 0 && BLOCK_N % 16 == 0 && Q_ROW_BYTES % 64 == 0 && V_ROW_BYTES % 64 == 0,
              "tile shape");

// Copy `rows` x `cols` elements (row stride `stride`) into a swizzled tile; rows >= valid_rows read as 0.
// When THREADS covers whole rows, each thread keeps one 16-byte column chunk and steps ROW_STEP rows at a
// time: a compile-time trip count, one global pointer advanced by a constant multiple of the stride, and
// (ROW_STEP % 8 == 0) shared addresses that differ by immediates.  Otherwise a strided generic loop.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(uint32_t dst, const elem_t* src, int64_t stride, int valid_rows) {
    constexpr int CHUNKS_PER_ROW = COLS / CHUNK_ELEMS;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
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
    for (int i = threadIdx.x; i < CHUNKS; i += THREADS) {
        const int row = i / CHUNKS_PER_ROW, chunk = i % CHUNKS_PER_ROW;
        const bool valid = row < valid_rows;
        const elem_t* g = src + (valid ? row * stride + chunk * CHUNK_ELEMS : 0);
        fg::cp_async_16(dst + fg::swz(row, chunk, ROW_BYTES), g, valid);
    }
}

// fg::swz(row0 + r, chunk0 + c, ROW_BYTES) for compile-time row0 % 8 == 0 and even chunk0, per-lane
// r and c in {0, 1}, with lane_off = fg::swz(r, c, ROW_BYTES).  When ROW_BYTES % 128 == 0, row * ROW_BYTES
// leaves bits 4..6 clear, so the XOR term depends on the lane only through lane_off's bits 4..6: the
// per-lane part is computed once and each fragment address is one XOR with a constant plus an immediate.
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t swz_at(uint32_t lane_off, int r, int c, int row0, int chunk0) {
    if constexpr (ROW_BYTES % 128 == 0)
        return (lane_off ^ ((chunk0 & 7) << 4)) + row0 * ROW_BYTES + (chunk0 & ~7) * 16;
    return fg::swz(row0 + r, chunk0 + c, ROW_BYTES);
}
}  // namespace


extern "C" __global__ void __launch_bounds__(THREADS, 1) flashgen_bidir_d256_fwd_sm_80(
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
    float softmax_scale
) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = fg::smem_u32(smem);
    const uint32_t sK = sQ + SQ_BYTES;
    const uint32_t sV = sK + SK_BYTES;

    // Which (batch, head, query block) this CTA computes; with a mask, last query blocks first (the heaviest
    // ones under causal-like masks).
    const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int m_rev = blockIdx.x % num_m_blocks;  // head-major: one head's blocks together
    const int bh = blockIdx.x / num_m_blocks;
    const int b = bh / heads_q;
    const int h = bh % heads_q;
    const int m_block = m_rev;
    const int h_kv = h / (heads_q / heads_kv);
    const int m0 = m_block * BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    const elem_t* q_blk = q + b * q_sb + h * q_sh + (int64_t)m0 * q_ss;
    const elem_t* k_head = k + b * k_sb + h_kv * k_sh;
    const elem_t* v_head = v + b * v_sb + h_kv * v_sh;

    // Key blocks are visited last to first, live ones only: kv_class(j0, j1) is the class of this CTA's
    // query rows against key blocks j0..j1 (clipped to seqlen_k) under the whole mask (causal included).
    const int m_last = min(m0 + BLOCK_M, seqlen_q) - 1;
    auto kv_class = [&](int j0, int j1) {
        const int k0 = j0 * BLOCK_N, k1 = min((j1 + 1) * BLOCK_N, seqlen_k) - 1;
        return fg_tile_class(m0, m_last, k0, k1, b, h, h_kv, seqlen_q, seqlen_k);
    };
    int cls = fg::iv::EMPTY, full = 0x7fffffff;  // full: blocks from here to the last one visited are FULL
    int n_block = fg::iv::prev_live((seqlen_k + BLOCK_N - 1) / BLOCK_N - 1, cls, full, kv_class);
    const float scale_log2 = softmax_scale * LOG2E;

    // Per-lane parts of the ldmatrix addresses (row r, chunk c within a 16x16 fragment; see swz_at).
    const uint32_t sQ_lane = sQ + warp * WARP_M * Q_ROW_BYTES;  // WARP_M % 16 == 0: swizzle unchanged
    const int q_r = lane % 16, q_c = lane / 16;
    const int k_r = (lane % 8) + (lane / 16) * 8, k_c = (lane / 8) % 2;
    const int v_r = (lane % 8) + ((lane / 8) % 2) * 8, v_c = lane / 16;
    const uint32_t q_off = fg::swz(q_r, q_c, Q_ROW_BYTES);
    const uint32_t k_off = fg::swz(k_r, k_c, Q_ROW_BYTES);
    const uint32_t v_off = fg::swz(v_r, v_c, V_ROW_BYTES);

    float acc_o[MT][DT][4];
    float row_max[MT][2], row_sum[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
        #pragma unroll
        for (int r = 0; r < 2; ++r) { row_max[mt][r] = -INFINITY; row_sum[mt][r] = 0.f; }
    }

    // Prologue: Q tile and the first live K tile in flight.
    if (n_block >= 0) {
        load_tile<BLOCK_M, HEAD_DIM>(sQ, q_blk, q_ss, seqlen_q - m0);
        const int n_last = n_block * BLOCK_N;
        load_tile<BLOCK_N, HEAD_DIM>(sK, k_head + (int64_t)n_last * k_ss, k_ss, seqlen_k - n_last);
        fg::cp_async_commit();
    }

    while (n_block >= 0) {
        const int n0 = n_block * BLOCK_N;
        // K(n) has landed and every warp is done with V(n+1): start V(n).
        fg::cp_async_wait_all();
        __syncthreads();
        load_tile<BLOCK_N, HEAD_DIM_V>(sV, v_head + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
        fg::cp_async_commit();

        // S = Q K^T on tensor cores.
        float acc_s[MT][NT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fg::ldmatrix_x4(a[mt], sQ_lane + swz_at<Q_ROW_BYTES>(q_off, q_r, q_c, mt * 16, kk * 2));
            #pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                uint32_t bk[4];
                fg::ldmatrix_x4(bk, sK + swz_at<Q_ROW_BYTES>(k_off, k_r, k_c, np * 16, kk * 2));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma::run(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
                    Mma::run(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        // Scores -> log2 domain with score_mod; the mask only on tiles that are not FULL, or cross seqlen_k.
        if (cls != fg::iv::FULL || n0 + BLOCK_N > seqlen_k) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int q_raw = m0 + warp * WARP_M + mt * 16 + lane / 4 + (i / 2) * 8;
                        const int kv_raw = n0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                        float x = acc_s[mt][nt][i];  // raw q.k; scale_log2 > 0 is applied inside the exp2's FFMA
                        const bool keep = q_raw < seqlen_q && kv_raw < seqlen_k
                                          && (!IS_CAUSAL || kv_raw <= q_raw + seqlen_k - seqlen_q);
                        x = keep ? x : -INFINITY;
                        acc_s[mt][nt][i] = x;
                    }

        } else {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int q_raw = m0 + warp * WARP_M + mt * 16 + lane / 4 + (i / 2) * 8;
                        const int kv_raw = n0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                        float x = acc_s[mt][nt][i];  // raw q.k; scale_log2 > 0 is applied inside the exp2's FFMA
                        (void)q_raw; (void)kv_raw;
                        acc_s[mt][nt][i] = x;
                    }

        }

        // Online softmax: new row max, rescale O and the running sum, P = exp2(x - max).
        float alphas[MT][2];
        bool rescale = false;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                // acc_s holds raw scores: max in raw units, scaled once (softmax_scale > 0 keeps the order).
                float mx = -INFINITY;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * r], acc_s[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                mx = fmaxf(row_max[mt][r], mx * scale_log2);
                const float base = mx == -INFINITY ? 0.f : mx;  // a fully masked row so far stays at 0
                const float alpha = fg::exp2_approx(row_max[mt][r] - base);
                row_max[mt][r] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float p = fg::exp2_approx(fmaf(acc_s[mt][nt][2 * r + j], scale_log2, -base));
                        acc_s[mt][nt][2 * r + j] = p;
                        sum += p;
                    }
                row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
                alphas[mt][r] = alpha;
                rescale |= alpha != 1.f;
            }
        // O is rescaled only when some row max of this warp moved (alpha == 1 exactly otherwise).
        if (__any_sync(0xffffffff, rescale)) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] *= alphas[mt][i / 2];
        }

        // The previous live block, searched while V(n) is in flight.
        int next_cls = fg::iv::EMPTY;
        const int n_next = fg::iv::prev_live(n_block - 1, next_cls, full, kv_class);
        // V(n) has landed and every warp is done with K(n): start K of the previous live block, then O += P V.
        fg::cp_async_wait_all();
        __syncthreads();
        if (n_next >= 0) {
            const int n_prev = n_next * BLOCK_N;
            load_tile<BLOCK_N, HEAD_DIM>(sK, k_head + (int64_t)n_prev * k_ss, k_ss, seqlen_k - n_prev);
            fg::cp_async_commit();
        }
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = Mma::pack(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
                a[mt][1] = Mma::pack(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
                a[mt][2] = Mma::pack(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
                a[mt][3] = Mma::pack(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
            }
            #pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                uint32_t bv[4];
                fg::ldmatrix_x4_trans(bv, sV + swz_at<V_ROW_BYTES>(v_off, v_r, v_c, kk * 16, dp * 2));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma::run(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
                    Mma::run(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
        n_block = n_next;
        cls = next_cls;
    }

    // Epilogue: O / row_sum staged through shared memory for 16-byte stores; lse = ln(sum) + max.
    fg::cp_async_wait_all();
    __syncthreads();
    const int64_t lse_row0 = (int64_t)bh * seqlen_q;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = row_sum[mt][r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            const bool empty = sum == 0.f || row_max[mt][r] == -INFINITY;
            const float inv = empty ? 0.f : 1.f / sum;
            const int row = warp * WARP_M + mt * 16 + lane / 4 + r * 8;
            #pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const uint32_t packed = Mma::pack(acc_o[mt][dt][2 * r] * inv, acc_o[mt][dt][2 * r + 1] * inv);
                const uint32_t addr = sQ + fg::swz(row, dt, V_ROW_BYTES) + (lane % 4) * 2 * ELEM_BYTES;
                asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(packed));
            }
            if (lane % 4 == 0 && m0 + row < seqlen_q)
                lse[lse_row0 + m0 + row] = empty ? -INFINITY : (row_max[mt][r] + __log2f(sum)) * LN2;
        }
    __syncthreads();
    constexpr int O_CHUNKS_PER_ROW = HEAD_DIM_V / CHUNK_ELEMS;
    elem_t* o_blk = o + b * o_sb + h * o_sh + (int64_t)m0 * o_ss;
    #pragma unroll
    for (int i = threadIdx.x; i < BLOCK_M * O_CHUNKS_PER_ROW; i += THREADS) {
        const int row = i / O_CHUNKS_PER_ROW, chunk = i % O_CHUNKS_PER_ROW;
        if (m0 + row < seqlen_q) {
            uint4 val;
            asm volatile("ld.shared.v4.b32 { %0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                         : "r"(sQ + fg::swz(row, chunk, V_ROW_BYTES)));
            *reinterpret_cast<uint4*>(o_blk + row * o_ss + chunk * CHUNK_ELEMS) = val;
        }
    }
}
