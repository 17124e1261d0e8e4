// FP8 (e4m3) pieces of the Hopper forward (FlashAttention-3, Shah et al. 2024, section 3.3).
//
// FP8 wgmma takes K-major operands only, so O += P V needs V^T (K-major in the key index) in
// shared memory: the producer warpgroup's spare warps transpose each V tile, which TMA lands as
// [BLOCK_N keys][HEAD_DIM] bytes, into Vt [HEAD_DIM][BLOCK_N] bytes (VTranspose).
//
// P goes from the fp32 accumulator layout to the e4m3 A-operand layout inside each thread, with
// no shuffles (PTX ISA, "Matrix fragments for wgmma.m64nNk32"): of a 32-key step the thread holds
// keys 2t, 2t+1, 2t+8, 2t+9 (and 16 + those; t = lane % 4) of its two rows, where the A layout
// wants columns 4t..4t+3 (and 16 + those).  So A column c of a step carries key key_of_col(c) of
// that step (acc_of says which accumulator register), and Vt is written with its columns in the
// same order: both operands of P V are permuted alike and the product is unchanged.
// Host-compilable (tests/unit/test_fp8_layout_host.py runs these maps against a model of the
// PTX fragment layouts).

namespace fg {
namespace fp8 {

// The key (0..31, within its 32-key step) of A-operand / Vt column c (0..31).
__host__ __device__ __forceinline__ int key_of_col(int c) {
    const int half = c >> 4, t = (c >> 2) & 3, i = c & 3;
    return 16 * half + 2 * t + (i & 1) + 8 * (i >> 1);
}

// The accumulator register (of the 16 a thread holds for one 32-key step: acc_s[16 kk + n])
// that byte n (0..3) of A register m (0..3) of that step takes.
__host__ __device__ __forceinline__ constexpr int acc_of(int m, int n) {
    return 8 * (m >> 1) + 2 * (m & 1) + (n & 1) + 4 * (n >> 1);
}

// Byte offset of (row, byte) in a tile of ROW-byte rows under the ROW-byte TMA / wgmma swizzle
// (128: 16-byte chunk ^= row % 8; 64: chunk ^= (row / 2) % 4).
template <int ROW>
__host__ __device__ __forceinline__ uint32_t swz(int row, int byte) {
    static_assert(ROW == 128 || ROW == 64, "swizzle span");
    const int chunk = (byte >> 4) ^ (ROW == 128 ? (row & 7) : ((row >> 1) & 3));
    return (uint32_t)(row * ROW + (chunk << 4) + (byte & 15));
}

// __byte_perm (PRMT): byte k of the result is byte sel[k] (a nibble) of {y, x}.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, sel);
#else
    const uint64_t xy = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int k = 0; k < 4; ++k) r |= (uint32_t)((xy >> (8 * ((sel >> (4 * k)) & 7))) & 0xff) << (8 * k);
    return r;
#endif
}

// Transposes one V tile: the staging (TMA layout: HEAD_DIM / PANEL panels of [BLOCK_N][PANEL]
// bytes, PANEL-byte swizzle) -> Vt ([HEAD_DIM][BLOCK_N] bytes, BLOCK_N-byte swizzle), columns in
// key_of_col order per 32-key step.  Work unit (g, q): Vt columns 4g..4g+3 x V row bytes
// 4q..4q+3, one 4 x 4 byte transpose (4 loads, 8 byte permutes, 4 stores).  Lane l of warp
// iteration w takes unit(l, w): with 128-byte panels and BLOCK_N 128 each load and each store of
// a warp touches 32 distinct banks.
template <int BLOCK_N, int HEAD_DIM, int PANEL>
struct VTranspose {
    static constexpr int NG = BLOCK_N / 4, NQ = HEAD_DIM / 4, ITERS = NG * NQ / 32;
    static_assert(BLOCK_N == 128 || BLOCK_N == 64, "a Vt row is one swizzle span");
    static_assert(NQ % 8 == 0 && PANEL % 64 == 0, "head_dim");

