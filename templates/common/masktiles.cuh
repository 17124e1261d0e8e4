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
