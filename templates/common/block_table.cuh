// One row of a block table (templates/sm_80/blockmask.cu.j2: one byte per key block, EMPTY / PARTIAL /
// FULL, for the kernel's BLOCK_M x BLOCK_N tiles), walked last to first by a whole warp: 32 entries
// per step (one byte per lane, a ballot), so a long EMPTY run (other documents) costs a step per 32
// blocks.  Every lane of the warp calls prev_live with the same j and gets the same answer.

namespace fg {

struct TableWalk {
    const unsigned char* row;
    // The last live key block at or before j (-1 if none); c becomes its class.  lane: this
    // thread's lane in the warp.
    __device__ __forceinline__ int prev_live(int j, int& c, int lane) const {
        for (; j >= 0; j -= 32) {
            const int jj = j - lane;
            const unsigned live = __ballot_sync(0xffffffffu, jj >= 0 && row[jj] != fg::iv::EMPTY);
            if (live) {
                j -= __ffs(live) - 1;  // the lowest lane holds the largest live block
                c = row[j];
                return j;
            }
        }
        c = fg::iv::EMPTY;
        return -1;
    }
};

}  // namespace fg
