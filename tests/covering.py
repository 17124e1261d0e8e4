"""Pairwise (strength-2) coverings for the nvcc sweeps: instead of the full product of a
sweep's parameters, rows in which every pair of values of any two parameters occurs at least
once.  An nvcc run costs 1 to 3 CPU-seconds per unit: a product of spec x target x unit kind
builds every spec's every unit on every target, a covering builds every spec on every target
and as every kind, and every (target, kind) for some specs.

The rows are deterministic (the same in every process and pytest-xdist worker), so sweeps of
two test files that ask for the same covering build the same units and share them through
the session's kernel cache.  allpairspy's generator was the first choice; its coverings are
as small but lopsided (of 13 specs x 2 targets x 2 units, 12 build the deterministic unit for
sm_90 and 1 for sm_80), so this greedy one breaks ties towards the pairs used least.

``pytest --full-product`` makes every covering the full product (all the units, as before a
change that moves registers is measured: docs/kernels.md; tests/conftest.py sets
:data:`FULL_PRODUCT`)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

#: Every covering is its factors' full product (``pytest --full-product``).
FULL_PRODUCT = False


def _pairs(row) -> set:
    return {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)}


def pairwise(*factors: Sequence) -> list[tuple]:
    """Rows over ``factors`` (each a sequence of distinct hashable values) covering every pair
    of values of any two factors: greedily the row of the product that covers the most pairs
    not yet covered, of those the one whose pairs earlier rows hold least, then the first in
    product order.  With fewer than three factors, or with ``pytest --full-product``,
    their product."""
    product = list(itertools.product(*factors))
    if len(factors) < 3 or FULL_PRODUCT:
        return product
    todo = set().union(*map(_pairs, product))
    used: Counter = Counter()  # rows holding each pair so far
    rows = []
    while todo:
        row = max(
            product, key=lambda r: (len(_pairs(r) & todo), -sum(used[p] for p in _pairs(r)))
        )
        rows.append(row)
        todo -= _pairs(row)
        used.update(_pairs(row))
    return rows


def uncovered_pairs(rows, *factors: Sequence) -> list[tuple]:
    """The ((i, a), (j, b)) pairs of values of factors i < j that no row of ``rows`` holds
    (empty for a pairwise covering)."""
    seen = set().union(*map(_pairs, rows)) if rows else set()
    return [
        ((i, a), (j, b))
        for i, j in itertools.combinations(range(len(factors)), 2)
        for a in factors[i]
        for b in factors[j]
        if ((i, a), (j, b)) not in seen
    ]
