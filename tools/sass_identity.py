#!/usr/bin/env python3
"""Do two revisions of flashgen emit the same machine code?  Render every compile unit of every
shipped spec on both targets at two git revisions (or two source trees), compile each unit whose
CUDA differs with the project's nvcc command, disassemble both cubins with ``cuobjdump -sass`` and
compare them instruction for instruction.

    python3 tools/sass_identity.py 48d3e54 HEAD                    # every unit of every spec
    python3 tools/sass_identity.py 48d3e54 . --spec causal_d128 --unit 'sm_90/.*bwd_wgmma' -j 2
    python3 tools/sass_identity.py main templates-merge --list-changed   # the units that differ

A side is a git revision of this repository (exported with ``git archive``; ``.`` is the working
tree as it is, uncommitted changes included) or the path of a flashgen source tree.  The units are
those of the tree's ``tests/unit/test_unit_hashes.py`` (``unit_sources()``, or ``units()`` with its
hash taken out at revisions that predate it): 4677 planned forms, ~680 distinct sources.  A unit
whose rendered CUDA is byte-identical on both sides is ``identical (source)`` without a compile;
the others are compiled (each distinct source once, ``--jobs`` at a time, cached by the sha256 of
source, target and flags under ``--cache``) and are ``identical (SASS)`` when every function holds
the same instructions in the same order, control words included (``--ignore-control``: the
instruction text only).  Otherwise the first differing instructions are printed.

``nvcc -cubin -std=c++17 -O3 <gencode> -Xptxas -v -lineinfo`` (``flashgen.build.compile``) and
``cuobjdump -sass``: ``cuobjdump`` on ``PATH``, else the one ``pip install
nvidia-cuda-cuobjdump==13.2.86`` puts in ``site-packages/nvidia/cu13/bin``, or ``--cuobjdump``.
Addresses, encodings' comments and blank lines are dropped (:func:`normalise`).  ptxas' report of
side B's units is read too: ``--ptxas`` lists each compiled unit's registers, spills and serialized
wgmma, and spills or serialization on side B fail the run like a difference; ``--b-only`` compiles
only side B of the units whose source differs and reports just that (a change meant to alter the
code: is it spill-free?).

Exit status: 0 all identical (``--b-only``: side B compiled clean); 1 a unit differs (or exists
on one side only, or spills on side B with ``--ptxas``); 2 a side failed to render or compile.
Not run in CI (CI has no cuobjdump); ``tests/unit/test_sass_identity.py`` tests the
normalisation and comparison on small dumps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: nvcc code generation per target (flashgen's ``lower.GENCODE``).
GENCODE = {
    "sm_80": "-gencode=arch=compute_80,code=sm_80",
    "sm_90": "-gencode=arch=compute_90a,code=sm_90a",
}

# ------------------------------------------------------------------------------ normalisation
_ADDR = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s*")
_ENC = re.compile(r"/\*\s*(0x[0-9a-fA-F]{16})\s*\*/")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One SASS instruction: its text (``@!P0 BRA 0x2a0 ;``, whitespace collapsed) and the
    64-bit words cuobjdump prints beside it (the encoding and, on sm_70+, the control word)."""

    text: str
    words: tuple[str, ...] = ()


def normalise(dump: str) -> dict[str, list[Instr]]:
    """``{function name: instructions in order}`` from ``cuobjdump -sass`` text.

    Kept: each instruction's text with runs of blanks collapsed (addresses ``/*0a10*/`` and the
    trailing ``/* 0x... */`` encodings dropped from it) and its encoding words, which a line of
    their own after the instruction continues.  Dropped: headers (``code for``, ``.target``,
    ``.headerflags``), blank lines.  Lines before the first ``Function :`` are ignored.
    """
    funcs: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    for line in dump.splitlines():
        if m := _FUNC.match(line):
            cur = funcs.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        words = tuple(w.lower() for w in _ENC.findall(line))
        text = _ENC.sub("", line)
        had_addr = _ADDR.match(text) is not None
        text = " ".join(_ADDR.sub("", text).split())
        if not text:
            if words and cur:  # the control word, on its own line below the instruction
                last = cur[-1]
                cur[-1] = Instr(last.text, last.words + words)
            continue
        if text.startswith(".") and not had_addr:  # .headerflags and the like
            continue
        cur.append(Instr(text, words))
    return funcs