    // The unit of lane `lane` in warp iteration w (0 <= w < ITERS): bank-conflict free because
    // the store banks are 4 * ((g / 4) ^ (d % 8)) + g % 4 and the load banks
    // 4 * ((q / 4) ^ (key % 8)) + q % 4 with key % 8 = 2 (g % 4) + i % 2, and the lane bits reach
    // every one of them.
    __host__ __device__ static void unit(int lane, int w, int& g, int& q) {
        const int l0 = lane & 1, l1 = (lane >> 1) & 1, l2 = (lane >> 2) & 1, l3 = (lane >> 3) & 1;
        const int l4 = lane >> 4, a = w & 1, b = (w >> 1) & 1, rest = w >> 2;
        g = l2 + 2 * l3 + 4 * (l1 ^ a) + 8 * (l4 ^ b) + 16 * (rest % (NG / 16));
        q = l0 + 2 * l1 + 4 * l4 + 8 * (rest / (NG / 16));
    }
    // The key (row of the V tile) of column 4g + i of Vt.
    __host__ __device__ static int key(int g, int i) { return 32 * (g >> 3) + key_of_col(4 * (g & 7) + i); }
    // Byte offsets of V row `key`, bytes 4q.. in the staging, and of Vt row d, columns 4g.. .
    __host__ __device__ static uint32_t v_offset(int key, int q) {
        return (uint32_t)((4 * q / PANEL) * BLOCK_N * PANEL) + swz<PANEL>(key, 4 * q % PANEL);
    }
    __host__ __device__ static uint32_t vt_offset(int d, int g) { return swz<BLOCK_N>(d, 4 * g); }
    // x[i]: bytes 4q..4q+3 of V row key(g, i) -> y[j]: columns 4g..4g+3 of Vt row 4q + j.
    __host__ __device__ static void transpose(const uint32_t (&x)[4], uint32_t (&y)[4]) {
        const uint32_t t0 = byte_perm(x[0], x[1], 0x5140), t1 = byte_perm(x[0], x[1], 0x7362);
        const uint32_t u0 = byte_perm(x[2], x[3], 0x5140), u1 = byte_perm(x[2], x[3], 0x7362);
        y[0] = byte_perm(t0, u0, 0x5410);
        y[1] = byte_perm(t0, u0, 0x7632);
        y[2] = byte_perm(t1, u1, 0x5410);
        y[3] = byte_perm(t1, u1, 0x7632);
    }
    // The same offsets in two parts, so the loop computes almost nothing per unit: the lane's
    // offsets at w = 0 (lane_offsets) and per iteration an XOR on the swizzle and row bits and an
    // addition above them (iter_terms): offset(w) = (offset(lane, 0) ^ x(w)) + add(w).
    __host__ __device__ static void lane_offsets(int lane, uint32_t (&v)[4], uint32_t (&vt)[4]) {
        int g, q;
        unit(lane, 0, g, q);
        for (int i = 0; i < 4; ++i) v[i] = v_offset(key(g, i), q);
        for (int j = 0; j < 4; ++j) vt[j] = vt_offset(4 * q + j, g);
    }
    __host__ __device__ static void iter_terms(unsigned w, uint32_t& xv, uint32_t& av, uint32_t& xvt, uint32_t& avt) {
        // powers of two throughout: shifts and masks, no divisions
        constexpr unsigned GH = NG / 16, QP = PANEL / 32;  // ghi values; q values (of 4 bytes) per panel row, over 8
        static_assert((GH & (GH - 1)) == 0 && (QP & (QP - 1)) == 0, "powers of two");
        const unsigned ab = w & 3u, rest = w >> 2, ghi = rest & (GH - 1), qhi = rest / GH;
        xv = ab * 16u * PANEL + ((2u * (qhi & (QP - 1))) << 4);
        av = ghi * 64u * PANEL + (qhi / QP) * (BLOCK_N * PANEL);
        xvt = (ab + 4u * ghi) << 4;
        avt = qhi * (32u * BLOCK_N);
    }
#ifdef __CUDA_ARCH__
    // Warp `warp` of `warps` transposing warps: sv (a staging stage) -> svt (a Vt stage); `v`,
    // `vt`: this lane's lane_offsets.
    __device__ static void run(uint32_t sv, uint32_t svt, int warp, int warps,
                               const uint32_t (&v)[4], const uint32_t (&vt)[4]) {
        #pragma unroll 2
        for (unsigned w = warp; w < (unsigned)ITERS; w += warps) {
            uint32_t xv, av, xvt, avt;
            iter_terms(w, xv, av, xvt, avt);
            uint32_t x[4], y[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x[i]) : "r"(sv + ((v[i] ^ xv) + av)));
            transpose(x, y);
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(svt + ((vt[j] ^ xvt) + avt)), "r"(y[j]));
        }
    }
#endif
};

#ifdef __CUDA_ARCH__
// Four e4m3 values (round to nearest, saturating) from fp32, a in the lowest byte.
__device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return (uint32_t)lo | ((uint32_t)hi << 16);
}
#endif

}  // namespace fp8
}  // namespace fg
