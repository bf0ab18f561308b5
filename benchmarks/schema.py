"""The one results schema every paper benchmark writes, and its writer.

``python -m benchmarks <paper>`` (the paper's ``lightning_modules/<paper>/benchmark.py``) ends in
:func:`run_benchmark`, which times the benchmark's ``main``, asks the benchmark's ``claims`` function for its claims
(derived from the measured numbers, never hard-coded, judged by ``benchmarks/stats.py``) and writes
``benchmarks/results/<paper>.json`` with its figures (PNG) beside it, named ``<paper>_*.png``::

    {"schema": 2, "paper": "ps_ppo", "command": "python -m benchmarks ps_ppo", "commit": "1a2b3c4",
     "machine": {"cores": 2, "device": "cpu", ...}, "date": "...", "wall_s": 812.3, "figures": ["ps_ppo_memory.png"],
     "scale": {"model": "tiny-lm (LLaMA)", "params": 1.2e6, "layers": 4, "data": "...", "steps": "30 updates",
               "seeds": 1, "eval": "..."},
     "arms": [{"caption": "per arm, mean over updates", "columns": ["arm", "peak MB"], "rows": [["grpo", 3.1]]}],
     "provenance": null,
     "claims": [{"id": "peak_memory", "quote": "large reductions in ... peak GPU memory", "metric": "...",
                 "value": 0.81, "interval": [0.79, 0.82], "level": 0.9, "method": "delta-method t",
                 "over": "updates", "n_seeds": 1, "n_items": 30, "paired": true, "expect": "<", "threshold": 0.65,
                 "paper_value": null, "our_threshold": "0.65: issue 13's target", "role": "claim",
                 "verdict": "not_held", "why": "..."}]}

A claim quotes a short span of the paper's abstract (``../shared/papers/ABSTRACTS.md``, verbatim), names the metric,
the measured ``value`` (``null`` when not measurable here) with its interval and what the interval is over
(``n_seeds`` and ``n_items`` both stated), the expected direction and threshold, the paper's figure apart from a
threshold of ours, and a verdict from :data:`VERDICTS` that :func:`validate` recomputes with the rule of
``benchmarks/stats.py``. Schema 1 files (before that rule) are migrated by ``python -m benchmarks.migrate_v1``.
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
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from benchmarks.stats import EXPECT, ROLES, UNKNOWN, recheck

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 2  # 2: the verdict rule of benchmarks/stats.py (intervals, n_seeds / n_items, paper vs our threshold)
VERDICTS = ("held", "not_held", "inconclusive", "not_measurable_here")


@dataclass
class Claim:
    """One claim of the abstract, judged by ``benchmarks/stats.py`` (build it with ``stats.claim`` or
    ``stats.not_measurable``, never by hand: :func:`validate` recomputes the verdict from the stored interval)."""
    id: str
    quote: str                        # a short verbatim span of the abstract
    metric: str
    value: float | None               # None only when not measured here
    verdict: str
    why: str                          # one line: the arms' numbers behind the value
    expect: str | None = None         # ">" / "<" the threshold, or "within" ± margin of it; None: not measurable
    threshold: float | None = None
    margin: float | None = None
    interval: list[float] | None = None  # [lo, hi] at ``level``; None: no noise estimate
    level: float | None = None
    method: str | None = None         # how the interval was made: t, paired t, Welch t, Wilson, Newcombe, bootstrap...
    over: str | None = None           # what the interval's replicates are: "seeds", or the items of a run ("prompts")
    df: float | None = None
    stderr: float | None = None
    n_seeds: int | str | None = None  # training seeds behind the value ("unknown" in a migrated file that cannot tell)
    n_items: int | str | None = None  # evaluation items per seed (prompts, tokens, updates, cells, ...)
    paired: bool | None = None
    candidates: int = 1               # choices made after the fact; the interval is Bonferroni-widened for them
    paper_value: str | None = None    # the paper's figure, with where it is (abstract, table, figure)
    our_threshold: str | None = None  # the threshold and why, when it is ours (never the paper's claim)
    role: str = "claim"               # claim / control (go/no-go, planted check) / by_construction: not counted
    degenerate: str | None = None     # why the measurement cannot test the claim (verdict: inconclusive)
    comparisons: list[dict] | None = None  # an 'every competitor' claim: one judged difference per competitor


def mean_se(values: Iterable[float]) -> tuple[float, float | None, int]:
    """Mean, standard error of the mean (None for a single value) and count: for printing; verdicts come from
    ``benchmarks/stats.py``."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_se of no values")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs)), len(xs)


# --- validation ----------------------------------------------------------------------------------------------
_TOP = {"schema": int, "paper": str, "command": str, "commit": str, "machine": dict, "date": str, "wall_s": (int, float),
        "figures": list, "claims": list}
