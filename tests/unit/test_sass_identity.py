"""``tools/sass_identity.py``: the normalisation of ``cuobjdump -sass`` text and the comparison,
on small hand-written dumps (CI has no cuobjdump; the tool itself is run by hand)."""

from __future__ import annotations

from patched_kernels import load_tool

TOOL = load_tool("sass_identity")

DUMP = """
\tcode for sm_90a
\t\t.target\tsm_90a

\t\tFunction : k_a
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;          /* 0x00000a00ff017b82 */
                                                                   /* 0x000fe20000000800 */
        /*0010*/              @!P0 BRA 0x2a0 ;                     /* 0x0000000000488947 */
                                                                   /* 0x000fea0003800000 */
        /*0020*/                   EXIT ;                          /* 0x000000000000794d */
                                                                   /* 0x000fea0003800000 */
\t\t..........

\t\tFunction : k_b
        /*0000*/                   NOP;                            /* 0x0000000000007918 */
                                                                   /* 0x000fc00000000000 */
"""


def test_normalise_drops_addresses_headers_and_keeps_the_words():
    n = TOOL.normalise(DUMP)
    assert list(n) == ["k_a", "k_b"]
    assert [i.text for i in n["k_a"]] == ["LDC R1, c[0x0][0x28] ;", "@!P0 BRA 0x2a0 ;", "EXIT ;"]
    assert n["k_a"][0].words == ("0x00000a00ff017b82", "0x000fe20000000800")
    assert [i.text for i in n["k_b"]] == ["NOP;"]


def test_whitespace_and_addresses_do_not_count():
    shifted = DUMP.replace("/*0010*/", "/*0110*/").replace("LDC R1,", "LDC   R1,")
    assert TOOL.compare(TOOL.normalise(DUMP), TOOL.normalise(shifted)) is None


def test_first_differing_instruction_is_named():
    other = DUMP.replace("@!P0 BRA 0x2a0 ;", "@P0 BRA 0x2a0 ;")
    d = TOOL.compare(TOOL.normalise(DUMP), TOOL.normalise(other), context=2)
    assert (d.function, d.index, d.reason) == ("k_a", 1, "instructions differ")
    assert d.a[0].startswith("@!P0 BRA") and d.b[0].startswith("@P0 BRA")
    assert len(d.a) == 2 and "k_a" in d.format() and "instruction 1" in d.format()


def test_control_words_count_unless_ignored():
    other = DUMP.replace("0x000fe20000000800", "0x000fe40000000800")
    a, b = TOOL.normalise(DUMP), TOOL.normalise(other)
    d = TOOL.compare(a, b)
    assert d is not None and d.reason == "control bits differ" and d.index == 0
    assert TOOL.compare(a, b, control=False) is None


def test_longer_function_and_function_sets():
    a = TOOL.normalise(DUMP)
    longer = TOOL.normalise(DUMP.replace("\t\t..........", "        /*0030*/ BRA 0x30;\n"))
    d = TOOL.compare(a, longer)
    assert d.index == 3 and d.a == () and d.b == ("BRA 0x30;",)
    fewer = {"k_a": a["k_a"]}
    d = TOOL.compare(a, fewer)
    assert d.index == -1 and d.a == ("k_b",) and d.b == ()


def test_select_units_by_spec_and_key():
    units = {"s1/sm_90/auto/fwd": "x", "s1/sm_80/bwd/candidate0": "y", "s2/sm_90/auto/fwd": "z"}
    assert TOOL.select_units(units, ["s1"], None).keys() == {
        "s1/sm_90/auto/fwd",
        "s1/sm_80/bwd/candidate0",
    }
    assert TOOL.select_units(units, [], r"sm_90/.*fwd$").keys() == {
        "s1/sm_90/auto/fwd",
        "s2/sm_90/auto/fwd",
    }
