namespace fg {
// Interval arithmetic on 64-bit integer ranges (namespace fg::ivi; after common/masktiles.cuh, whose
// rules these are, one for one, and whose truths and classes they share), for a mask whose numbers
// are all int32 (no float and no tensor read: flashgen/analysis/masktiles.py, integer_only): a range
// takes two registers where a double one takes four, which lets the Hopper backward classify its
// steps without spilling.  INF stands for infinity (every finite value here is an int32 or the sum or
// difference of two, far below it); sums saturate there, and a product or quotient of numbers
// outside int32 is unknown, as i32 makes it where the double rules compute it first.
namespace ivi {
using iv::T;
constexpr long long INF = 1ll << 40;
constexpr long long I32_MIN = -2147483648ll, I32_MAX = 2147483647ll;
struct R { long long lo, hi; };  // every value lies in [lo, hi]; +-INF: unbounded

FG_HD R exact(long long v) { return {v, v}; }
FG_HD R range(long long lo, long long hi) { return {lo, hi}; }
FG_HD R any() { return {-INF, INF}; }
FG_HD long long lmin(long long x, long long y) { return x < y ? x : y; }
FG_HD long long lmax(long long x, long long y) { return x > y ? x : y; }
FG_HD long long sat(long long x) { return x < -INF ? -INF : (x > INF ? INF : x); }
FG_HD bool fin(long long x) { return x > -INF && x < INF; }
FG_HD bool in32(long long x) { return x >= I32_MIN && x <= I32_MAX; }

FG_HD R neg(R a) { return {-a.hi, -a.lo}; }
FG_HD R add(R a, R b) { return {sat(a.lo + b.lo), sat(a.hi + b.hi)}; }
FG_HD R sub(R a, R b) { return {sat(a.lo - b.hi), sat(a.hi - b.lo)}; }
FG_HD R i32(R a) { return (a.lo < I32_MIN || a.hi > I32_MAX) ? any() : a; }

FG_HD R mul(R a, R b) {
    if (!(in32(a.lo) && in32(a.hi) && in32(b.lo) && in32(b.hi))) {  // i32 makes such a product unknown
        const bool zero = (a.lo == 0 && a.hi == 0) || (b.lo == 0 && b.hi == 0);  // 0 * inf = 0
        return zero ? exact(0) : any();
    }
    const long long w = a.lo * b.lo, x = a.lo * b.hi, y = a.hi * b.lo, z = a.hi * b.hi;
    return {lmin(lmin(w, x), lmin(y, z)), lmax(lmax(w, x), lmax(y, z))};
}
// C integer division of int32 values, y != 0; false where the double rule gives NAN (unknown).
FG_HD bool trunc_div(long long x, long long y, long long& r) {
    if (!fin(x)) { if (!fin(y)) return false; r = (x > 0) == (y > 0) ? INF : -INF; return true; }
    if (!fin(y)) { r = 0; return true; }
    if (y == -1) { r = -x; return true; }
    if (!(in32(x) && in32(y))) return false;
    r = x / y;
    return true;
}
FG_HD R div(R a, R b, bool) {
    if (b.lo <= 0 && 0 <= b.hi) return any();
    long long w, x, y, z;
    if (b.lo == b.hi && fin(b.lo)) {  // one divisor: monotone, 2 divisions
        if (!trunc_div(a.lo, b.lo, w) || !trunc_div(a.hi, b.lo, x)) return any();
        return b.lo > 0 ? R{w, x} : R{x, w};
    }
    if (!trunc_div(a.lo, b.lo, w) || !trunc_div(a.lo, b.hi, x) || !trunc_div(a.hi, b.lo, y)
        || !trunc_div(a.hi, b.hi, z))
        return any();
    return {lmin(lmin(w, x), lmin(y, z)), lmax(lmax(w, x), lmax(y, z))};
}
// C % (the sign of the dividend), by an exact divisor.
FG_HD R mod(R a, R b, bool) {
    if (b.lo != b.hi || b.lo == 0 || !fin(b.lo)) return any();
    const long long c = b.lo < 0 ? -b.lo : b.lo;
    if (a.lo >= 0 && fin(a.hi) && a.lo / c == a.hi / c) return {a.lo % c, a.hi % c};
    if (a.hi <= 0 && fin(a.lo) && (-a.lo) / c == (-a.hi) / c) return {-((-a.lo) % c), -((-a.hi) % c)};
    return {a.lo >= 0 ? 0 : -(c - 1), a.hi <= 0 ? 0 : c - 1};
}

using ivr::lt; using ivr::le; using ivr::gt; using ivr::ge; using ivr::eq; using ivr::ne;
using ivr::cond; using ivr::fabs_; using ivr::min_; using ivr::max_;  // common/masktiles_intrules.cuh
}  // namespace ivi
}  // namespace fg
