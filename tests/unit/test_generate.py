"""generated/<name>/: files, manifest, and importing the generated module."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from flashgen import __version__
from flashgen.build.compile import CompileReport, KernelResources
from flashgen.build.generate import write_generated
from flashgen.frontend.spec import load_spec
from flashgen.frontend.spec import loads_spec as load_spec_text

REPO = Path(__file__).resolve().parents[2]


def import_generated(root: Path, package: str, name: str):
    """Import ``<root>/<name>`` as ``<package>.<name>`` (``from generated import name``)."""
    spec = importlib.util.spec_from_file_location(
        package, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[package] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(f"{package}.{name}")


def test_writes_sources_spec_manifest_and_module(tmp_path):
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    rep = CompileReport(
        "sm_80", "sm_80", (KernelResources("flashgen_alibi_fwd_sm_80", 200),), 1.0, "13.0.88"
    )
    out = write_generated(spec, tmp_path / "generated", reports={("sm_80", "fwd"): rep})
    assert out == tmp_path / "generated" / "alibi"
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "__init__.py",
        "alibi_sm_80.cu",
        "alibi_sm_80_bwd.cu",
        "alibi_sm_90.cu",
        "alibi_sm_90_bwd.cu",
        "manifest.json",
        "spec.yaml",
    ]
    assert (tmp_path / "generated" / "__init__.py").read_text().startswith('"""')
    assert (out / "spec.yaml").read_text() == spec.source
    assert 'extern "C" __global__' in (out / "alibi_sm_90.cu").read_text()
    man = json.loads((out / "manifest.json").read_text())
    assert man["flashgen_version"] == __version__
    assert man["spec_sha256"] == hashlib.sha256(spec.source.encode()).hexdigest()
    assert man["targets"]["sm_80"]["resources"]["registers"] == 200
    assert man["targets"]["sm_90"]["resources"] is None
    assert man["targets"]["sm_90"]["config"]["kernel"] == "flashgen_alibi_fwd_sm_90"
    bwd = man["targets"]["sm_90"]["backward"]
    assert bwd["source"] == "alibi_sm_90_bwd.cu" and bwd["config"]["deterministic"]
    assert "flashgen_alibi_bwd_sm_90_dkdv" in (out / "alibi_sm_90_bwd.cu").read_text()
    assert not list(out.glob(".*.tmp"))


def test_rewrite_is_deterministic_and_drops_stale_targets(tmp_path):
    spec = load_spec(REPO / "specs" / "gpt2_d64.yaml")
    out = write_generated(spec, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_generated(spec, tmp_path)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the same spec built for one target keeps the other's sources (test_cache_trust.py);
    # an edited spec that no longer lists sm_90 drops them
    edited = load_spec_text(spec.source.replace("targets: [sm_80, sm_90]", "targets: [sm_80]"))
    assert edited.targets == ("sm_80",)
    write_generated(edited, tmp_path)
    assert not (out / "gpt2_d64_sm_90.cu").exists() and (out / "gpt2_d64_sm_80.cu").exists()
    assert list(json.loads((out / "manifest.json").read_text())["targets"]) == ["sm_80"]


def test_generated_module_imports_and_runs_on_cpu(tmp_path):
    torch = pytest.importorskip("torch")
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    write_generated(spec, tmp_path / "generated")
    mod = import_generated(tmp_path / "generated", "fg_test_generated", "causal_d128")
    assert mod.spec.name == "causal_d128" and "causal_d128" in mod.__doc__
    q = torch.randn(1, 2, 5, 128).bfloat16()
    o, lse = mod.attention(q, q, q)
    assert o.shape == (1, 2, 5, 128) and lse.shape == (1, 2, 5)


def test_options_are_recorded_and_loaded_by_the_generated_module(tmp_path):
    """``flashgen build --option ...`` writes the sources of those options: the manifest
    records them and the module loads its op with them, so the sources beside it are what it
    compiles; a later write under other options keeps no target of the earlier one."""
    torch = pytest.importorskip("torch")
    from flashgen.options import Options

    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    opts = Options(family="fa2").with_values({"fa2_fwd.affine": False})
    out = write_generated(spec, tmp_path / "generated", options=opts)
    man = json.loads((out / "manifest.json").read_text())
    assert man["options"] == {"family": "fa2", "fa2_fwd.affine": False}
    mod = import_generated(tmp_path / "generated", "fg_test_generated_opts", "causal_d128")
    assert mod._op.options == opts and "Options: family='fa2'" in mod.__doc__
    q = torch.randn(1, 2, 5, 128).bfloat16()
    assert mod.attention(q, q, q)[0].shape == (1, 2, 5, 128)
    write_generated(spec, tmp_path / "generated", targets=("sm_80",))  # default options
    man = json.loads((out / "manifest.json").read_text())
    assert "options" not in man and list(man["targets"]) == ["sm_80"]
    assert "_Options" not in (out / "__init__.py").read_text()


def test_a_varlen_specs_module_documents_the_packed_call():
    """``attention`` of a ``varlen: true`` spec is the packed-sequence op; its module's
    docstring showed the padded ``attention(q, k, v)`` with [B, Hq, Sq, D] shapes."""
    from flashgen.build.generate import module_source
    from flashgen.frontend.spec import loads_spec

    spec = loads_spec(
        "name: vl\nhead_dim: 64\ndtype: fp16\nvarlen: true\nmask: causal\n"
        "params: {s: {type: f32, shape: [num_heads]}}\n"
    )
    doc = module_source(spec)
    assert "vl.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q," in doc
    assert "max_seqlen_k, s=s)" in doc
    assert "q [total_q, Hq, 64]" in doc and "lse [Hq, total_q]" in doc
    assert "[B, Hq, Sq" not in doc
    compile(doc, "vl/__init__.py", "exec")


@pytest.mark.parametrize("path", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_generated_sources_are_current(path, tmp_path):
    """generated/<name>/ holds what the templates render now (README's first command
    re-emits it: a stale copy leaves a fresh clone's `git status` dirty)."""
    spec = load_spec(path)
    out = write_generated(spec, tmp_path)
    shipped = REPO / "generated" / spec.name
    for src in sorted(out.glob("*.cu")):
        assert (shipped / src.name).read_text() == src.read_text(), (
            f"generated/{spec.name}/{src.name} is stale: run `flashgen build specs/{path.name}`"
        )
