"""Print README.md's tables from raw/: per row, the median (min-max) of the runs of each
tree (base: before, wt: after) and harness (c: C stub driver, py: --py-driver)."""

import glob
import json
import statistics
from pathlib import Path

RAW = Path(__file__).parent / "raw"


def load(kind: str, tree: str) -> list:
    return [json.load(open(f)) for f in sorted(glob.glob(f"{RAW}/{kind}-{tree}-*.json"))]


def cell(vals: list) -> str:
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"


for kind, label in (("c", "C stub driver (default)"), ("py", "Python stand-in (--py-driver)")):
    b, a = load(kind, "base"), load(kind, "wt")
    print(f"\n{label}: {len(b)} runs each, median (min-max)")
    print("| case | B | splits | before us/call | after us/call | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(b[0]):
        vb, va = [x[i]["host_us"] for x in b], [x[i]["host_us"] for x in a]
        ratio = statistics.median(vb) / statistics.median(va)
        print(f"| {r['case']} | {r['batch']} | {r['num_splits']} | {cell(vb)} | {cell(va)} "
              f"| {ratio:.2f} |")
