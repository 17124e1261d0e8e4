// The class of a rectangle of whole tiles in a block table (templates/sm_80/blockmask.cu.j2: one byte per
// (query block, key block), EMPTY / PARTIAL / FULL, for the kernel's BLOCK_M x BLOCK_N tiles): the Hopper
// backward's tile classes for a mask that reads tensors (Options.hopper_bwd.tensor_masks).

namespace fg {

// Query blocks m0 .. m1 x key blocks n0 .. n1 of one (batch, head) slice of the table (n_blocks key blocks
// a row) together: EMPTY or FULL where every tile is, else PARTIAL.
// (FG_HD, common/masktiles.cuh: host code too, for tests/unit/test_hopper_bwd.py.)
FG_HD int table_class(const unsigned char* slice, int n_blocks, int m0, int m1, int n0, int n1) {
    int cls = -1;
    for (int m = m0; m <= m1; ++m)
        for (int n = n0; n <= n1; ++n) {
            const int c = slice[(int64_t)m * n_blocks + n];
            if (cls >= 0 && c != cls) return fg::iv::PARTIAL;
            cls = c;
        }
    return cls < 0 ? fg::iv::EMPTY : cls;
}

// Lane `lane`'s part of the hull [first, end) of the live query blocks of key block n_block for the heads h0 .. h0 +
// heads - 1: query blocks lane, lane + 32, ...; the kernel reduces it over warp 0 (min of first, max of end).
FG_HD int2 table_hull_lane(const unsigned char* tab, int64_t sb, int64_t sh, int b, int h0, int heads, int n_block,
                           int n_blocks, int m_blocks, int lane) {
    int first = m_blocks, end = 0;
    for (int hg = 0; hg < heads; ++hg) {
        const unsigned char* col = tab + b * sb + (h0 + hg) * sh + n_block;
        for (int m = lane; m < m_blocks; m += 32)
            if (col[(int64_t)m * n_blocks] != fg::iv::EMPTY) {
                first = first < m ? first : m;
                end = end > m + 1 ? end : m + 1;
            }
    }
    return make_int2(first, end);
}

}  // namespace fg