_CLAIM = {"id": str, "quote": str, "metric": str, "verdict": str, "why": str}
_OPTIONAL_STR = ("expect", "method", "over", "paper_value", "our_threshold", "degenerate")
SCALE_KEYS = ("model", "params", "layers", "data", "steps", "seeds", "eval")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return v is None or v == UNKNOWN or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def _validate_claim(c: Any, where: str, bad) -> None:
    if not isinstance(c, dict):
        bad(where, "a claim is a JSON object")
    for key, typ in _CLAIM.items():
        if not isinstance(c.get(key), typ) or not c[key].strip():
            bad(f"{where}.{key}", "missing or empty" if key not in c else f"expected a non-empty {typ.__name__}")
    if c["verdict"] not in VERDICTS:
        bad(f"{where}.verdict", f"{c['verdict']!r} is not one of {', '.join(VERDICTS)}")
    if "\n" in c["why"]:
        bad(f"{where}.why", "one line")
    if len(c["quote"]) > 300:
        bad(f"{where}.quote", "quote a short span of the abstract (at most 300 characters)")
    for key in ("value", "stderr", "threshold", "margin", "df", "level"):
        v = c.get(key)
        if v is not None and not _number(v):
            bad(f"{where}.{key}", f"{v!r} is not a finite number or null")
    for key in _OPTIONAL_STR:
        if c.get(key) is not None and not (isinstance(c[key], str) and c[key].strip()):
            bad(f"{where}.{key}", f"{c[key]!r} is not a non-empty string or null")
    if c.get("expect") is not None and c["expect"] not in EXPECT:
        bad(f"{where}.expect", f"{c['expect']!r} is not one of {', '.join(EXPECT)}")
    if c.get("role", "claim") not in ROLES:
        bad(f"{where}.role", f"{c.get('role')!r} is not one of {', '.join(ROLES)}")
    for key in ("n_seeds", "n_items"):
        if key not in c:
            bad(f"{where}.{key}", f"missing: say how many (null where it does not apply, {UNKNOWN!r} if not known)")
        if not _count(c[key]):
            bad(f"{where}.{key}", f"{c[key]!r} is not a positive count, null or {UNKNOWN!r}")
    iv = c.get("interval")
    if iv is not None:
        if not (isinstance(iv, list) and len(iv) == 2 and all(_number(x) for x in iv) and iv[0] <= iv[1]):
            bad(f"{where}.interval", f"{iv!r} is not [lo, hi] with lo <= hi")
        for key in ("level", "method", "over"):
            if c.get(key) is None:
                bad(f"{where}.{key}", "an interval says its level, method and what it is over")
    if c["verdict"] == "not_measurable_here":
        if c.get("expect") is not None:
            bad(f"{where}.expect", "a claim not measurable here has no test")
        return
    if c.get("expect") is None or c.get("threshold") is None:
        bad(f"{where}.expect", "a judged claim states its expected direction and threshold")
    try:
        implied = recheck(c)
    except ValueError as err:
        bad(f"{where}.verdict", str(err))
    if implied != c["verdict"]:
        bad(f"{where}.verdict", f"{c['verdict']!r} does not follow from the stored interval: the rule "
                                f"(benchmarks/stats.py) gives {implied!r}")


def validate(doc: Any, source: str | Path = "<results>", figures_dir: Path | None = None) -> dict:
    """Check a results document; raise ``ValueError('<source>: <field>: <problem>')`` on the first problem."""
    def bad(field, msg):
        raise ValueError(f"{source}: {field}: {msg}")

    if not isinstance(doc, dict):
        bad("<top>", "a results file is a JSON object")
    if doc.get("schema") == 1:
        bad("schema", "version 1 (before the verdict rule of benchmarks/stats.py): rerun its benchmark, or migrate it "
                      "with python -m benchmarks.migrate_v1")
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
        _validate_claim(c, f"claims[{i}]", bad)
        if c["id"] in seen:
            bad(f"claims[{i}].id", f"{c['id']!r} repeats")
        seen.add(c["id"])
    scale = doc.get("scale", {})
    if not isinstance(scale, dict) or set(scale) - set(SCALE_KEYS):
        bad("scale", f"a dict with keys among {', '.join(SCALE_KEYS)}")
    for i, t in enumerate(doc.get("arms", [])):
        if not (isinstance(t, dict) and isinstance(t.get("caption"), str) and isinstance(t.get("columns"), list)
                and isinstance(t.get("rows"), list) and all(isinstance(r, list) and len(r) == len(t["columns"])
                                                             for r in t["rows"])):
            bad(f"arms[{i}]", "a table is {caption, columns, rows} with one cell per column in every row")
    if doc.get("provenance") is not None and not isinstance(doc["provenance"], str):
        bad("provenance", "a sentence or null")
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
    """HEAD, marked dirty when tracked code differs from it (results and figures under benchmarks/results/ are
    outputs: a benchmark writing them, or ``python -m benchmarks.all`` running one after another, stays clean)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import torch

    gpu = torch.cuda.is_available()
    return {"cores": os.cpu_count() or 1, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(terse=True)}


def arms_table(caption: str, columns: Sequence[str], rows: Iterable[Sequence]) -> dict:
    """A per-arm table of absolute numbers for the results file (and the report), so a reader can recompute each
    verdict; floats keep 4 significant digits."""
    cell = lambda v: float(f"{v:.4g}") if isinstance(v, float) and math.isfinite(v) else (  # noqa: E731
        None if isinstance(v, float) else v)
    return {"caption": caption, "columns": list(columns), "rows": [[cell(v) for v in r] for r in rows]}


def backbone_size(experiment: str, overrides: Sequence[str] = ()) -> dict:
    """{"params", "layers"} of an experiment's backbone, counted on the meta device (no weights are read)."""
    from omegaconf import OmegaConf

    from lightning_modules.common.backbone import build_backbone, count_parameters
    from runner import compose

    spec = OmegaConf.to_container(compose(experiment, list(overrides)).backbone, resolve=True)
    model = build_backbone({**spec, "pretrained": None}, meta=True)
    return {"params": int(count_parameters(model)), "layers": int(model.config.num_hidden_layers)}


