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

}  // namespace fg
