#!/usr/bin/env python3
"""How far ahead of its mma each ldmatrix is issued: the HMMA-distance metric of docs/perf-notes.md.

For every HMMA in a kernel's SASS (``cuobjdump -sass``), the distance is the number of
instructions since the most recent LDSM that wrote one of its A / B operand registers
(register writes tracked in program order; an operand last written by anything else, e.g.
P packed by F2FP, has no LDSM producer, and an HMMA with none is counted apart).  ptxas
at 255 registers reuses one fragment (``LDSM R192; HMMA R192; HMMA R192; LDSM R192``):
each mma then waits a full ldmatrix latency.  Reported per kernel: registers, spills,
HMMA / LDSM / BAR.SYNC counts, the HMMAs at distance <= 2 and the median distance.

Variants are FA2-class d``--dim`` forward builds (no GPU; nvcc through flashgen's cache),
named like ``tools/perf_sweep.py``'s: tiles ``MxNxW`` plus switch suffixes, ``+even``
(``fwd_even_loads`` on), ``+lazy`` (``fwd_lazy_rescale``), ``-unroll`` (off), ... or the
full key (``+fwd_lazy_rescale``):

    python3 tools/sass_mma_distance.py 64x64x4+even 64x48x4+even 128x64x8+lazy
    python3 tools/sass_mma_distance.py --targets sm_80 sm_90 --dtypes bf16 fp16 128x32x4+even
    python3 tools/sass_mma_distance.py --cubin path/to/kernel.cubin     # any cubin

Needs nvcc and cuobjdump (``$CUOBJDUMP``, PATH, /usr/local/cuda/bin, or the pip wheel
``nvidia-cuda-cuobjdump`` unpacked under /tmp/cudatools).  Exit status 1 if a build
fails or spills.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from perf_sweep import SWITCH_LABELS  # noqa: E402  (no torch at import)

#: Short switch labels (tools/perf_sweep.py's variant names) -> lower.FORWARD_OPTIONS keys.
LABELS = {label: key for key, label in SWITCH_LABELS.items()}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")
#: Opcodes whose first operand is not a register they write.
_NO_DEST = ("ST", "RED", "BAR", "BRA", "EXIT", "RET", "CALL", "BSYNC", "BSSY", "WARPSYNC",
            "LDGSTS", "LDGDEPBAR", "DEPBAR", "MEMBAR", "FENCE", "NOP", "YIELD", "ERRBAR",
            "CCTL", "ARRIVES", "SYNCS", "UTMA", "BPT", "JMP", "BRX", "RPCMOV")  # fmt: skip


@dataclass(frozen=True)
class Metric:
    """One kernel's counts inside its main loop (the innermost backward branch around every
    HMMA; the whole kernel if there is none): instructions, HMMA, LDSM, BAR.SYNC, and
    ``distances`` per HMMA with an LDSM producer (program order)."""

    instructions: int
    hmma: int
    ldsm: int
    bars: int
    no_ldsm: int  # HMMAs none of whose A / B operands came from an LDSM
    distances: tuple[int, ...]

    @property
    def near(self) -> int:
        """HMMAs issued at most 2 instructions after their LDSM."""
        return sum(1 for d in self.distances if d <= 2)

    @property
    def median(self) -> float:
        return statistics.median(self.distances) if self.distances else float("nan")


def _width(opcode: str) -> int:
    """Registers an instruction's destination spans (from its opcode's suffixes)."""
    if opcode.startswith("LDSM"):
        last = opcode.rsplit(".", 1)[-1]
        return int(last) if last in ("2", "4") else 1
    if opcode.startswith("HMMA"):
        return 4 if ".F32" in opcode else 2
    if ".128" in opcode:
        return 4
    if ".64" in opcode or ".WIDE" in opcode:
        return 2
    return 1


def _hmma_sources(opcode: str, operands: list[str]) -> list[int]:
    """A and B registers of ``HMMA.16816`` (A 4, B 2) or ``HMMA.1688`` (A 2, B 1)."""
    big = ".16816" in opcode
    regs = []
    for op, n in ((operands[1], 4 if big else 2), (operands[2], 2 if big else 1)):
        m = _REG.search(op)
        if m:
            regs += range(int(m.group(1)), int(m.group(1)) + n)
    return regs


def _main_loop(instrs: list[tuple[int, str, list[str]]]) -> tuple[int, int]:
    """Address range [start, end] of the innermost backward branch enclosing every HMMA."""
    mma = [a for a, op, _ in instrs if op.startswith("HMMA")]
    best = (instrs[0][0], instrs[-1][0]) if instrs else (0, 0)
    if not mma:
        return best
    for addr, op, operands in instrs:
        if op.startswith("BRA") and operands:
            t = re.fullmatch(r"(?:`\()?0x([0-9a-f]+)\)?", operands[-1].split()[-1])
            if t and int(t.group(1), 16) <= min(mma) and addr >= max(mma):
                if addr - int(t.group(1), 16) < best[1] - best[0]:
                    best = (int(t.group(1), 16), addr)
    return best


def mma_distances(sass: str) -> Metric:
    """The metric over the instruction lines of ``sass`` (one kernel's ``cuobjdump -sass``)."""
    instrs = []
    for line in sass.splitlines():
        m = _LINE.search(line)
        if m:
            rest = m.group(3)
            ops = [o.strip() for o in rest.split(",")] if rest.strip() else []
            instrs.append((int(m.group(1), 16), m.group(2), ops))
    lo, hi = _main_loop(instrs)
    writer: dict[int, tuple[str, int]] = {}  # register -> (opcode kind, instruction index)
    dists, no_ldsm, n, hmma, ldsm, bars = [], 0, 0, 0, 0, 0
    for idx, (addr, opcode, operands) in enumerate(instrs):
        inside = lo <= addr <= hi
        n += inside
        if opcode.startswith("HMMA") and len(operands) >= 3:
            hmma += inside
            prod = [writer.get(r) for r in _hmma_sources(opcode, operands)]
            ats = [i for kind, i in filter(None, prod) if kind == "LDSM"]
            if ats:
                dists.append(idx - max(ats))
            else:
                no_ldsm += 1
        ldsm += inside and opcode.startswith("LDSM")
        bars += inside and opcode.startswith(("BAR.SYNC", "BAR.RED"))
        if operands and not opcode.startswith(_NO_DEST):
            d = _REG.fullmatch(operands[0].split(".")[0])
            if d:
                kind = "LDSM" if opcode.startswith("LDSM") else "other"
                for r in range(int(d.group(1)), int(d.group(1)) + _width(opcode)):
                    writer[r] = (kind, idx)
    return Metric(n, hmma, ldsm, bars, no_ldsm, tuple(dists))


def cuobjdump() -> str:
    """Path of cuobjdump; ``FileNotFoundError`` if none is found."""
    cands = [
        os.environ.get("CUOBJDUMP"),
        shutil.which("cuobjdump"),
        "/usr/local/cuda/bin/cuobjdump",
        "/tmp/cudatools/nvidia/cu13/bin/cuobjdump",
    ]
    for c in cands:
        if c and Path(c).is_file():
            return c
    raise FileNotFoundError("cuobjdump not found: set $CUOBJDUMP or put it on PATH")


def kernel_sass(cubin: str) -> dict[str, str]:
    """``cuobjdump -sass`` of ``cubin``, split per kernel (``Function : name``)."""
    out = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True)
    parts: dict[str, str] = {}
    name = None
    for line in out.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            parts[name] = ""
        elif name is not None:
            parts[name] += line + "\n"
    return parts


