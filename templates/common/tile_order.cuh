// The order in which a forward kernel's CTAs (or a persistent CTA's work tiles) take the
// (batch * heads_q + head, query block) pairs: heads in groups that share L2, query-block major
// within a group.  With causal-like masks the blocks are reversed after this (heaviest first), so
// every head of a group starts its heaviest block before any of them starts a lighter one: no
// head's longest rows are left for the end (head-major order left the last heads' ones there, an
// idle tail of ~5% at B=2, S=8k), while the group's K and V stay in L2 (m-major order over all
// heads lost 3-4% to L2 misses at S=16k).  FA3's LPT tile scheduler groups heads the same way.
// lower.tile_coord and lower.head_group mirror both functions.
namespace fg {

struct TileCoord {
    int m_rev;  // query block, in the kernel's order (reversed after this for causal-like masks)
    int bh;     // batch * heads_q + head
};

// Tile t of num_m_blocks * num_bh, heads in ceil(num_bh / group) groups of as equal sizes as can
// be (the first num_bh % n hold one more head; a small last group would leave its heaviest blocks
// for the end), block m_rev of each head of a group in turn.  Needs t < num_m_blocks * num_bh
// (so num_bh >= 1) and group >= 1; no intermediate exceeds num_m_blocks * num_bh, so any grid of
// at most 2^31 - 1 tiles decodes without int overflow (tests/unit/test_tile_order_host.py).
__device__ __forceinline__ TileCoord tile_coord(int t, int num_m_blocks, int num_bh, int group) {
    const int n = (num_bh - 1) / group + 1;  // ceil(num_bh / group), not overflowing for any group
    const int q = num_bh / n, rem = num_bh % n;
    const int big_heads = q * rem + rem;      // the heads of the groups of q + 1
    const int big = big_heads * num_m_blocks;  // and their tiles
    const int size = t < big ? q + 1 : q;
    const int u = t < big ? t : t - big;
    const int g = u / (size * num_m_blocks), r = u - g * size * num_m_blocks;
    const int start = t < big ? g * size : big_heads + g * size;
    return {r / size, start + r % size};
}

// tile_coord's order carried by the launch grid (lower.grouped_grid): gridDim = (size *
// num_m_blocks, n groups), blockIdx.y the group, blockIdx.x = m_rev * size + the head in it, size
// the larger groups' head count.  A smaller group's CTAs of head size - 1 are holes: bh = -1.
// Two dependent divisions by run-time values where head_group and tile_coord chain five, on the
// path to the CTA's first TMA load (with bh / heads_q and h / q_per_kv after them: 1.7K cycles
// before, 1.3K now; docs/perf-notes.md, session 9).  (x, g) = (blockIdx.x, blockIdx.y), n = gridDim.y.
__device__ __forceinline__ TileCoord grid_tile_coord(int num_bh, int n, int x, int g) {
    const int q = num_bh / n, rem = num_bh - q * n;  // rem groups of q + 1 heads first, then q
    const int size = rem ? q + 1 : q;
    const int m_rev = x / size, head = x - m_rev * size;
    if (head >= (g < rem ? q + 1 : q)) return {m_rev, -1};
    return {m_rev, g * q + min(g, rem) + head};
}

// The most heads a group may hold: the K/V heads whose seqlen rows of kv_row_bytes fit l2_bytes,
// times the q_per_kv query heads sharing each; at least 1, at most num_bh.
__device__ __forceinline__ int head_group(long long l2_bytes, int seqlen_k, int kv_row_bytes, int q_per_kv, int num_bh) {
    const long long kv_head_bytes = (long long)max(seqlen_k, 1) * kv_row_bytes;
    const long long heads = max(l2_bytes / kv_head_bytes, 1LL) * q_per_kv;
    return (int)min(heads, (long long)max(num_bh, 1));
}

}  // namespace fg
