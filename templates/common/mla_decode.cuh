// Index maps of the Hopper MLA decode unit (templates/sm_90/decode_mla.cu.j2, flashgen/families/decode.py): where a
// 16-byte chunk of a row lands in the 128-byte-swizzled panels that wgmma reads, which rows and chunks of a 64-key
// block each loading thread copies, where key kv of a request lives in a dense or paged latent cache, which (new
// token, query head) a packed row is, and the wgmma accumulator fragment.  __host__ __device__:
// tests/unit/test_decode_mla_wgmma.py compiles the maps with the host compiler and checks them against brute force.
// Needs fg::Divisor (common/mma_sm80.cuh).
#ifndef FG_MLA_DECODE_CUH
#define FG_MLA_DECODE_CUH

namespace fg {
namespace mla {

// Panels: a tile of `rows` rows (a multiple of 8) and 8 n 16-byte chunks per row is n panels of [rows][128 bytes]
// (64 16-bit columns each), chunk c of row r at byte 16 (c % 8 ^ r % 8) of the row: CU_TENSOR_MAP_SWIZZLE_128B's
// pattern, what a wgmma descriptor of 128-byte swizzle reads (each panel 1024-byte aligned).
__host__ __device__ __forceinline__ uint32_t panel_offset(int row, int chunk, int rows) {
    return (uint32_t)((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// The loads of one 64-key block of 576-column rows (72 chunks): warpgroup g's thread t (0..127, warp t / 32) copies,
// at step i, chunk load_chunk(g, t) of row load_row(g, t, i).  g 0 (the scores) copies panel 8 (the RoPE columns
// 512..575: 8 lanes a row, LOAD_STEPS_ROPE steps), g 1 and 2 (the outputs) panels 0-3 and 4-7, the V columns each
// of them reads (a warp a row, LOAD_STEPS_V steps).  Every (row, chunk) of the block is copied once.
constexpr int LOAD_STEPS_ROPE = 4;
constexpr int LOAD_STEPS_V = 16;
__host__ __device__ __forceinline__ int load_row(int g, int t, int i) {
    return g == 0 ? 16 * (t / 32) + (t % 32) / 8 + 4 * i : 16 * (t / 32) + i;
}
__host__ __device__ __forceinline__ int load_chunk(int g, int t) {
    return g == 0 ? 64 + t % 8 : 32 * (g - 1) + t % 32;
}
// The row of warp w whose page lane l looks up (lanes 16..31 repeat 0..15); a load_row of warp w is 16 w + its lane.
__host__ __device__ __forceinline__ int page_lane_row(int w, int l) { return 16 * w + (l & 15); }

// Where key kv of a request lives: the page (block_table[b, kv / page_size] paged, b dense: `pg`, looked up by the
// caller) and the slot in it; `off` the element offset of its row (pg * k_sp + slot * k_ss), `ok` whether it is
// read: kv < live and pg in [0, num_pages).  Keys not read are zero-filled in shared memory and masked.
struct KeyRow {
    long long off;
    bool ok;
};
__host__ __device__ __forceinline__ int page_entry(int kv, const Divisor& pdiv) { return pdiv.div_nn(kv); }
__host__ __device__ __forceinline__ KeyRow key_row(int kv, int live, int pg, bool paged, const Divisor& pdiv,
                                                   int page_size, int num_pages, long long k_sp, long long k_ss) {
    const int slot = paged ? kv - pdiv.div_nn(kv) * page_size : kv;
    const bool ok = kv < live && (unsigned)pg < (unsigned)num_pages;
    return {ok ? pg * k_sp + slot * k_ss : 0, ok};
}

// GQA packing: packed row prow of the kv head whose query heads start at h0 is new token s = prow / group, query
// head h = h0 + prow % group; its q row is at q_offset (q [B, Hq, Sq_new, D] with strides q_sb, q_sh, q_ss; ragged
// [total_q, Hq, D]: q_start + s tokens of stride q_ss, q_sb unused) and its output row o_row (o [B, Hq, Sq_new, Dv]
// padded: (b Hq + h) Sq_new + s; ragged o [total_q, Hq, Dv]: (q_start + s) Hq + h).
struct PackedRow {
    int s, h;
};
__host__ __device__ __forceinline__ PackedRow packed_row(int prow, int group, int h0) {
    return {prow / group, h0 + prow % group};
}
__host__ __device__ __forceinline__ long long q_offset(PackedRow r, bool ragged, int b, int q_start, long long q_sb,
                                                       long long q_sh, long long q_ss) {
    return (ragged ? (long long)(q_start + r.s) * q_ss : b * q_sb + (long long)r.s * q_ss) + r.h * q_sh;
}
__host__ __device__ __forceinline__ long long o_row(PackedRow r, bool ragged, int b, int q_start, int heads_q,
                                                    int seqlen_q) {
    return ragged ? (long long)(q_start + r.s) * heads_q + r.h : ((long long)b * heads_q + r.h) * seqlen_q + r.s;
}

// The wgmma accumulator fragment (m64nN, f32) of thread (warp w of its warpgroup, lane l): element 4 j + 2 r + e is
// row 16 w + l / 4 + 8 r, column 8 j + 2 (l % 4) + e.
__host__ __device__ __forceinline__ int acc_row(int w, int l, int r) { return 16 * w + l / 4 + 8 * r; }
__host__ __device__ __forceinline__ int acc_col(int l, int j, int e) { return 8 * j + 2 * (l % 4) + e; }

}  // namespace mla
}  // namespace fg

#ifdef __CUDACC__
namespace fg {
namespace mla {
// An arrival on mbarrier `bar` once every cp.async this thread issued so far has landed (the barrier counts it among
// its expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Block until the phase with parity `phase` of mbarrier `bar` has completed: the spin loop inside one asm statement
// (no loop in the C++ between the wgmmas around a wait).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
    asm volatile("{\n.reg .pred p;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}\n" :: "r"(bar), "r"(phase) : "memory");
}
// Orders this thread's generic-proxy shared-memory accesses (st.shared, landed cp.async) with the async proxy's
// (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
}  // namespace mla
}  // namespace fg
#endif
#endif