def _temporary(argv: Sequence[str]) -> str | None:
    """The first argument naming a temporary folder: such a command cannot be rerun from a clean clone."""
    tmp = (tempfile.gettempdir().rstrip("/") + "/", "/tmp/")
    return next((a for a in argv for part in a.split("=") if part.startswith(tmp)), None)


def write_results(paper: str, claims: Sequence[Claim | dict], *, wall_s: float, figures: Iterable[str | Path] = (),
                  command: str | None = None, out_dir: Path = RESULTS, wandb: bool = False,
                  commit: str | None = None, scale: dict | None = None, arms: Sequence[dict] = (),
                  provenance: str | None = None) -> Path:
    """Validate and write ``<out_dir>/<paper>.json``; copy each figure beside it as ``<paper>_<name>.png``.
    ``commit``: the checkout the measurement ran on (default: now); ``scale``: what the benchmark knows of its size
    (keys :data:`SCALE_KEYS`); ``arms``: per-arm tables (:func:`arms_table`)."""
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
           "wall_s": round(float(wall_s), 1), "figures": names, "scale": dict(scale or {}), "arms": list(arms),
           "provenance": provenance, "claims": [asdict(c) if isinstance(c, Claim) else dict(c) for c in claims]}
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
    cols = ["paper", "id", "metric", "value", "lo", "hi", "over", "n_seeds", "n_items", "expect", "threshold",
            "paper_value", "our_threshold", "role", "verdict", "why", "commit"]
    table = wandb.Table(columns=cols)
    for d in docs:
        for c in d["claims"]:
            lo, hi = c.get("interval") or (None, None)
            table.add_data(d["paper"], c["id"], c["metric"], c.get("value"), lo, hi, c.get("over"),
                           *(str(c.get(k)) if c.get(k) is not None else None for k in ("n_seeds", "n_items")),
                           c.get("expect"), c.get("threshold"), c.get("paper_value"), c.get("our_threshold"),
                           c.get("role", "claim"), c["verdict"], c["why"], d["commit"])
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
    """Run ``main(argv)``, then write its claims: ``claims(result, argv) -> (claims, figure paths[, extra])``,
    ``extra`` = ``{"scale": {...}, "arms": [tables]}`` (see :func:`write_results`).

    ``--wandb`` (removed before ``main`` sees argv) also logs the claims table and figures to W&B. A command naming
    a temporary folder is refused: every recorded command must run from a clean clone."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wandb = "--wandb" in argv
    argv = [a for a in argv if a != "--wandb"]
    if (tmp := _temporary(argv)) is not None:
        raise SystemExit(f"benchmarks {paper}: {tmp!r} is a temporary folder — the results file records the command, "
                         "which must run from a clean clone; let the benchmark make its own data")
    t0, commit = time.perf_counter(), _commit()  # the code that runs: figures written later must not mark it dirty
    try:
        result = main(argv)
    except ModuleNotFoundError as err:
        raise SystemExit(f"benchmarks {paper}: {missing_extra(err)}") from None
    found, figures, *extra = claims(result, argv)
    extra = extra[0] if extra else {}
    return write_results(paper, found, wall_s=time.perf_counter() - t0, figures=figures,
                         command=" ".join(["python -m benchmarks", paper, *argv]), out_dir=out_dir, wandb=wandb,
                         commit=commit, scale=extra.get("scale"), arms=extra.get("arms", ()))
