"""The one results schema every paper benchmark writes, and its writer.

``python -m benchmarks <paper>`` (the paper's ``lightning_modules/<paper>/benchmark.py``) ends in
:func:`run_benchmark`, which times the benchmark's ``main``, asks the benchmark's ``claims`` function for its claims
(derived from the measured numbers, never hard-coded) and writes ``benchmarks/results/<paper>.json`` with its
figures (PNG) beside it, named ``<paper>_*.png``::

    {"schema": 1, "paper": "ps_ppo", "command": "python -m benchmarks ps_ppo ...", "commit": "1a2b3c4 (dirty)",
     "machine": {"cores": 2, "device": "cpu", "torch": "2.x"}, "date": "...", "wall_s": 812.3,
     "figures": ["ps_ppo_memory.png"],
     "claims": [{"id": "peak_memory", "quote": "large reductions in ... peak GPU memory",
                 "metric": "saved-activation peak, PS-PPO packed / GRPO packed", "value": 0.52, "stderr": null,
                 "n": 1, "target": "<= 0.65", "verdict": "held", "why": "0.52 <= 0.65 at matched reward"}]}

A claim quotes a short span of the paper's abstract (``../shared/papers/ABSTRACTS.md``, verbatim), names the metric,
the measured ``value`` (``null`` when not measurable here) with its standard error over ``n`` seeds where there are
seeds, the target or the paper's figure, and a verdict from :data:`VERDICTS` with one line of why.
``python -m benchmarks.report`` renders every results file into ``benchmarks/REPORT.md``.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1
VERDICTS = ("held", "not_held", "inconclusive", "not_measurable_here")


@dataclass
class Claim:
    id: str
    quote: str            # a short verbatim span of the abstract
    metric: str
    value: float | None   # None only when not measurable here
    target: str           # the paper's figure or the threshold the verdict used
    verdict: str
    why: str              # one line
    stderr: float | None = None
    n: int | None = None  # seeds behind value/stderr


# --- verdicts from numbers -----------------------------------------------------------------------------------
def mean_se(values: Iterable[float]) -> tuple[float, float | None, int]:
    """Mean, standard error of the mean (None for a single value) and count."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_se of no values")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs)), len(xs)


def verdict_at_least(value: float | None, target: float, stderr: float | None = None, z: float = 1.645,
                     strict: bool = False) -> str:
    """``held`` if value ≥ target (> with ``strict``) beyond z standard errors, ``not_held`` if on the other side
    beyond them, else ``inconclusive`` (with no standard error the comparison is exact)."""
    if value is None or not math.isfinite(value):
        return "inconclusive"
    margin = z * stderr if stderr else 0.0
    lo, hi = value - margin, value + margin
    if lo > target or (lo == target and not strict):
        return "held"
    if hi < target or (hi == target and strict):
        return "not_held"
    return "inconclusive"


def verdict_at_most(value: float | None, target: float, stderr: float | None = None, z: float = 1.645,
                    strict: bool = False) -> str:
    """Mirror of :func:`verdict_at_least`: ``held`` if value ≤ target (< with ``strict``) beyond z standard errors."""
    return verdict_at_least(None if value is None else -value, -target, stderr, z, strict)


# --- validation ----------------------------------------------------------------------------------------------
_TOP = {"schema": int, "paper": str, "command": str, "commit": str, "machine": dict, "date": str, "wall_s": (int, float),
        "figures": list, "claims": list}
_CLAIM = {"id": str, "quote": str, "metric": str, "target": str, "verdict": str, "why": str}


def validate(doc: Any, source: str | Path = "<results>", figures_dir: Path | None = None) -> dict:
    """Check a results document; raise ``ValueError('<source>: <field>: <problem>')`` on the first problem."""
    def bad(field, msg):
        raise ValueError(f"{source}: {field}: {msg}")

    if not isinstance(doc, dict):
        bad("<top>", "a results file is a JSON object")
    for key, typ in _TOP.items():
        if key not in doc:
            bad(key, "missing")
        if not isinstance(doc[key], typ) or isinstance(doc[key], bool):
            bad(key, f"expected {typ.__name__ if isinstance(typ, type) else 'a number'}, got {type(doc[key]).__name__}")
    if doc["schema"] != SCHEMA_VERSION:
        bad("schema", f"version {doc['schema']} is not {SCHEMA_VERSION}")
    if not re.fullmatch(r"[a-z0-9_]+", doc["paper"]):
        bad("paper", f"{doc['paper']!r} is not a paper short name (lower case, digits, _)")
    for key in ("cores", "device"):
        if key not in doc["machine"]:
            bad(f"machine.{key}", "missing")
    if not doc["claims"]:
        bad("claims", "empty: a benchmark tests at least one claim")
    seen = set()
    for i, c in enumerate(doc["claims"]):
        where = f"claims[{i}]"
        if not isinstance(c, dict):
            bad(where, "a claim is a JSON object")
        for key, typ in _CLAIM.items():
            if not isinstance(c.get(key), typ) or not c[key].strip():
                bad(f"{where}.{key}", "missing or empty" if key not in c else f"expected a non-empty {typ.__name__}")
        if c["id"] in seen:
            bad(f"{where}.id", f"{c['id']!r} repeats")
        seen.add(c["id"])
        if c["verdict"] not in VERDICTS:
            bad(f"{where}.verdict", f"{c['verdict']!r} is not one of {', '.join(VERDICTS)}")
        if "\n" in c["why"]:
            bad(f"{where}.why", "one line")
        if len(c["quote"]) > 300:
            bad(f"{where}.quote", "quote a short span of the abstract (at most 300 characters)")
        for key in ("value", "stderr"):
            v = c.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                bad(f"{where}.{key}", f"{v!r} is not a finite number or null")
        if c.get("value") is None and c["verdict"] in ("held", "not_held"):
            bad(f"{where}.value", f"null, but the verdict is {c['verdict']!r}: a verdict needs a measured value")
        if c.get("n") is not None and (not isinstance(c["n"], int) or c["n"] < 1):
            bad(f"{where}.n", f"{c['n']!r} is not a positive count")
    for i, f in enumerate(doc["figures"]):
        if not isinstance(f, str) or not f.endswith(".png") or "/" in f:
            bad(f"figures[{i}]", f"{f!r} is not a PNG file name beside the results file")
        if figures_dir is not None and not (figures_dir / f).is_file():
            bad(f"figures[{i}]", f"{f} does not exist in {figures_dir}")
    return doc


