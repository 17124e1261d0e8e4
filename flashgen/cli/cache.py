"""``flashgen cache``: where the kernel cache is, how big, and pruning it."""

from __future__ import annotations

import math
import sys

from flashgen.frontend.errors import terminal_safe


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def cmd_cache(args) -> int:
    """Print the cache root and its size per flashgen version and arch; with ``--prune``,
    delete other versions' trees, broken entries and (``--older-than DAYS``) entries not
    used for that long (0: every kernel).  Exit 1 when the cache is not the user's own
    (nothing deleted); 2 for ``--older-than`` without ``--prune`` or not a number >= 0."""
    from flashgen.build import cache

    days = args.older_than
    if days is not None and not args.prune:
        print(f"error: --older-than needs --prune (flashgen cache --prune --older-than "
              f"{days:g})", file=sys.stderr)  # fmt: skip
        return 2
    if days is not None and not (math.isfinite(days) and days >= 0):
        print(f"error: --older-than: expected a finite number of days >= 0 (0: every kernel "
              f"of this version), got {days:g}", file=sys.stderr)  # fmt: skip
        return 2
    root = cache.cache_root()
    try:
        if args.prune:
            removed = cache.prune(root, args.older_than)
            print(f"pruned {removed['entries']} entries, {_size(removed['bytes'])}")
        rows = cache.usage(root)
    except (cache.UnsafeCacheError, OSError) as e:
        print(f"error: {terminal_safe(str(e))}", file=sys.stderr)
        return 1
    print(f"kernel cache {terminal_safe(str(root))}")
    if not rows:
        print("  (empty)")
    for r in rows:
        mark = "" if r["current"] else "   (another flashgen version: --prune removes it)"
        print(
            f"  {terminal_safe(r['version'])}/{terminal_safe(r['arch'])}: "
            f"{r['entries']} entries, {_size(r['bytes'])}{mark}"
        )
    total = sum(r["bytes"] for r in rows)
    print(f"  total {_size(total)}")
    return 0
