"""Import layers, read with ``ast`` (nothing executed): each violation is named by file:line.

- ``datamodules`` (the lowest layer: data, tokenizers, caches, tiny models) imports neither ``lightning_modules``
  nor ``callbacks``;
- a paper package (``lightning_modules/<paper>/``) imports no other paper package, and ``lightning_modules/common``
  imports none;
- ``callbacks/kernels/`` is a leaf anyone may import: it imports nothing of the project.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("lightning_modules", "datamodules", "callbacks", "sweeps", "benchmarks", "tests", "runner", "run")
PAPERS = sorted(p.name for p in (ROOT / "lightning_modules").iterdir()
                if p.is_dir() and p.name not in ("common", "__pycache__"))


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


def violation(rel: str, module: str) -> str | None:
    top, *rest = module.split(".")
    paper_of = lambda parts: parts[1] if len(parts) > 1 and parts[0] == "lightning_modules" and parts[1] in PAPERS else None
    mine, theirs = paper_of(rel.split("/")), paper_of(module.split("."))
    if rel.startswith("callbacks/kernels/") and top in PROJECT:
        return "callbacks/kernels is a leaf layer: it imports nothing of the project"
    if rel.startswith("datamodules/") and top in ("lightning_modules", "callbacks"):
        return f"datamodules must not import {top} (move what it needs into datamodules/)"
    if rel.startswith("lightning_modules/common/") and theirs:
        return f"lightning_modules/common must not import the paper package {theirs} (select it by _target_)"
    if mine and theirs and mine != theirs:
        return f"paper package {mine} must not import paper package {theirs} (move the shared part into common/)"
    return None


def test_import_layers():
    found = []
    for path in sorted(p for d in ("lightning_modules", "datamodules", "callbacks") for p in (ROOT / d).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, module in imports(path):
            if why := violation(rel, module):
                found.append(f"{rel}:{line}: imports {module}: {why}")
    assert not found, "import layers broken:\n" + "\n".join(found)


def test_the_rules_catch_each_kind(tmp_path):
    """The checker itself: one planted import of each forbidden kind is reported, the allowed ones are not."""
    paper, other = (PAPERS + ["x", "y"])[:2]
    assert violation("datamodules/text.py", "lightning_modules.common.backbone.resolve_pretrained")
    assert violation("datamodules/verifiable.py", "callbacks.export.ExportPretrained")
    assert violation(f"lightning_modules/{paper}/module.py", f"lightning_modules.{other}.module.X")
    assert violation("lightning_modules/common/kv_press.py", f"lightning_modules.{paper}.scorer.S")
    assert violation("callbacks/kernels/fake_quant.py", "lightning_modules.common.fake_quant.f")
    assert not violation(f"lightning_modules/{paper}/module.py", "lightning_modules.common.lm.CausalLMModule")
    assert not violation(f"lightning_modules/{paper}/module.py", "callbacks.kernels.fake_quant.k")
    assert not violation("lightning_modules/common/lm.py", "datamodules.common.tiny_models.resolve_pretrained")
    assert not violation("callbacks/kernels/fake_quant.py", "torch.nn")
    # relative imports are made absolute before the check
    src = tmp_path / "callbacks" / "kernels" / "planted.py"
    src.parent.mkdir(parents=True)
    src.write_text("from ..export import ExportPretrained\nfrom . import fake_quant\n")
    got = list(imports(src, tmp_path))
    assert got == [(1, "callbacks.export.ExportPretrained"), (2, "callbacks.kernels.fake_quant")]
