namespace fg {
// The rules of common/masktiles.cuh that do no arithmetic on a range's bounds (comparisons, selects, abs, min,
// max), written once for the integer ranges: fg::ivi (common/masktiles_int.cuh, 64-bit bounds) and fg::iv32
// (common/masktiles_i32.cuh, int32 bounds) bring them in by using-declarations.  R is a struct {lo, hi}.
namespace ivr {
template <class R> FG_HD iv::T lt(R a, R b) { return {a.lo < b.hi, a.hi >= b.lo}; }
template <class R> FG_HD iv::T le(R a, R b) { return {a.lo <= b.hi, a.hi > b.lo}; }
template <class R> FG_HD iv::T gt(R a, R b) { return {a.hi > b.lo, a.lo <= b.hi}; }
template <class R> FG_HD iv::T ge(R a, R b) { return {a.hi >= b.lo, a.lo < b.hi}; }
template <class R> FG_HD iv::T eq(R a, R b) {
    const bool overlap = a.lo <= b.hi && b.lo <= a.hi;
    const bool same = a.lo == a.hi && b.lo == b.hi && a.lo == b.lo;
    return {overlap, !same};
}
template <class R> FG_HD iv::T ne(R a, R b) { return iv::lnot(eq(a, b)); }

template <class R> FG_HD R cond(iv::T c, R x, R y) {
    if (!c.t) return y;
    if (!c.f) return x;
    return {x.lo < y.lo ? x.lo : y.lo, x.hi > y.hi ? x.hi : y.hi};
}
template <class R> FG_HD R fabs_(R a) {
    if (a.lo >= 0) return a;
    if (a.hi <= 0) return {-a.hi, -a.lo};
    return {0, -a.lo > a.hi ? -a.lo : a.hi};
}
template <class R> FG_HD R min_(R a, R b) {
    return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi};
}
template <class R> FG_HD R max_(R a, R b) {
    return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}
}  // namespace ivr
}  // namespace fg
