namespace fg {
// Interval arithmetic on int32 ranges (namespace fg::iv32; after common/masktiles.cuh, whose rules these are, one
// for one, and whose truths they share), for int expressions every node of which the host analysis bounds inside
// [-(2^31 - 1), 2^31 - 1] over every call (flashgen/analysis/masktiles.py, constant_ranges): the rules are
// inclusion-monotone, so every bound one computes on a tile lies inside the bounds it computes on those of every
// call, and plain int arithmetic is exact (no saturation, no i32 check; negation never meets INT_MIN): a range
// takes two registers and a rule about an instruction per bound.  Used by the Hopper backward's constant-tile
// tests of param reads (hopper_bwd.dparam_const_tiles).
namespace iv32 {
using iv::T;
struct R { int lo, hi; };  // every value lies in [lo, hi]

FG_HD R exact(int v) { return {v, v}; }
FG_HD R range(int lo, int hi) { return {lo, hi}; }
FG_HD R any() { return {-2147483647 - 1, 2147483647}; }
FG_HD int imin(int x, int y) { return x < y ? x : y; }
FG_HD int imax(int x, int y) { return x > y ? x : y; }

FG_HD R neg(R a) { return {-a.hi, -a.lo}; }
FG_HD R add(R a, R b) { return {a.lo + b.lo, a.hi + b.hi}; }
FG_HD R sub(R a, R b) { return {a.lo - b.hi, a.hi - b.lo}; }
FG_HD R i32(R a) { return a; }  // inside int32 by the analysis
FG_HD R mul(R a, R b) {
    const int w = a.lo * b.lo, x = a.lo * b.hi, y = a.hi * b.lo, z = a.hi * b.hi;
    return {imin(imin(w, x), imin(y, z)), imax(imax(w, x), imax(y, z))};
}
// C integer division (truncates toward zero); the analysis bounds a quotient only where the divisor's range holds
// no 0.
FG_HD R div(R a, R b, bool) {
    if (b.lo <= 0 && 0 <= b.hi) return any();
    const int w = a.lo / b.lo, x = a.lo / b.hi, y = a.hi / b.lo, z = a.hi / b.hi;
    return {imin(imin(w, x), imin(y, z)), imax(imax(w, x), imax(y, z))};
}
// C % (the sign of the dividend), by an exact divisor.
FG_HD R mod(R a, R b, bool) {
    if (b.lo != b.hi || b.lo == 0) return any();
    const int c = b.lo < 0 ? -b.lo : b.lo;
    if (a.lo >= 0 && a.lo / c == a.hi / c) return {a.lo % c, a.hi % c};
    if (a.hi <= 0 && (-a.lo) / c == (-a.hi) / c) return {-((-a.lo) % c), -((-a.hi) % c)};
    return {a.lo >= 0 ? 0 : -(c - 1), a.hi <= 0 ? 0 : c - 1};
}

using ivr::lt; using ivr::le; using ivr::gt; using ivr::ge; using ivr::eq; using ivr::ne;
using ivr::cond; using ivr::fabs_; using ivr::min_; using ivr::max_;  // common/masktiles_intrules.cuh
}  // namespace iv32
}  // namespace fg
