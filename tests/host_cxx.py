"""Pieces of the host C++ programs that run lowered DSL expressions on the CPU
(tests/unit/test_expr_host.py, test_score_mod_host.py): the kernels' own fg:: integer
helpers with ``__device__`` defined away, and the scalar params as C parameters."""

from __future__ import annotations

from pathlib import Path

HEADER = Path(__file__).resolve().parents[1] / "templates" / "common" / "mma_sm80.cuh"


def preamble() -> str:
    """Includes, host definitions of the CUDA qualifiers, and fg::clamp_index, idiv, imod,
    Divisor verbatim from the kernels' header, plus fg::tanh_approx as tanhf, fg::base_ptr
    and __ldg as plain pointer reads, and the CUDA round-to-nearest intrinsics __fadd_rn,
    __fsub_rn, __fmul_rn as plain operators."""
    text = HEADER.read_text()
    start = text.index("__device__ __forceinline__ int clamp_index")
    end = text.index("};", text.index("struct Divisor")) + 2
    return (
        "#include <algorithm>\n#include <cmath>\n#include <cstdint>\n#include <cstdio>\n"
        "#include <cstdlib>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
        "using std::max;\nusing std::min;\n"
        f"namespace fg {{\n{text[start:end]}\n"
        "inline float tanh_approx(float x) { return tanhf(x); }\n"
        "template <class T> inline const T* base_ptr(const T* p) { return p; }\n"
        "}  // namespace fg\n"
        "template <class T> inline T __ldg(const T* p) { return *p; }\n"
        "inline float __fadd_rn(float a, float b) { return a + b; }\n"
        "inline float __fsub_rn(float a, float b) { return a - b; }\n"
        "inline float __fmul_rn(float a, float b) { return a * b; }\n"
    )


def scalar_params(spec, values: dict) -> tuple[str, str]:
    """(``", int p_w, float p_c"`` parameter declarations, ``", 5, 1.5f"`` arguments) of
    ``spec``'s scalar params with ``values``."""
    decl = "".join(
        f", {'int' if p.ty.name == 'I32' else 'float'} p_{p.name}" for p in spec.scalar_params
    )
    args = "".join(
        f", {int(values[p.name]) if p.ty.name == 'I32' else repr(float(values[p.name])) + 'f'}"
        for p in spec.scalar_params
    )
    return decl, args
