"""Count the instructions of the Hopper backward's consumer step loop in `cuobjdump -sass` text:
the smallest backward branch's body that holds at least 16 HGMMA and no TMA load.

    python consumer_loop.py dkdv.sass [--ops]
"""

import re
import sys
from collections import Counter


def consumer_loop(text: str) -> Counter:
    ins = []
    for ln in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for a, t in ins:
        m = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) >= a:
            continue
        body = [t for x, t in ins if int(m.group(1), 16) <= x <= a]
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        smaller = best is None or ops.total() < best.total()
        if ops["HGMMA"] >= 16 and not ops["UTMALDG"] and smaller:
            best = ops
    return best


if __name__ == "__main__":
    c = consumer_loop(open(sys.argv[1]).read())
    print("instructions", c.total(), "R2UR", c["R2UR"], "HGMMA", c["HGMMA"])
    if "--ops" in sys.argv:
        print("  ".join(f"{k}:{v}" for k, v in c.most_common()))