@dataclasses.dataclass(frozen=True)
class Diff:
    """Where two normalised dumps first differ: in ``function`` at instruction ``index``
    (``-1``: the function sets differ), with ``context`` lines of each side from there."""

    function: str
    index: int
    a: tuple[str, ...]
    b: tuple[str, ...]
    reason: str

    def format(self) -> str:
        """Human-readable, several lines: the reason, then side A's and side B's lines."""
        head = f"{self.reason}" + (f" (function {self.function})" if self.function else "")
        lines = [head]
        if self.index >= 0:
            lines.append(f"  from instruction {self.index}:")
        lines += [f"  A: {x}" for x in self.a] or ["  A: (nothing)"]
        lines += [f"  B: {x}" for x in self.b] or ["  B: (nothing)"]
        return "\n".join(lines)


def _show(i: Instr, control: bool) -> str:
    return f"{i.text}  {' '.join(i.words)}" if control and i.words else i.text


def compare(
    a: dict[str, list[Instr]],
    b: dict[str, list[Instr]],
    control: bool = True,
    context: int = 4,
) -> Diff | None:
    """``None`` if ``a`` and ``b`` (:func:`normalise`'s output) hold the same functions with the
    same instructions in the same order (and, with ``control``, the same encoding and control
    words); else the first :class:`Diff`, functions in name order."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        return Diff("", -1, tuple(only_a), tuple(only_b), "the functions differ")
    for name in sorted(a):
        fa, fb = a[name], b[name]
        for i in range(max(len(fa), len(fb))):
            x = fa[i] if i < len(fa) else None
            y = fb[i] if i < len(fb) else None
            same = x is not None and y is not None and x.text == y.text
            if same and control:
                same = x.words == y.words
            if not same:
                what = "control bits differ" if x and y and x.text == y.text else "instructions"
                return Diff(
                    name,
                    i,
                    tuple(_show(t, control) for t in fa[i : i + context]),
                    tuple(_show(t, control) for t in fb[i : i + context]),
                    f"{what} differ" if what == "instructions" else what,
                )
    return None


# ------------------------------------------------------------------------------ rendering
_RENDER = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("uh", sys.argv[1] + "/tests/unit/test_unit_hashes.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "unit_sources"):
    out = mod.unit_sources()
else:  # revisions before unit_sources(): units() with its hash taken out
    mod._sha = lambda text: text
    out = mod.units()
json.dump(out, open(sys.argv[2], "w"))
"""


def materialise(side: str, tmp: Path, repo: Path = REPO) -> Path:
    """The source tree of ``side``: a directory as given, ``.`` the working tree, else a git
    revision of ``repo`` exported into ``tmp``.  ``ValueError`` if it is neither."""
    if side == ".":
        return repo
    p = Path(side)
    if p.is_dir() and (p / "flashgen").is_dir():
        return p.resolve()
    rev = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{side}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if rev.returncode != 0:
        raise ValueError(f"{side!r} is neither a flashgen source tree nor a git revision")
    dest = tmp / rev.stdout.strip()[:12]
    if not dest.exists():
        dest.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", rev.stdout.strip()], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def render_units(tree: Path, tmp: Path) -> dict[str, str]:
    """``{unit key: rendered CUDA}`` of every unit ``tree`` enumerates (its own Python, in a
    subprocess).  ``RuntimeError`` with the subprocess's output when rendering fails."""
    out = tmp / f"units-{hashlib.sha256(str(tree).encode()).hexdigest()[:12]}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHGEN_")}
    run = subprocess.run(
        [sys.executable, "-c", _RENDER, str(tree), str(out)],
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
    )
    if run.returncode != 0:
        raise RuntimeError(f"rendering the units of {tree} failed:\n{run.stdout}{run.stderr}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------ compiling
def find_cuobjdump(given: str | None = None) -> str:
    """``given``, else ``cuobjdump`` on PATH, else the nvidia-cuda-cuobjdump wheel's binary.
    ``FileNotFoundError`` naming the pip command otherwise."""
    cands = [given] if given else []
    cands.append(shutil.which("cuobjdump"))
    purelib = Path(sysconfig.get_paths()["purelib"])
    cands += [str(purelib / "nvidia" / v / "bin" / "cuobjdump") for v in ("cu13", "cu12")]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "cuobjdump not found: pip install nvidia-cuda-cuobjdump==13.2.86 "
        "nvidia-cuda-nvdisasm==13.2.86, or pass --cuobjdump"
    )


