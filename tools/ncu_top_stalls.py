"""Top SASS lines by warp-stall samples from an ncu report (``ncu -i REP --page source
--print-source sass --csv`` on stdin): ``python tools/ncu_top_stalls.py N < source.csv``."""

from __future__ import annotations

import csv
import sys


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rows = list(csv.reader(sys.stdin))
    head_i = next(i for i, r in enumerate(rows) if "Source" in r)
    head, body = rows[head_i], rows[head_i + 1 :]
    src = head.index("Source")
    cols = [i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All")]
    col = cols[0]
    total = sum(float(r[col] or 0) for r in body if len(r) > col)
    top = sorted(body, key=lambda r: -float(r[col] or 0) if len(r) > col else 0)[:n]
    for r in top:
        addr = r[head.index("Address")] if "Address" in head else ""
        print(f"{float(r[col]) / total:6.1%}  {addr}  {r[src][:110]}")


if __name__ == "__main__":
    main()
