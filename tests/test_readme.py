"""The READMEs are executable: every ``python run.py …`` / ``python -m …`` command in them runs as typed.

Commands are read from the code blocks and inline code of ``README.md`` and every paper's
``lightning_modules/<paper>/README.md`` (the experiment tables' command column, the papers' benchmark entry points),
so a new README line is covered without editing this test. Each runs in
a subprocess, exactly as written, plus ``paths.log_dir=<tmp>`` and ``WANDB_MODE=offline``:

- hardware- or cluster-bound lines (a paper-scale experiment, ``launcher=slurm``, ``trainer=gpu``, DeepSpeed)
  and lines with a placeholder (``<glob>``: user data) run with ``--cfg job`` and must compose (``-m`` is
  dropped and a swept value takes its first choice: Hydra composes one job, not a sweep, with ``--cfg``);
- the rest run with ``debug=smoke`` appended and must exit 0; ``python -m <entry point>`` runs with ``--help``
  (benchmarks take minutes), and a line that reads a sweep's output runs, in the slow suite, after the sweep
  command written before it in the same table cell, in one temporary working directory.

The default suite runs the first line of every command shape (compose per reason, single run, multirun, each
logger, resume, entry-point help, sweep fit); every other line runs under ``slow``. ``python -m pytest`` lines
are the suite itself and are skipped here; the two set-up commands run in ``test_setup_commands_fresh_clone``.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readmes() -> list[Path]:
    """The top README and every paper's."""
    return [README, *sorted((ROOT / "lightning_modules").glob("*/README.md"))]
PLACEHOLDER = re.compile(r"<[^<>`]+>|…")  # user data, or an elided argument list
HARDWARE = ("launcher=slurm", "trainer=gpu", "trainer=deepspeed", "trainer.accelerator=gpu")


@dataclass
class Item:
    """One README line (or a table cell's chain of lines) and how it runs here."""
    line: str
    mode: str                      # cfg | smoke | help | chain
    shapes: tuple[str, ...]
    chain: list[str] = field(default_factory=list)  # earlier lines of the same cell, run first (mode chain)


def _commands_in(text: str) -> list[str]:
    return [c.strip() for c in re.split(r"\s*(?:&&|;)\s*", text) if c.strip().startswith(("python run.py", "python -m "))]


def readme_commands() -> list[list[str]]:
    """Commands grouped as the READMEs group them: one group per code-block line or per inline-code cell/sentence."""
    text = "\n\n".join(p.read_text() for p in readmes())
    groups: list[list[str]] = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    for block in blocks:
        for line in block.splitlines():
            line = line.split("  #")[0].split(" #")[0] if "#" in line else line
            if line.strip().startswith(("python run.py", "python -m ")):
                groups.append(_commands_in(line))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for row in prose.splitlines():  # a table cell or a paragraph line: its inline commands, in order
        cells = row.split("|") if row.startswith("|") else [row]
        for cell in cells:
            cmds = [c for span in re.findall(r"`([^`]+)`", cell) for c in _commands_in(span)]
            if cmds:
                groups.append(cmds)
    seen, out = set(), []
    for g in groups:
        g = [c for c in g if not c.startswith("python -m pytest")]  # the suite itself
        if g and tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(g)
    return out


def _is_multirun(line: str) -> bool:
    return bool({"-m", "--multirun"} & set(line.split()))


def _experiment(tokens: list[str]) -> str:
    return next((t.split("=", 1)[1] for t in tokens if t.startswith("experiment=")), "lm_tiny")


def plan(group: list[str]) -> list[Item]:
    items = []
    for i, line in enumerate(group):
        tokens = line.split()
        if line.startswith("python -m "):
            module = tokens[2]
            items.append(Item(line, "help", ("help:" + module.split(".")[0],)))
            if len(tokens) > 3 and not PLACEHOLDER.search(line):  # reads what the cell's sweeps wrote
                items.append(Item(line, "chain", ("chain",), chain=[g for g in group[:i] if _is_multirun(g)]))
            continue
        exp = _experiment(tokens)
        reasons = [r for r in HARDWARE if any(t.startswith(r) for t in tokens)]
        reasons += ["deepspeed"] if any("deepspeed" in t for t in tokens if t.startswith("trainer=")) else []
        reasons += ["paper"] if not exp.endswith("_tiny") else []
        reasons += ["placeholder"] if PLACEHOLDER.search(line) else []
        if "--cfg" in tokens:
            items.append(Item(line, "cfg", ("cfg",)))
        elif reasons:
            items.append(Item(line, "cfg", tuple(f"compose:{r}" for r in reasons)))
        elif _is_multirun(line) and any(g.startswith("python -m ") for g in group[i + 1:]):
            continue  # a sweep whose output a later line reads: run as that line's chain
        else:
            shapes = ["multirun" if _is_multirun(line) else "run"]
            shapes += [f"logger:{t.split('=', 1)[1]}" for t in tokens if t.startswith("logger=")]
            shapes += ["resume"] if any(t.startswith("ckpt_path=") for t in tokens) else []
            items.append(Item(line, "smoke", tuple(shapes)))
    return items


