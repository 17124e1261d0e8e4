// The e4m3 KV cache of the decode kernels (flashgen/families/decode.py, "FP8 KV cache"): four e4m3 bytes of an ldmatrix
// fragment -> two packed fp16 / bf16 pairs in registers, and the index maps that go with it.  The integer parts are
// __host__ too: tests/unit/test_decode_fp8.py builds this file with the host compiler and checks them against torch's
// e4m3 values and a numpy model of the mma.sync m16n8k16 fragments.
//
// Pairing: a 32-bit word x holding bytes b0 b1 b2 b3 gives the pairs even = (b0, b2) and odd = (b1, b3) (the first of
// each pair in the low half).  That is two shifts and masks per pair (the bytes already sit in the high byte of a
// 16-bit half, or do after x << 8) and one exact multiply, no byte permute.
//   K (ldmatrix, B operand of S = Q K^T): thread t of a quad holds bytes 4t .. 4t + 3 of a key row's 16-byte chunk, so
//     b0 = even holds columns 4t, 4t + 2 (mma k = 2t, 2t + 1) and b1 = odd columns 4t + 1, 4t + 3 (k = 2t + 8, 2t + 9):
//     column p of a 16-column group is multiplied at k = k_order(p), and the Q tile is stored in that order (q_permute).
//   V (ldmatrix.trans of byte pairs, B operand of O = P V): thread (g, t) holds V[2t][2g], V[2t][2g + 1], V[2t + 1][2g],
//     V[2t + 1][2g + 1] of a 16-byte chunk, so even = keys 2t, 2t + 1 of column 2g and odd the same of column 2g + 1:
//     one MMA over the even columns and one over the odd ones; their accumulators c0 c1 (row g) are the output columns
//     o_col(t, odd, j) = 4t + 2j + odd: the four consecutive columns 4t .. 4t + 3 of the chunk.
// e4m3fn's NaN codes (0x7f, 0xff) read as +-480 (no NaN check on the load path); every finite code is exact.
#ifndef FG_DECODE_FP8_CUH
#define FG_DECODE_FP8_CUH
#include <stdint.h>

namespace fg {
namespace kv8 {

// prmt in its default mode: result byte i is byte (s >> 4i) & 7 of the 8 bytes {y, x} (x the low word).
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
#endif
}

// The mma k index (0..15) at which column p (0..15) of a 16-column group of the head dim is multiplied (K's pairing
// above): p = 4t + r -> 2t + r / 2 + 8 (r % 2).  flashgen.families.decode.fp8_k_order is the same map.
__host__ __device__ __forceinline__ int k_order(int p) { return 2 * (p >> 2) + ((p >> 1) & 1) + 8 * (p & 1); }

// Q in k_order: the 16-byte chunk of columns 8h .. 8h + 7 of a 16-column group (2-byte elements, words x y z w)
// -> lo: its two words of the group's first 16-byte chunk (byte offset 8h), hi: its two of the second (offset 8h):
// column 4t + r goes to position k_order(4t + r).
__host__ __device__ __forceinline__ void q_permute(uint32_t x, uint32_t y, uint32_t z, uint32_t w,
                                                   uint32_t (&lo)[2], uint32_t (&hi)[2]) {
    lo[0] = byte_perm(x, y, 0x5410);  // columns 8h, 8h + 2      -> k 4h, 4h + 1
    lo[1] = byte_perm(z, w, 0x5410);  // columns 8h + 4, 8h + 6  -> k 4h + 2, 4h + 3
    hi[0] = byte_perm(x, y, 0x7632);  // columns 8h + 1, 8h + 3  -> k 8 + 4h, 8 + 4h + 1
    hi[1] = byte_perm(z, w, 0x7632);  // columns 8h + 5, 8h + 7  -> k 8 + 4h + 2, 8 + 4h + 3
}

// The output column (0..15 of a 16-column chunk) of accumulator c_j (j = 0, 1) of quad thread t in the even (odd = 0)
// or odd (odd = 1) V MMA.
__host__ __device__ __forceinline__ int o_col(int t, int odd, int j) { return 4 * t + 2 * j + odd; }

// Four e4m3 -> the pairs even = (b0, b2), odd = (b1, b3) as fp16 bits of value * 2^-8: sign to bit 15, exponent and
// mantissa one bit down (e4m3's bias 7 against fp16's 15); e4m3 subnormals land on fp16 subnormals of the same scale.
__host__ __device__ __forceinline__ void e4m3x4_f16_bits(uint32_t x, uint32_t& even, uint32_t& odd) {
    const uint32_t y = x << 8;
    odd = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
    even = (y & 0x80008000u) | ((y >> 1) & 0x3f803f80u);
}
// The same as bf16 bits of value * 2^-120 (bias 127): exponent and mantissa four bits down.
__host__ __device__ __forceinline__ void e4m3x4_bf16_bits(uint32_t x, uint32_t& even, uint32_t& odd) {
    const uint32_t y = x << 8;
    odd = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
    even = (y & 0x80008000u) | ((y >> 4) & 0x07f007f0u);
}

}  // namespace kv8
}  // namespace fg

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
namespace fg {
namespace kv8 {
// Four e4m3 -> even / odd packed pairs of T, exact: the bit moves above and one multiply by the power of two they
// left out (2^8 for fp16: every e4m3 is a normal fp16 after it; 2^120 for bf16: a normal bf16).  Neither multiply
// flushes subnormal inputs (mul.rn.f16x2 without .ftz; fma.rn.bf16x2 has no .ftz).
template <class T> struct E4m3;
template <> struct E4m3<__half> {
    static __device__ __forceinline__ void to(uint32_t x, uint32_t& even, uint32_t& odd) {
        e4m3x4_f16_bits(x, even, odd);
        const uint32_t s = 0x5c005c00u;  // 256 in both halves
        asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(even) : "r"(s));
        asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(odd) : "r"(s));
    }
};
template <> struct E4m3<__nv_bfloat16> {
    static __device__ __forceinline__ void to(uint32_t x, uint32_t& even, uint32_t& odd) {
        e4m3x4_bf16_bits(x, even, odd);
        const uint32_t s = 0x7b807b80u, z = 0x80008000u;  // 2^120 in both halves; -0 (x * s + -0 = x * s)
        asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(even) : "r"(s), "r"(z));
        asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(odd) : "r"(s), "r"(z));
    }
};
}  // namespace kv8
}  // namespace fg
#endif
#endif