def parse_variant(text: str) -> tuple[tuple[int, int, int], dict[str, bool]]:
    """``"64x64x4+lazy-unroll"`` -> ((64, 64, 4), {"fwd_lazy_rescale": True,
    "fwd_unrolled_loads": False}); ``argparse.ArgumentTypeError`` if malformed."""
    m = re.fullmatch(r"t?(\d+)x(\d+)x(\d+)((?:[+-][a-z_0-9]+)*)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}; expected e.g. 64x64x4+even")
    opts = {}
    for sign, name in re.findall(r"([+-])([a-z_0-9]+)", m.group(4)):
        opts[LABELS.get(name, name)] = sign == "+"
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))), opts


def build(variant: str, dim: int, causal: bool, dtype: str, target: str):
    """(cubin path, registers, spill bytes) of one FA2-class forward build."""
    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.codegen.plan import TileConfig
    from flashgen.families import fa2_fwd
    from flashgen.families.registry import plan_forward
    from flashgen.frontend.spec import loads_spec
    from flashgen.options import Options

    tiles, opts = parse_variant(variant)
    mask = "causal" if causal else "null"
    spec = loads_spec(f"name: mma_d{dim}\nhead_dim: {dim}\ndtype: {dtype}\nmask: {mask}\n")
    o = Options(family="fa2", fa2_fwd=fa2_fwd.Options(**opts))
    plan = plan_forward(spec, target, o, tiles=TileConfig(*tiles), persistent=False)
    cubin, rep = cache.get_or_build(render(plan), plan)
    return str(cubin), max(k.registers for k in rep.kernels), rep.spill_bytes


def row(label: str, regs, spills, m: Metric) -> str:
    regs_s = f"{regs:4d}" if regs is not None else "   -"
    sp = f"{spills:4d}" if spills is not None else "   -"
    return (f"{label:44} {regs_s} {sp} {m.instructions:5d} {m.hmma:5d} {m.ldsm:5d} {m.bars:4d} "
            f"{m.near:4d}/{len(m.distances):<4d} {m.median:6.1f}")  # fmt: skip


HEADER = f"{'variant':44} regs  spl  loop  HMMA  LDSM  BAR  <=2/of    median"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="MxNxW[+switch...], e.g. 64x64x4+even")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--targets", nargs="+", default=["sm_90"], choices=("sm_80", "sm_90"))
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=("bf16", "fp16"))
    ap.add_argument("--causal", nargs="+", default=["full", "causal"], choices=("full", "causal"))
    ap.add_argument("--cubin", nargs="+", default=[], help="report these cubins' kernels as well")
    args = ap.parse_args(argv)
    for v in args.variants:
        parse_variant(v)  # argparse-style error before any build
    print(HEADER)
    bad = 0
    for path in args.cubin:
        for name, text in kernel_sass(path).items():
            print(row(name[-44:], None, None, mma_distances(text)))
    for target in args.targets:
        for dtype in args.dtypes:
            for c in args.causal:
                for v in args.variants:
                    label = f"{v} {c} {dtype} {target}"
                    try:
                        cubin, regs, spills = build(v, args.dim, c == "causal", dtype, target)
                    except Exception as e:  # noqa: BLE001 - one failed build is one line
                        print(f"{label:44} BUILD FAILED: {str(e).splitlines()[0][:120]}")
                        bad += 1
                        continue
                    sass = kernel_sass(cubin)
                    main_k = max(sass.values(), key=lambda s: s.count("HMMA"))
                    print(row(label, regs, spills, mma_distances(main_k)), flush=True)
                    bad += bool(spills)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
