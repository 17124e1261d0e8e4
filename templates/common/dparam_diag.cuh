{#- The diagonal form of the param gradients in the Hopper backward (templates/common/dparam.j2, sm_90/bwd.cu.j2): a
    warp's sums per diagonal by shuffles, stored to its own shared slots, and the CTA tile's sum per diagonal from
    them.  Templates on the value type: tests/unit/test_dparam_kernels.py runs warp_diag_sums on the host (a warp of
    32 threads) on lists of elements. -#}
namespace fg {
// A warp's slice of an m64nN wgmma accumulator is 16 rows x 8 NQ columns: lane l (g = l / 4, a = l % 4) holds rows
// g + 8 r and columns 8 j + 2 a + e, element (j, r, e) on diagonal u = col - row = 8 (D - 1) + 2 a + e - g with
// D = j - r + 1 in [0, NQ].  warp_diag_sums takes the lane's sums by diagonal, s[2 D + e], and stores the warp's sum
// of diagonal u to slots[u + 16] (u in [-15, 8 NQ); every other slot of the warp_diag_slots<NQ>() gets 0): each slot
// by one lane, no atomics, a fixed order of adds.
//   Stream e of a lane (its registers s[2 D + e]) lies on u + 8 = 8 B + rho: residue rho = (2 a + e - g) mod 8, block
// B = D - (2 a + e - g < 0) in [-1, NQ], register i = B + 1 below.  Eight streams (lane, e) share each rho; summed
// block by block in three steps:
//   1. a lane keeps its stream 0 and adds the stream 1 of its rho: lane l + 4's where g is even, else lane (a - 1)
//      mod 4 of quad g - 1's; the lanes of a rho are now a = 0 .. 3, g = (2 a - rho) mod 8, one stream each.
//   2. lanes a, a ^ 1 of a rho (quads g, g +- 2) halve the blocks: a % 2 keeps the odd i, adds its partner's.
//   3. lanes a, a ^ 2 (l ^ 18) halve them again: lane a keeps i = 4 m + a, diagonal u + 16 = 32 m + 8 a + rho.
template <int NQ>
__host__ __device__ constexpr int warp_diag_slots() { return 32 * ((NQ + 5) / 4); }

template <int NQ, class T>
__device__ __forceinline__ void warp_diag_sums(const T (&s)[2 * (NQ + 1)], T* slots, int lane) {
    constexpr int NB = NQ + 2, NX = (NB + 1) / 2, NY = (NX + 1) / 2;  // a lane's blocks before 2., after 2., after 3.
    const int g = lane / 4, a = lane % 4, o = 2 * a - g;
    const auto at = [&s](int d, int e) { return d >= 0 && d <= NQ ? s[2 * d + e] : T{}; };
    // 1. by block: stream 0 here (D = i - 1 where o >= 0, else i) + stream 1 of lane from1 (o + 1 for its o)
    const int from1 = g % 2 == 0 ? lane + 4 : lane - 4 - a + (a + 3) % 4;
    T w[NB];
    #pragma unroll
    for (int i = 0; i < NB; ++i) {
        const T s0 = o >= 0 ? at(i - 1, 0) : at(i, 0);
        const T s1 = o + 1 >= 0 ? at(i - 1, 1) : at(i, 1);
        w[i] = s0 + __shfl_sync(0xffffffffu, s1, from1);
    }
    // 2. pairs of blocks: the even one to a % 2 == 0, the odd one to a % 2 == 1
    const int h2 = a % 2, from2 = 4 * ((g + (h2 ? 6 : 2)) % 8) + (a ^ 1);
    T x[NX];
    #pragma unroll
    for (int k = 0; k < NX; ++k) {
        const T lo = w[2 * k], hi = 2 * k + 1 < NB ? w[2 * k + 1] : T{};
        x[k] = (h2 ? hi : lo) + __shfl_sync(0xffffffffu, h2 ? lo : hi, from2);
    }
    // 3. pairs again, by a / 2; each lane stores its NY sums
    const int h3 = a / 2, slot = 8 * a + (o + 8) % 8;
    #pragma unroll
    for (int m = 0; m < NY; ++m) {
        const T lo = x[2 * m], hi = 2 * m + 1 < NX ? x[2 * m + 1] : T{};
        slots[32 * m + slot] = (h3 ? hi : lo) + __shfl_xor_sync(0xffffffffu, h3 ? lo : hi, 18);
    }
}

// The CTA tile's sum on diagonal c (query - key in the tile) of 8 warps' slots (warp_diag_sums, SLOTS each, warp w's
// at slots + w * SLOTS): warp w's slice starts at key 16 (w % 4) + KW (w / 4) and query QW (w / 4) of the tile (KW, QW:
// the second warpgroup's offsets), so c is its diagonal u = c + 16 (w % 4) + (KW - QW) (w / 4).  Warps in order.
template <int SLOTS, int KW, int QW, class T>
__device__ __forceinline__ T diag_tile_sum(const T* slots, int c) {
    T sum{};
    #pragma unroll
    for (int w = 0; w < 8; ++w) {
        const int i = c + 16 + 16 * (w % 4) + (KW - QW) * (w / 4);
        if (i >= 0 && i < SLOTS) sum = sum + slots[w * SLOTS + i];
    }
    return sum;
}
}  // namespace fg