def _items() -> list:
    params, covered = [], set()
    for group in readme_commands():
        for item in plan(group):
            new = set(item.shapes) - covered
            covered |= set(item.shapes)
            marks = () if new and item.mode != "chain" else (pytest.mark.slow,)  # a chain runs a whole sweep
            params.append(pytest.param(item, id=f"{item.mode}:{item.line[:90]}", marks=marks))
    return params


def _argv(line: str, tmp: Path, mode: str) -> list[str]:
    """The command line as typed, with what this test adds: paths.log_dir, debug=smoke / --cfg job / --help."""
    line = PLACEHOLDER.sub(str(tmp / "user_data"), line)
    tokens = shlex.split(line)
    assert tokens[0] == "python", line
    argv = [sys.executable, *tokens[1:]]
    if tokens[1] == "-m":
        return argv + ["--help"] if mode == "help" else argv
    argv[1] = str(ROOT / "run.py")
    argv.append(f"paths.log_dir={tmp / 'logs'}")
    if mode == "cfg" and "--cfg" not in argv:
        argv = [a for a in argv if a not in ("-m", "--multirun")]
        argv = [a.split(",")[0] if "=" in a and "," in a and "[" not in a else a for a in argv]
        argv += ["--cfg", "job"]
    elif mode in ("smoke", "chain") and not any(a.startswith("debug=") for a in argv):
        argv.append("debug=smoke")
    return argv


def _run(argv: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HYDRA_FULL_ERROR="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_readme_has_every_command_shape():
    """The parser finds the README's lines: a regression here means a README edit escaped the test."""
    shapes = {s for g in readme_commands() for item in plan(g) for s in item.shapes}
    assert {"run", "multirun", "resume", "logger:wandb", "cfg", "compose:launcher=slurm", "compose:paper",
            "compose:placeholder", "help:benchmarks", "help:sweeps", "chain"} <= shapes, shapes
    lines = [item.line for g in readme_commands() for item in plan(g)]
    assert "python run.py -m experiment=lm_tiny seed=1,2,3" in lines
    assert any(line.startswith("python -m sweeps.fit logs/multirun/qat_law_tiny") for line in lines)


@pytest.mark.parametrize("item", _items())
def test_readme_command(item: Item, tmp_path):
    if item.mode == "chain":
        for earlier in item.chain:
            _run(_argv(earlier, tmp_path, "smoke"), cwd=tmp_path)
    proc = _run(_argv(item.line, tmp_path, item.mode), cwd=tmp_path)
    if item.mode == "cfg":
        from omegaconf import OmegaConf

        cfg = OmegaConf.create(proc.stdout)
        assert "trainer" in cfg and "model" in cfg, proc.stdout[:500]
    elif item.mode == "help":
        assert "usage" in proc.stdout.lower()
    elif item.mode == "smoke":
        runs = list((tmp_path / "logs").rglob("metrics.json"))
        assert runs, f"{item.line}: no metrics.json under {tmp_path / 'logs'}"
        import json

        assert all(json.loads(p.read_text()).get("status") == "ok" for p in runs)
        tokens = item.line.split()
        if "-m" in tokens:
            assert (tmp_path / "logs" / "multirun" / _experiment(tokens) / "summary.json").exists()
        if "logger=wandb" in tokens:  # each run dir holds a finished offline W&B run with its final metrics
            from tests.test_logging import wandb_records

            for path in runs:
                final, rec = json.loads(path.read_text())["final"], wandb_records(path.parent)
                assert rec["exit"] == 0 and rec["config"]["experiment"] == _experiment(tokens)
                assert rec["summary"]["val/loss"] == pytest.approx(final["val/loss"], rel=1e-6)


def _setup_blocks() -> list[str]:
    text = README.read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_setup_section_has_two_commands():
    blocks = _setup_blocks()
    assert len(blocks) == 2 and all(len(b.splitlines()) == 1 for b in blocks), blocks
    assert blocks[0].endswith("python run.py") and blocks[1].endswith("python -m pytest -q")


@pytest.mark.slow
def test_setup_commands_fresh_clone(tmp_path):
    """What CI does: a clean clone, a fresh venv, the README's two set-up commands as typed (the second with
    ``-m 'not slow'`` implied by the project's pytest defaults, so this test does not run itself)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    first, second = _setup_blocks()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for cmd in (first, second):
        proc = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=7200)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert list((clone / "logs" / "runs" / "lm_tiny").rglob("metrics.json"))
    shutil.rmtree(clone / ".venv", ignore_errors=True)
