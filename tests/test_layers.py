"""Import layers, read with ``ast`` (nothing executed): each violation is named by file:line.

1. Shared code (``lightning_modules/common``, ``datamodules``, ``callbacks``, ``sweeps``, ``benchmarks``,
   ``runner.py``, ``run.py``) imports no paper package and names none in a string (a ``_target_`` or a module path
   it would import); papers reach shared code through configs and registries.
2. A paper package (``lightning_modules/<paper>/``) imports no other paper package.
3. Non-test code imports nothing from ``tests/``.
4. ``callbacks/kernels/`` imports nothing of the project: it is the ground floor every layer may use.
And ``datamodules`` (the lowest layer above the kernels) imports neither ``lightning_modules`` nor ``callbacks``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("lightning_modules", "datamodules", "callbacks", "sweeps", "benchmarks", "tests", "runner", "run")
SHARED = ("lightning_modules/common/", "datamodules/", "callbacks/", "sweeps/", "benchmarks/", "runner.py", "run.py")
PAPERS = sorted(p.name for p in (ROOT / "lightning_modules").iterdir()
                if p.is_dir() and p.name not in ("common", "__pycache__"))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (prose may mention a paper; code may not)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def imports(path: Path, root: Path = ROOT):
    """(line, absolute module name) of every import in a file, relative ones made absolute."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module or "") if p)
            yield from ((node.lineno, f"{module}.{a.name}") for a in node.names)


def named_papers(path: Path):
    """(line, paper) for every non-docstring string constant naming a paper package (dotted or as a path)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    rx = re.compile(r"lightning_modules[./](" + "|".join(map(re.escape, PAPERS)) + r")\b") if PAPERS else None
    for node in ast.walk(tree):
        if rx and isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            for m in rx.finditer(node.value):
                yield node.lineno, m.group(1)


def _paper_of(parts) -> str | None:
    return parts[1] if len(parts) > 1 and parts[0] == "lightning_modules" and parts[1] in PAPERS else None


def violation(rel: str, module: str) -> str | None:
    """Why importing ``module`` from the file ``rel`` (relative to the repo) breaks a layer, else None."""
    top = module.split(".")[0]
    mine, theirs = _paper_of(rel.split("/")), _paper_of(module.split("."))
    if rel.startswith("callbacks/kernels/") and top in PROJECT and not module.startswith("callbacks.kernels."):
        return "callbacks/kernels is the ground floor: it imports nothing of the project"
    if not rel.startswith("tests/") and top == "tests":
        return "non-test code must not import tests/ (move what it needs into runner.py or a shared module)"
    if rel.startswith("datamodules/") and top in ("lightning_modules", "callbacks"):
        return f"datamodules must not import {top} (move what it needs into datamodules/)"
    if rel.startswith(SHARED) and theirs:
        return (f"shared code must not import the paper package {theirs} (select it by _target_ in a config, or "
                "let the paper register itself)")
    if mine and theirs and mine != theirs:
        return f"paper package {mine} must not import paper package {theirs} (move the shared part into common/)"
    return None


def source_files() -> list[Path]:
    dirs = ("lightning_modules", "datamodules", "callbacks", "sweeps", "benchmarks")
    return sorted([p for d in dirs for p in (ROOT / d).rglob("*.py")] + [ROOT / f for f in ("runner.py", "run.py")])


def test_import_layers():
    found = []
    for path in source_files():
        rel = str(path.relative_to(ROOT))
        for line, module in imports(path):
            if why := violation(rel, module):
                found.append(f"{rel}:{line}: imports {module}: {why}")
        if rel.startswith(SHARED):
            found += [f"{rel}:{line}: names the paper package {paper} in a string: shared code names no paper"
                      for line, paper in named_papers(path)]
    assert not found, "import layers broken:\n" + "\n".join(found)


def test_the_rules_catch_each_kind(tmp_path):
    """The checker itself: one planted violation of each kind is reported, the allowed imports are not."""
    paper, other = (PAPERS + ["x", "y"])[:2]
    # 1. shared code importing or naming a paper
    assert violation("lightning_modules/common/kv_press.py", f"lightning_modules.{paper}.scorer.S")
    assert violation("sweeps/fit.py", f"lightning_modules.{paper}.law.Law")
    assert violation("benchmarks/report.py", f"lightning_modules.{paper}.benchmark.main")
    assert violation("runner.py", f"lightning_modules.{paper}.module.M")
    assert violation("callbacks/export.py", f"lightning_modules.{paper}.module.M")
    src = tmp_path / "planted.py"
    src.write_text(f'"""A docstring may mention lightning_modules/{paper}/."""\n'
                   f'TARGET = "lightning_modules.{paper}.module.M"\n')
    assert list(named_papers(src)) == [(2, paper)]
    # 2. a paper importing another
    assert violation(f"lightning_modules/{paper}/module.py", f"lightning_modules.{other}.module.X")
    # 3. non-test code importing tests
    assert violation(f"lightning_modules/{paper}/benchmark.py", "tests.helpers.run_experiment")
    assert violation("benchmarks/tables.py", "tests.helpers.compose")
    assert not violation("tests/test_x.py", "tests.helpers.compose")
    # 4. kernels importing the project
    assert violation("callbacks/kernels/fake_quant.py", "lightning_modules.common.lm.f")
    # and the data layer
    assert violation("datamodules/text.py", "lightning_modules.common.backbone.resolve_pretrained")
    assert violation("datamodules/verifiable.py", "callbacks.export.ExportPretrained")
    # allowed
    assert not violation(f"lightning_modules/{paper}/module.py", "lightning_modules.common.lm.CausalLMModule")
    assert not violation(f"lightning_modules/{paper}/module.py", "callbacks.kernels.fake_quant.k")
    assert not violation(f"lightning_modules/{paper}/benchmark.py", "benchmarks.schema.Claim")
    assert not violation(f"lightning_modules/{paper}/law.py", "sweeps.laws.Law")
    assert not violation("lightning_modules/common/lm.py", "datamodules.common.tiny_models.resolve_pretrained")
    assert not violation("callbacks/kernels/fake_quant.py", "torch.nn")
    assert not violation("callbacks/kernels/w4a16.py", "callbacks.kernels.fake_quant.k")  # a sibling kernel
    # relative imports are made absolute before the check
    src = tmp_path / "callbacks" / "kernels" / "planted.py"
    src.parent.mkdir(parents=True)
    src.write_text("from ..export import ExportPretrained\nfrom . import fake_quant\n")
    got = list(imports(src, tmp_path))
    assert got == [(1, "callbacks.export.ExportPretrained"), (2, "callbacks.kernels.fake_quant")]
