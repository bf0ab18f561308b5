"""Paper-scale experiments as data: each names the table of its paper it reproduces, and its header's global batch,
sequence length, tokens and learning rate are what the composed config really runs, so a copy-paste cannot drift.

Nothing is built or run. Every paper-scale experiment is composed, its budget derived from the trainer, data and
model keys, and compared with its ``paper:`` block; every main table in ``lightning_modules/<paper>/tables.yaml`` must be
reproduced by some experiment or sweep (``benchmarks/tables.py`` joins the two; the report shows the same join).
"""
from __future__ import annotations

import math

import pytest

from benchmarks.tables import ROOT, composed, coverage, load_tables, paper_scale_experiments, reproduces

HEADER_KEYS = ("name", "reproduces", "figure", "hardware", "global_batch", "seq_len", "tokens", "lr", "schedule", "eval")


def derived_budget(cfg) -> dict:
    """Global batch, sequence length, tokens and peak LR as the composed config runs them (None: no training)."""
    if cfg.task in ("test", "validate"):
        return dict.fromkeys(("global_batch", "seq_len", "tokens", "lr"))
    tr, data, model = cfg.trainer, cfg.data, cfg.model
    devices = tr.get("devices", 1)
    devices = devices if isinstance(devices, int) else len(devices)
    per_step = (int(data.batch_size) * devices * int(tr.get("num_nodes") or 1)
                * int(tr.get("accumulate_grad_batches") or 1))
    lr = float(model.optimizer.lr)
    if "group_size" in model:  # RL: prompts per rollout step; token counts follow the sampler
        return {"global_batch": per_step, "seq_len": None, "tokens": None, "lr": lr}
    if data.get("seq_len") is None:  # variable lengths (DuoAttention's 1K-32K passkey contexts): no fixed token count
        return {"global_batch": per_step, "seq_len": None, "tokens": None, "lr": lr}
    seq_len = int(data.seq_len)
    return {"global_batch": per_step, "seq_len": seq_len, "tokens": per_step * seq_len * int(tr.max_steps), "lr": lr}


@pytest.mark.parametrize("experiment", paper_scale_experiments())
def test_header_names_a_table_and_matches_the_config(experiment):
    header = composed(experiment).get("paper")
    assert header is not None, f"conf/experiment/{experiment}.yaml has no paper: header (README, 'Add a paper')"
    missing = [k for k in HEADER_KEYS if k not in header]
    assert not missing, f"{experiment}: its paper: header lacks {missing}"
    tables = {t["id"] for t in load_tables().get(header.name, [])}
    assert tables, f"{experiment}: lightning_modules/{header.name}/tables.yaml is missing or lists no table"
    ids = reproduces(header)
    assert ids and set(ids) <= tables, (
        f"{experiment}: paper.reproduces {ids} must name tables of lightning_modules/{header.name}/tables.yaml {sorted(tables)}")
    for key, value in derived_budget(composed(experiment)).items():
        stated = header.get(key)
        if value is None:
            assert stated is None, f"{experiment}: paper.{key}={stated}, but the run does not train"
        else:
            assert stated is not None and math.isclose(float(stated), float(value), rel_tol=1e-9), (
                f"{experiment}: paper.{key}={stated}, but the config runs {value}")


def test_every_main_table_has_an_experiment_or_sweep():
    sweeps = {p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")}
    uncovered = []
    for paper, tables in coverage().items():
        for t in tables:
            unknown = set(t["sweeps"]) - sweeps
            assert not unknown, f"lightning_modules/{paper}/tables.yaml: {t['id']} names sweeps not in conf/sweep/: {unknown}"
            if not t["experiments"] and not t["sweeps"]:
                uncovered.append(f"{paper}: {t['id']} ({t['what']})")
    assert not uncovered, "main tables with no paper-scale experiment or sweep:\n" + "\n".join(uncovered)


def test_derivation_catches_a_drifted_header():
    """The check is not vacuous: a header one accumulation step off is caught."""
    from omegaconf import OmegaConf

    experiment = next(e for e in paper_scale_experiments() if derived_budget(composed(e))["tokens"])
    cfg = OmegaConf.create(OmegaConf.to_container(composed(experiment), resolve=False))
    before = derived_budget(cfg)
    cfg.trainer.accumulate_grad_batches = int(cfg.trainer.get("accumulate_grad_batches") or 1) + 1
    after = derived_budget(cfg)
    assert after["global_batch"] > before["global_batch"] and after["tokens"] > before["tokens"]


@pytest.mark.parametrize("experiment", [e for e in paper_scale_experiments() if e.startswith("spard_")])
def test_spard_updates_are_the_release_s(experiment):
    """SPARD's release trains in one process on 128 user examples per update for 10 epochs: the global batch is 128
    on whatever devices the config names, and max_steps is 10 x ceil(|task + harmful| / 128) for the task rows the
    config assumes (the run itself checks them against its file)."""
    cfg = composed(experiment)
    budget = derived_budget(cfg)
    assert budget["global_batch"] == 128 == cfg.paper.global_batch
    assert cfg.data.epochs == 10 and cfg.model.grad_accum == 4
    from lightning_modules.spard.data import release_updates

    assert cfg.trainer.max_steps == release_updates(int(cfg.data.task_rows), float(cfg.data.harmful_ratio), 10, 128)
