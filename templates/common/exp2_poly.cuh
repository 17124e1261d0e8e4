// 2^x on the FMA pipe: part of the Hopper forward's softmax exponentials (Options.hopper_fwd.exp2_poly).
//
// Why: P = 2^x is one MUFU.EX2 per score, and the SFU gives 16 results per clock and SM against 128 FFMA, so at FP8
// (whose wgmma is twice as fast) and at head_dim 64 the softmax waits on the SFU.  FlashAttention-4 computes a part
// of the exponentials with a polynomial instead (flash_attn/cute/utils.py, ex2_emulation, with its degree-3
// coefficients POLY_EX2[3]; flash_attn/cute/softmax.py, apply_exp2_convert picks the elements).  The same method:
//
//   xc = max(x, -127)
//   r  = xc + 1.5 * 2^23, rounded down         floor(xc) lands in r's low mantissa bits (|floor(xc)| < 2^22)
//   f  = xc - (r - 1.5 * 2^23)                  = xc - floor(xc) in [0, 1], both subtractions exact but the
//                                              second's rounding: x within half an ulp of 1 below an integer gives 1
//   p  = 1 + f (c1 + f (c2 + f c3))            ~ 2^f, degree-3 minimax on [0, 1], Horner: 3 FFMA; p in [1, 2)
//   y  = p's bits + (r's bits << 23)            2^floor(xc) * p: r's bits are 0x4B400000 + floor(xc), and
//                                              0x4B400000 << 23 is 0 mod 2^32, so this adds floor(xc) to the exponent
//
// Error bound: |p(f) - 2^f| / 2^f < 8.8e-5 (about 2^-13.5) over [0, 1] in float32 arithmetic, so over x in [-126, 0]
// (the result's exponent add is exact there); tests/unit/test_exp2_poly.py measures 8.77e-5 against std::exp2 on the
// host build of this function (26.8 million x), and finds it monotone.  That is far under what P is rounded to before the PV GEMM (half an ulp: bf16 2^-9,
// fp16 2^-11, e4m3 2^-4); ex2.approx.ftz.f32 itself is within 2^-22.
//
// Edges (the softmax's x is <= 0: a score minus its row max, scaled): x <= -127, a masked score's -inf included,
// gives f = 0 and p = 1 exactly, whose bits (127 << 23) plus -127 << 23 are +0.0: exactly 0, no select needed, so a
// fully masked row's sum stays 0 and its lse -inf.  -127 < x < -126 gives a subnormal below 2^-126 (ex2.approx.ftz
// gives 0; either is nothing next to the row max's P of 1).  NaN gives 0 (fmaxf drops it); x > 127 is not handled.
//
// SASS (ptxas 13, sm_90a): FMNMX, FADD.RM, 2 FADD, 3 FFMA and an IMAD (the shift and add): 8 instructions, 7 on the
// FMA pipe, no MUFU.  Compiled as host code by the unit tests (with host stand-ins for the intrinsics).
namespace fg {

__device__ __forceinline__ float exp2_poly(float x) {
    const float xc = fmaxf(x, -127.f);
    const float r = __fadd_rd(xc, 12582912.f);  // 1.5 * 2^23 + floor(xc)
    const float f = xc - (r - 12582912.f);       // in [0, 1]
    float p = fmaf(f, 0.077119089663028717041015625f, 0.227564394474029541015625f);
    p = fmaf(p, f, 0.695146143436431884765625f);
    p = fmaf(p, f, 1.f);
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(r) << 23));
}

// The softmax's P = 2^x for 8-column tile j of a row's scores (j: an unrolled loop's index, so the choice folds at
// compile time): SIXTEENTHS / 16 of the tiles, spread evenly (Bresenham: tile j where floor((j + 1) S / 16) steps
// past floor(j S / 16), so the last of each 16 / S), by exp2_poly on the FMA pipe, the others by ex2.approx on the
// SFU.  A thread holds two columns of each tile in each of its two rows: of its NS = BLOCK_N / 8 tiles per row,
// NS * SIXTEENTHS / 16 (rounded down) put 4 exponentials each on the FMA pipe.
template <int SIXTEENTHS>
__device__ __forceinline__ float softmax_exp2_split(float x, int j) {
    static_assert(SIXTEENTHS >= 1 && SIXTEENTHS <= 16, "0 sixteenths: fg::exp2_approx alone, all on the SFU");
    if ((j + 1) * SIXTEENTHS / 16 != j * SIXTEENTHS / 16) return exp2_poly(x);
    return exp2_approx(x);
}

}  // namespace fg
