"""The layers: the diagram in docs/architecture.md, the import-linter contracts in
pyproject.toml and the packages on disk agree, and the package graph has no cycle."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")

DIAGRAM_MARK = "<!-- layers: top to bottom, each line one layer; checked against pyproject.toml -->"


def _contracts() -> dict[str, dict]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _contract_layers() -> list[set[str]]:
    return [{name.strip() for name in layer.split("|")}
            for layer in _contracts()["layers"]["layers"]]


def _diagram_layers() -> list[set[str]]:
    """The diagram's layers, top to bottom, as full module names."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    assert DIAGRAM_MARK in text, "docs/architecture.md lost its layer diagram"
    block = text.split(DIAGRAM_MARK, 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        names = line.split("  ")[0].strip()   # the layer; a comment follows two blanks
        if not names or not re.match(r"^[a-z_]", names):
            continue   # a blank line or an arrow
        layers.append({n.strip() if n.strip() == "elasticdl_client" else
                       f"elasticdl.{n.strip()}" for n in names.split("|")})
    return layers


def test_the_diagram_lists_the_contract_layers():
    assert _diagram_layers() == _contract_layers()


def test_every_package_is_in_a_layer():
    in_layers = set().union(*_contract_layers())
    on_disk = {f"elasticdl.{name}" for name in os.listdir(os.path.join(ROOT, "elasticdl"))
               if os.path.isfile(os.path.join(ROOT, "elasticdl", name, "__init__.py"))}
    assert on_disk | {"elasticdl_client"} == in_layers


def test_type_checking_imports_count():
    contracts = _contracts()
    assert contracts["layers"]["type"] == "layers"
    assert contracts["acyclic"]["type"] == "acyclic_siblings"
    for contract in contracts.values():
        assert not contract.get("exclude_type_checking_imports", False)
        assert not contract.get("ignore_imports")


def test_every_package_is_acyclic_inside():
    # no package's modules are left out of the acyclic contract (elasticdl.master was)
    acyclic = _contracts()["acyclic"]
    assert not acyclic.get("skip_descendants")
    assert acyclic["depth"] >= 1


def test_the_package_graph_has_no_cycle():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "import_graph.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no package cycle" in r.stdout


def test_import_graph_counts_imports_in_functions_and_under_type_checking(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    for pkg, body in (("low", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from elasticdl.high import x\n"),
                      ("high", "def f():\n    from elasticdl.low import y\n")):
        os.makedirs(tmp_path / "elasticdl" / pkg)
        (tmp_path / "elasticdl" / pkg / "__init__.py").write_text("")
        (tmp_path / "elasticdl" / pkg / "m.py").write_text(body)
    graph, _ = import_graph.build(str(tmp_path))
    assert graph == {"low": {"high"}, "high": {"low"}}
    assert import_graph.cycles(graph) == [["high", "low"]]


def test_the_api_re_exports_resolve_without_torch():
    code = ("import sys\nimport elasticdl.api as api\nimport elasticdl.api.model_spec\n"
            "assert 'torch' not in sys.modules\n"
            "from elasticdl.worker.elastic_dataset import ElasticLoopContext\n"
            "assert issubclass(ElasticLoopContext, api.TrainLoopContext)\n"
            "assert callable(api.all_gather) and callable(api.all_reduce)\n"
            "assert issubclass(api.StepAborted, RuntimeError) and api.ElasticState\n"
            "assert issubclass(api.CollectiveError, RuntimeError)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
