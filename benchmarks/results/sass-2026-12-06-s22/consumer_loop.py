import re, sys
from collections import Counter
for f in sys.argv[1:]:
    ins = []
    for ln in open(f):
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if m: ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            tgt = int(m.group(1), 16)
            body = [x for x in ins if tgt <= x[0] <= a]
            ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body]
            c = Counter(ops)
            if c["HGMMA"] >= 16 and c["UTMALDG"] == 0 and (best is None or len(body) < len(best[0])):
                best = (body, c)
    body, c = best
    print(f.split("/")[-1], "consumer loop", len(body), "R2UR", c["R2UR"], "uniform", sum(v for k, v in c.items() if k.startswith("U")), "HGMMA", c["HGMMA"])
    if len(sys.argv) == 2:
        for k, v in c.most_common(45): print(f"{k}:{v}", end="  ")
        print()