def load(path: Path) -> dict:
    """Read and validate one results file (figures are looked up beside it)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: <json>: {err}") from None
    return validate(doc, path, Path(path).parent)


# --- writing -------------------------------------------------------------------------------------------------
def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return sha + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import torch

    gpu = torch.cuda.is_available()
    return {"cores": os.cpu_count() or 1, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(terse=True)}


def write_results(paper: str, claims: Sequence[Claim | dict], *, wall_s: float, figures: Iterable[str | Path] = (),
                  command: str | None = None, out_dir: Path = RESULTS, wandb: bool = False,
                  commit: str | None = None) -> Path:
    """Validate and write ``<out_dir>/<paper>.json``; copy each figure beside it as ``<paper>_<name>.png``.
    ``commit``: the checkout the measurement ran on (default: now)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for f in figures:
        f = Path(f)
        name = f.name if f.name.startswith(f"{paper}_") else f"{paper}_{f.name}"
        if f.resolve() != (out_dir / name).resolve():
            shutil.copyfile(f, out_dir / name)
        names.append(name)
    doc = {"schema": SCHEMA_VERSION, "paper": paper,
           "command": command or " ".join(["python -m", f"benchmarks.{paper}", *sys.argv[1:]]),
           "commit": commit or _commit(), "machine": machine(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "wall_s": round(float(wall_s), 1), "figures": names,
           "claims": [asdict(c) if isinstance(c, Claim) else dict(c) for c in claims]}
    path = out_dir / f"{paper}.json"
    validate(doc, path, out_dir)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
          + ", ".join(f"{c['id']} {c['verdict']}" for c in doc["claims"]))
    if wandb:
        log_wandb([doc], out_dir)
    return path


def log_wandb(docs: Sequence[dict], figures_dir: Path, name: str | None = None) -> None:
    """The claims of ``docs`` as one ``wandb.Table`` plus their figures (WANDB_MODE defaults to offline here)."""
    import wandb

    run = wandb.init(project="paperlab", job_type="report", name=name or "+".join(d["paper"] for d in docs),
                     mode=os.environ.get("WANDB_MODE", "offline"), dir=str(ROOT))
    cols = ["paper", "id", "metric", "value", "stderr", "n", "target", "verdict", "why", "commit"]
    table = wandb.Table(columns=cols)
    for d in docs:
        for c in d["claims"]:
            table.add_data(d["paper"], c["id"], c["metric"], c.get("value"), c.get("stderr"), c.get("n"), c["target"],
                           c["verdict"], c["why"], d["commit"])
    run.log({"claims": table, **{f"figures/{f[:-4]}": wandb.Image(str(figures_dir / f)) for d in docs
                                 for f in d["figures"]}})
    run.finish()


# --- the benchmark entry point -------------------------------------------------------------------------------
def missing_extra(err: ModuleNotFoundError) -> str:
    """One line naming the extra (pyproject's optional-dependencies) that provides the missing module."""
    from datamodules.common.errors import missing_extra as extra_error

    found = extra_error(err)
    mod = (err.name or "").split(".")[0]
    if found is None:
        return f"missing module {mod!r}: it is in no extra of pyproject.toml; pip install it"
    return str(found)


def run_benchmark(paper: str, main: Callable[[list[str]], Any], claims: Callable[[Any, list[str]], tuple],
                  argv: Sequence[str] | None = None, out_dir: Path = RESULTS) -> Path:
    """Run ``main(argv)``, then write its claims: ``claims(result, argv) -> (claims, figure paths)``.

    ``--wandb`` (removed before ``main`` sees argv) also logs the claims table and figures to W&B."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wandb = "--wandb" in argv
    argv = [a for a in argv if a != "--wandb"]
    t0, commit = time.perf_counter(), _commit()  # the code that runs: figures written later must not mark it dirty
    try:
        result = main(argv)
    except ModuleNotFoundError as err:
        raise SystemExit(f"benchmarks {paper}: {missing_extra(err)}") from None
    found, figures = claims(result, argv)
    return write_results(paper, found, wall_s=time.perf_counter() - t0, figures=figures,
                         command=" ".join(["python -m benchmarks", paper, *argv]), out_dir=out_dir, wandb=wandb,
                         commit=commit)
