"""The QAT-law sweeps as configs: the paper grid sweeps experiments (each N with its own LR) and maps to the
paper's 268 QAT runs; the seeded tiny grid spans ≥ 4× in N and ≥ 8× in D with 3 seeds per cell."""
import itertools
import re

from omegaconf import OmegaConf

from tests.helpers import CONF, compose


def sweep_jobs(experiment: str, sweep: str) -> list[tuple[str, ...]]:
    """Every job's overrides, as Hydra's basic sweeper expands ``hydra.sweeper.params``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = compose(experiment, [f"+sweep={sweep}"]).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return list(itertools.product(*[[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()]
                                    if o.is_sweep_override() else [f"{o.key_or_group}={o.value()}"] for o in parsed]))


def _get(job, key):
    return next(o.split("=", 1)[1] for o in job if o.startswith(key + "="))


def test_paper_grid_sweeps_experiments_and_counts_268_qat_runs():
    grid = sweep_jobs("qat_law_llama_74m", "qat_law_paper")
    val = sweep_jobs("qat_law_llama_973m", "qat_law_paper_validation")
    assert len(grid) == 4 * 4 * 17 and len(val) == 2 * 7
    qat = [j for j in grid + val if _get(j, "model.precisions") != "[fp]"]
    assert len(qat) == 268  # 4 N × 4 D × 4 variants × 4 G = 256, + 973M × {100B, 200B} × 6 variants = 12
    assert {_get(j, "experiment") for j in grid} == {f"qat_law_llama_{n}" for n in ("74m", "145m", "297m", "595m")}
    variants = {re.sub(r"_g\d+$", "", _get(j, "model.precisions").strip("[]")) for j in grid}
    assert variants == {"fp", "w4a4", "w4a16", "w16a4", "w4a4_fc2a8"}
    gs = lambda v: {_get(j, "model.precisions") for j in grid if _get(j, "model.precisions").startswith(f"[{v}_g")}
    assert gs("w4a4_fc2a8") == {f"[w4a4_fc2a8_g{g}]" for g in (32, 64, 128, 256)}  # FC2-A8 at every G
    # every (N, D) has its BF16 twin in the same sweep
    assert {(_get(j, "experiment"), _get(j, "trainer.max_steps")) for j in grid if _get(j, "model.precisions") == "[fp]"} \
        == {(_get(j, "experiment"), _get(j, "trainer.max_steps")) for j in grid}


def test_every_paper_grid_job_keeps_its_own_experiments_lr_and_tokens():
    grid = sweep_jobs("qat_law_llama_74m", "qat_law_paper") + sweep_jobs("qat_law_llama_973m", "qat_law_paper_validation")
    seen = {}
    for j in grid:
        exp = _get(j, "experiment")
        if exp in seen:
            continue
        standalone = compose(exp)
        job = compose(exp, ["+sweep=" + ("qat_law_paper_validation" if "973m" in exp else "qat_law_paper"), *j])
        assert job.model.optimizer.lr == standalone.model.optimizer.lr == standalone.paper.lr
        assert job.backbone == standalone.backbone and job.data._target_.endswith("ShardDataModule")
        per_step = job.data.batch_size * job.trainer.devices * job.trainer.accumulate_grad_batches * job.data.seq_len
        assert standalone.paper.tokens == per_step * standalone.trainer.max_steps
        seen[exp] = (job.model.optimizer.lr, job.trainer.max_steps * per_step)
    lrs = [seen[f"qat_law_llama_{n}"][0] for n in ("74m", "145m", "297m", "595m", "973m")]
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == 5  # each N its own LR, larger N lower
    steps = {int(_get(j, "trainer.max_steps")) for j in grid}
    tokens = sorted(round(s * 524_288 / 1e9) for s in steps)
    assert tokens == [10, 20, 50, 100, 200]


def test_the_launching_config_asks_the_launcher_for_the_jobs_gpus():
    """``python run.py -m +sweep=qat_law_paper launcher=slurm`` composes the default experiment, and submitit's
    resources resolve from it: the sweep itself must carry the jobs' 8 GPUs × 1 node."""
    for sweep, exp in (("qat_law_paper", "qat_law_llama_74m"), ("qat_law_paper_validation", "qat_law_llama_973m")):
        launching = compose("lm_tiny", [f"+sweep={sweep}", "launcher=slurm"])
        job = compose(exp, [f"+sweep={sweep}"])
        assert launching.hydra.launcher.gpus_per_node == job.trainer.devices == 8
        assert launching.hydra.launcher.nodes == job.trainer.num_nodes == 1


def test_every_group_size_of_the_grid_divides_every_paper_backbone_linear():
    for n in ("74m", "145m", "297m", "595m", "973m"):
        c = OmegaConf.load(CONF / "backbone" / f"llama_qat_{n}.yaml").config
        ins = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)  # q/k/v/gate/up, o, down
        assert all(d % g == 0 for d in ins for g in (32, 64, 128, 256)), (n, ins)


def test_tiny_seeded_sweep_spans_4x_in_n_8x_in_d_with_three_seeds():
    jobs = sweep_jobs("qat_law_tiny", "qat_law_tiny_seeds")
    assert len(jobs) == 2 * 4 * 3
    cfgs = {b: compose("qat_law_tiny", ["+sweep=qat_law_tiny_seeds", f"backbone={b}"])
            for b in {_get(j, "backbone") for j in jobs}}
    layers = sorted(c.backbone.config.num_hidden_layers for c in cfgs.values())
    assert layers[-1] / layers[0] >= 4  # N ∝ depth here (same width): 148k → 590k non-embedding
    steps = sorted({int(_get(j, "trainer.max_steps")) for j in jobs})
    assert steps[-1] / steps[0] >= 8
    assert sorted({_get(j, "seed") for j in jobs}) == ["1", "2", "3"]
    c = next(iter(cfgs.values()))
    assert "fp" in c.model.precisions and "w4a4" in c.model.precisions  # the twin trains in the same job
