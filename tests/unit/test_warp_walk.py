"""fg::iv::WarpWalk (templates/common/masktiles.cuh), the Hopper forward's warp-wide walk of
live key blocks, transliterated lane by lane into Python: it must visit exactly the blocks a
single-block classification calls live, last to first, with their classes, for any sound
range classifier (a range is called EMPTY only when all its blocks are, FULL only when all
are).  The CUDA code itself runs in the GPU mask tests."""

from __future__ import annotations

import random

import pytest

EMPTY, PARTIAL, FULL = 0, 1, 2


class WarpWalk:
    """The struct's state per lane (hi is warp-uniform) and prev_live with the ballots and
    shuffles written out over the 32 lanes."""

    def __init__(self):
        self.hi = -1
        self.lane_cls = [EMPTY] * 32

    def prev_live(self, j, tile):
        while j >= 0:
            if j > self.hi or j < self.hi - 31:
                self.hi = j
                self.lane_cls = [tile(j - ln, j - ln) if j - ln >= 0 else EMPTY for ln in range(32)]
            live = [ln >= self.hi - j and self.lane_cls[ln] != EMPTY for ln in range(32)]
            if any(live):
                lane = live.index(True)  # __ffs: the lowest set lane
                return self.hi - lane, self.lane_cls[lane]
            j = self.hi - 32
            while j >= 0:
                tops = [j - 32 * ln for ln in range(32)]
                anyl = [t >= 0 and tile(max(t - 31, 0), t) != EMPTY for t in tops]
                if any(anyl):
                    j -= 32 * anyl.index(True)
                    break
                j -= 1024
        return -1, EMPTY


def _classifier(classes, widest):
    """tile(j0, j1): sound, and exact for ranges of up to ``widest`` blocks, PARTIAL for
    wider ones that are all EMPTY or all FULL: like interval arithmetic, a range is never
    classified more precisely than a range inside it."""

    def tile(j0, j1):
        cs = set(classes[j0 : j1 + 1])
        sure = j1 - j0 < widest
        if cs == {EMPTY}:
            return EMPTY if sure else PARTIAL
        if cs == {FULL}:
            return FULL if sure else PARTIAL
        return PARTIAL

    return tile


@pytest.mark.parametrize("seed", range(200))
def test_warp_walk_visits_the_live_blocks(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 31, 32, 33, 63, 64, 65, 200, 1023, 1024, 1025, 3000])
    kind = rng.choice(["random", "band", "sparse", "empty"])
    if kind == "random":
        classes = [rng.choice([EMPTY, PARTIAL, FULL]) for _ in range(n)]
    elif kind == "band":  # a causal / sliding-window row: EMPTY, PARTIAL, FULL run, PARTIAL, EMPTY
        lo, hi = sorted(rng.randrange(n + 1) for _ in range(2))
        classes = [EMPTY] * n
        for i in range(lo, hi):
            classes[i] = PARTIAL if i in (lo, hi - 1) else FULL
    elif kind == "sparse":
        classes = [PARTIAL if rng.random() < 0.01 else EMPTY for _ in range(n)]
    else:
        classes = [EMPTY] * n
    tile = _classifier(classes, rng.choice([1, 2, 31, 32, 33, 1000, 10**9]))
    want = [(i, classes[i]) for i in reversed(range(n)) if classes[i] != EMPTY]
    walk, got, j = WarpWalk(), [], n - 1
    while True:
        j, c = walk.prev_live(j, tile)
        if j < 0:
            break
        got.append((j, c))
        j -= 1
    assert got == want