@dataclasses.dataclass(frozen=True)
class Built:
    """One compiled source: its ``cuobjdump -sass`` text and ptxas' log."""

    sass: str
    log: str


def nvcc_argv(nvcc: str, target: str, src: Path, out: Path) -> list[str]:
    """flashgen's nvcc command (``flashgen.build.compile``'s flags) for ``target``."""
    from flashgen.build.compile import NVCC_FLAGS

    # NVCC_FLAGS no longer carries the output kind (flashgen picks -cubin or -fatbin per gencode):
    # always -cubin here, the gencode before ``-Xptxas``, as the cached commands were built.
    flags = [f for f in NVCC_FLAGS if f not in ("-cubin", "-fatbin")]
    i = flags.index("-Xptxas") if "-Xptxas" in flags else len(flags)
    return [nvcc, "-cubin", *flags[:i], GENCODE[target], *flags[i:], "-o", str(out), str(src)]


def build(source: str, target: str, cache: Path, nvcc: str, cuobjdump: str) -> Built:
    """Compile ``source`` for ``target`` and disassemble it (cached in ``cache`` by the sha256
    of flags and source).  ``RuntimeError`` with nvcc's output when it fails."""
    key = hashlib.sha256(
        "\0".join([*nvcc_argv("nvcc", target, Path("k.cu"), Path("k.cubin")), source]).encode()
    ).hexdigest()
    sass_f, log_f = cache / f"{key}.sass", cache / f"{key}.log"
    if sass_f.exists() and log_f.exists():
        return Built(sass_f.read_text(), log_f.read_text())
    with tempfile.TemporaryDirectory(prefix="sass-identity-") as d:
        src, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        src.write_text(source)
        run = subprocess.run(
            nvcc_argv(nvcc, target, src, cubin), capture_output=True, text=True, cwd=d
        )
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed ({target}):\n{run.stdout}{run.stderr}"[-4000:])
        dump = subprocess.run(
            [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    cache.mkdir(parents=True, exist_ok=True)
    sass_f.write_text(dump)
    log_f.write_text(run.stdout + run.stderr)
    return Built(dump, run.stdout + run.stderr)


def ptxas_summary(log: str) -> tuple[str, bool]:
    """One line of ptxas' report (registers, spill bytes, serialized wgmma per kernel) and
    whether it shows a spill or a serialization."""
    from flashgen.build.compile import parse_ptxas

    parts, bad = [], False
    for k in parse_ptxas(log):
        bits = f"{k.name}: {k.registers} regs"
        if k.spill_bytes:
            bits += f", SPILLS {k.spill_stores}+{k.spill_loads} B"
            bad = True
        if k.wgmma_serialized:
            bits += f", WGMMA SERIALIZED ({k.wgmma_serialized})"
            bad = True
        parts.append(bits)
    return "; ".join(parts), bad


# ------------------------------------------------------------------------------ main
def select_units(units: dict[str, str], specs: list[str], unit_re: str | None) -> dict[str, str]:
    """The units of ``specs`` (all when empty) whose key matches ``unit_re`` (``re.search``)."""
    pat = re.compile(unit_re) if unit_re else None
    return {
        k: v
        for k, v in units.items()
        if (not specs or k.split("/", 1)[0] in specs) and (pat is None or pat.search(k))
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("a", help="side A: a git revision, '.', or a flashgen source tree")
    ap.add_argument("b", help="side B: likewise")
    ap.add_argument("--spec", action="append", default=[], help="only this spec (repeatable)")
    ap.add_argument("--unit", help="only unit keys matching this regex (re.search)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="nvcc runs at a time")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flashgen-sass")
    ap.add_argument("--cuobjdump", help="path of cuobjdump")
    ap.add_argument("--ignore-control", action="store_true", help="compare instruction text only")
    ap.add_argument("--ptxas", action="store_true", help="print side B's ptxas report per unit")
    ap.add_argument("--list-changed", action="store_true", help="print only the differing keys")
    ap.add_argument(
        "--b-only",
        action="store_true",
        help="compile only side B of the units whose source differs and print ptxas' report "
        "(spills, serialized wgmma; no SASS comparison)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="a line for every unit")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from flashgen.build.compile import find_nvcc

    nvcc, cuobjdump = find_nvcc(), find_cuobjdump(args.cuobjdump)
    with tempfile.TemporaryDirectory(prefix="sass-identity-trees-") as tmp:
        try:
            sides = [
                select_units(
                    render_units(materialise(s, Path(tmp)), Path(tmp)), args.spec, args.unit
                )
                for s in (args.a, args.b)
            ]
        except (ValueError, RuntimeError, subprocess.CalledProcessError) as e:
            print(f"sass_identity: {e}", file=sys.stderr)
            return 2
    ua, ub = sides
    if not ua and not ub:
        print("sass_identity: no unit matches", file=sys.stderr)
        return 2
    keys = sorted(ua.keys() | ub.keys())
    todo = {
        (k.split("/")[1], s)
        for k in keys
        if k in ua and k in ub and ua[k] != ub[k]
        for s in ((ub[k],) if args.b_only else (ua[k], ub[k]))
    }
    if args.list_changed:
        todo = set()
    print(
        f"{len(keys)} units ({len(set(ua.values()))} / {len(set(ub.values()))} distinct sources); "
        f"{len(todo)} sources to compile",
        file=sys.stderr,
        flush=True,
    )
    built: dict[tuple[str, str], Built | Exception] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futs = {pool.submit(build, s, t, args.cache, nvcc, cuobjdump): (t, s) for t, s in todo}
        for n, f in enumerate(concurrent.futures.as_completed(futs), 1):
            try:
                built[futs[f]] = f.result()
            except Exception as e:  # reported per unit below
                built[futs[f]] = e
            if n % 20 == 0:
                print(f"  compiled {n}/{len(todo)}", file=sys.stderr, flush=True)

    counts = {"identical (source)": 0, "identical (SASS)": 0, "different": 0, "error": 0}
    if args.ptxas or args.b_only:
        counts["spilled or serialized on B"] = 0
    if args.b_only:
        counts["source differs, B clean"] = 0
    normal: dict[tuple[str, str], dict] = {}

    def norm(t: str, s: str) -> dict:
        if (t, s) not in normal:
            normal[(t, s)] = normalise(built[(t, s)].sass)
        return normal[(t, s)]

    for k in keys:
        if k not in ua or k not in ub:
            counts["different"] += 1
            print(f"{k}: only in {'A' if k in ua else 'B'}")
            continue
        if ua[k] == ub[k]:
            counts["identical (source)"] += 1
            if args.verbose:
                print(f"{k}: identical (source)")
            continue
        if args.list_changed:
            counts["different"] += 1
            print(k)
            continue
        t = k.split("/")[1]
        if args.b_only:
            bb = built[(t, ub[k])]
            if isinstance(bb, Exception):
                counts["error"] += 1
                print(f"{k}: ERROR {bb}")
                continue
            summary, bad = ptxas_summary(bb.log)
            counts["spilled or serialized on B" if bad else "source differs, B clean"] += 1
            print(f"{k}: source differs; B ptxas: {summary}")
            continue
        ba, bb = built[(t, ua[k])], built[(t, ub[k])]
        if isinstance(ba, Exception) or isinstance(bb, Exception):
            counts["error"] += 1
            print(f"{k}: ERROR {ba if isinstance(ba, Exception) else bb}")
            continue
        diff = compare(norm(t, ua[k]), norm(t, ub[k]), control=not args.ignore_control)
        line = f"{k}: identical (SASS)" if diff is None else f"{k}: DIFFERENT {diff.format()}"
        counts["identical (SASS)" if diff is None else "different"] += 1
        if args.ptxas:
            summary, bad = ptxas_summary(bb.log)
            line += f"\n  B ptxas: {summary}"
            if bad:
                counts["spilled or serialized on B"] += 1
        if diff is not None or args.verbose or args.ptxas:
            print(line)
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    if counts["error"]:
        return 2
    return 1 if counts["different"] or counts.get("spilled or serialized on B") else 0


if __name__ == "__main__":
    sys.exit(main())
