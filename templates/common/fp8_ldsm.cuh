// The fp8 forward's second V transposer (hopper_fwd.Options.fp8_transpose = "ldsm"; included
// after common/fp8.cuh, whose key_of_col, swz and byte_perm it uses).  Host-compilable
// (tests/unit/test_fp8_layout_host.py emulates ldmatrix / stmatrix per lane and checks that it
// writes VTranspose's bytes).

namespace fg {
namespace fp8 {

// VTranspose's result (the same sVt bytes) from ldmatrix / stmatrix (PTX ISA, "Warp-level matrix
// load instruction: ldmatrix" and "... store instruction: stmatrix", sm_90; FlashAttention-3's
// fp8 V transpose pairs them the other way round, ldmatrix.trans with stmatrix).  Warp unit
// (blk, dc): the 32 keys 32 blk.. x the 16 V row bytes 16 dc.., 512 bytes, one
// ldmatrix.x4 (non-transposed), 4 byte permutes and one stmatrix.x4.trans:
// - ldmatrix.x4: lane l gets in register i bytes 4 (l % 4).. of row l / 4 of matrix i, whose row
//   r is the 16 bytes at lane 8 i + r's address.  Row s of matrix i is V row
//   load_key(i, s) (columns 16 (i / 2) + 2 s + e of Vt, e = (s % 2) ^ (i % 2)), bytes 16 dc..:
//   lane (s = l / 4, t = l % 4) holds the keys of Vt column pairs s and 8 + s of the step, bytes
//   16 dc + 4 t + 0..3; the parity swap e puts 8 distinct key % 8 in each matrix's rows (no bank
//   conflict under either swizzle).
// - stmatrix.x4.trans: the 16-bit element of lane l's register j in half h goes to byte pair
//   l / 4 of row 2 (l % 4) + h of matrix j (transposed m8n8 of b16), whose row r is stored at
//   lane 8 j + r's address: Vt row 16 dc + store_row(j, r), columns 32 blk + 16 (j / 2).. .  A
//   byte pair is two adjacent Vt columns (keys) of one Vt row (a V byte), so register j half h
//   takes byte 2 b' + h (b' = j % 2 ^ t / 2) of the words of keys 2 s, 2 s + 1 of column chunk
//   j / 2: one byte permute per register (selectors per lane, sel()); b' spreads the rows of a
//   matrix over 8 banks.
template <int BLOCK_N, int HEAD_DIM, int PANEL>
struct VTransposeLdsm {
    static constexpr int NB = BLOCK_N / 32, ND = HEAD_DIM / 16, ITERS = NB * ND;
    static_assert(BLOCK_N == 128 || BLOCK_N == 64, "a Vt row is one swizzle span");
    static_assert(HEAD_DIM % PANEL == 0 && (PANEL == 128 || PANEL == 64), "head_dim");

    // The unit of warp iteration w (the same for every lane).
    __host__ __device__ static void unit(int w, int& blk, int& dc) { blk = w % NB; dc = w / NB; }
    // The key (within the 32-key step) of row s of ldmatrix matrix i.
    __host__ __device__ static int load_key(int i, int s) {
        return key_of_col(16 * (i >> 1) + 2 * s + ((s & 1) ^ (i & 1)));
    }
    // The Vt row (within the 16 of a unit) of row r of stmatrix matrix j; its columns are
    // 16 (j / 2).. of the step.
    __host__ __device__ static int store_row(int j, int r) {
        const int t = r >> 1;
        return 4 * t + 2 * ((j & 1) ^ (t >> 1)) + (r & 1);
    }
    // Byte offsets (in a staging stage and a Vt stage) of the rows lane `lane` addresses in unit
    // (blk, dc): row lane % 8 of ldmatrix / stmatrix matrix lane / 8.
    __host__ __device__ static uint32_t v_offset(int lane, int blk, int dc) {
        return (uint32_t)((16 * dc / PANEL) * BLOCK_N * PANEL)
               + swz<PANEL>(32 * blk + load_key(lane >> 3, lane & 7), 16 * dc % PANEL);
    }
    __host__ __device__ static uint32_t vt_offset(int lane, int blk, int dc) {
        return swz<BLOCK_N>(16 * dc + store_row(lane >> 3, lane & 7), 32 * blk + 16 * (lane >> 4));
    }
    // The byte-permute selectors of lane `lane` for registers j = 2 a + b: sel[b] (word of the
    // even key of the pair first; lanes with odd s hold the odd key's word in x[2 a]).
    __host__ __device__ static void sel(int lane, uint32_t (&s)[2]) {
        const int odd = (lane >> 2) & 1, t = lane & 3;
        for (int b = 0; b < 2; ++b) {
            const int bp = b ^ (t >> 1);
            s[b] = odd ? (bp ? 0x3726u : 0x1504u) : (bp ? 0x7362u : 0x5140u);
        }
    }
    // x: ldmatrix's registers -> y: stmatrix's (y[2 a + b] = PRMT(x[2 a], x[2 a + 1], sel[b])).
    __host__ __device__ static void transpose(const uint32_t (&x)[4], const uint32_t (&s)[2], uint32_t (&y)[4]) {
        y[0] = byte_perm(x[0], x[1], s[0]);
        y[1] = byte_perm(x[0], x[1], s[1]);
        y[2] = byte_perm(x[2], x[3], s[0]);
        y[3] = byte_perm(x[2], x[3], s[1]);
    }
    // offset(w) = (offset(lane, unit 0) ^ x(w)) + add(w), as VTranspose::iter_terms.
    __host__ __device__ static void lane_offsets(int lane, uint32_t& v, uint32_t& vt) {
        v = v_offset(lane, 0, 0);
        vt = vt_offset(lane, 0, 0);
    }
    __host__ __device__ static void iter_terms(unsigned w, uint32_t& xv, uint32_t& av, uint32_t& xvt, uint32_t& avt) {
        constexpr unsigned DP = PANEL / 16;  // 16-byte chunks per panel row
        const unsigned blk = w % NB, dc = w / NB;
        xv = (dc % DP) << 4;
        av = (dc / DP) * (BLOCK_N * PANEL) + blk * (32u * PANEL);
        xvt = (2u * blk) << 4;
        avt = dc * (16u * BLOCK_N);
    }
#ifdef __CUDA_ARCH__
    // As VTranspose::run; `v`, `vt`, `s`: this lane's lane_offsets and sel.
    __device__ static void run(uint32_t sv, uint32_t svt, int warp, int warps,
                               uint32_t v, uint32_t vt, const uint32_t (&s)[2]) {
        #pragma unroll 2
        for (unsigned w = warp; w < (unsigned)ITERS; w += warps) {
            uint32_t xv, av, xvt, avt;
            iter_terms(w, xv, av, xvt, avt);
            uint32_t x[4], y[4];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
                         : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                         : "r"(sv + ((v ^ xv) + av)));
            transpose(x, s, y);
            asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], { %1, %2, %3, %4 };\n"
                         :: "r"(svt + ((vt ^ xvt) + avt)), "r"(y[0]), "r"(y[1]), "r"(y[2]), "r"(y[3]));
        }
    }
#endif
};

}  // namespace fp8
}  // namespace fg
