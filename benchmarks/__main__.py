"""``python -m benchmarks <paper> [args]``: run one paper's benchmark (``lightning_modules/<paper>/benchmark.py``),
which writes ``benchmarks/results/<paper>.json``; ``python -m benchmarks`` lists the papers that have one. A tiny
model the benchmark needs and this checkout has not cached is built first (once, as the test suite does), so a
fresh clone runs every benchmark without a separate build step."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from benchmarks.schema import ROOT, run_benchmark
from datamodules.common.tiny_models import BUILD_ON_DEMAND


def papers() -> list[str]:
    """The paper packages with a ``benchmark.py`` (found on disk: shared code names no paper)."""
    return sorted(p.parent.name for p in (ROOT / "lightning_modules").glob("*/benchmark.py"))


def main(argv: list[str]) -> int:
    known = papers()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n\npapers: " + " ".join(known))
        return 0 if argv else 2
    paper, *rest = argv
    if paper not in known:
        print(f"error: no benchmark for {paper!r} — choose one of: {' '.join(known)}", file=sys.stderr)
        return 2
    os.environ.setdefault(BUILD_ON_DEMAND, "1")  # inherited by the runs the benchmark starts
    bench = importlib.import_module(f"lightning_modules.{paper}.benchmark")
    run_benchmark(paper, bench.main, bench.claims, rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
