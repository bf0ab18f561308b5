"""``debug=dryrun`` (``lightning_modules/common/dryrun.py``): a paper-scale experiment's own task on CPU with only its sizes shrunk.

Default suite: the config rewrite on a composed paper-scale config (twin, data root and its miniatures, strategy,
sizes), the endpoint stand-in answering each rubric in the form our parsers read, an unknown data path failing
in one line, one paper-scale experiment dry-run in-process, and one of every other paper on one CPU process
(``PER_PAPER``, a subprocess each, ~10-40 s each with the tiny models built).
``-m dryrun``: every paper-scale experiment as a user runs it, ``python run.py experiment=<name> debug=dryrun``
(2 CPU processes where the strategy is distributed), one subprocess each (~1-3 min each on 2 cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tables import paper_scale_experiments
from runner import compose

ROOT = Path(__file__).resolve().parents[1]


def _prepared(experiment: str, tmp_path, *overrides: str):
    from lightning_modules.common.dryrun import prepare

    cfg = compose(experiment, ["debug=dryrun", "dryrun.processes=1", *overrides], output_dir=tmp_path)
    prepare(cfg)
    return cfg


def test_prepare_caps_long_context_evaluation_lengths(tmp_path):
    """hici_llama7b evaluates perplexity at 2K-100K tokens and passkeys to 57K: a dry run caps every length (lists
    element-wise) to what the shrunk twin holds, and its test set to what the miniature PG-19 has."""
    cfg = _prepared("hici_llama7b", tmp_path)
    ev = cfg.model.evaluation
    assert list(ev.ppl_lengths) == [256] and ev.passkey_max_length == 512 and ev.longbench_max_length == 512
    assert cfg.data.seq_len == 256 and cfg.data.test_documents == 2


def test_prepare_shrinks_a_paper_scale_config(tmp_path):
    """lm_llama7b: LLaMA-2-7B from scratch on shards with the Llama-2 tokenizer, DeepSpeed ZeRO-3 on 8 GPUs."""
    from transformers import AutoTokenizer

    from omegaconf import open_dict

    from lightning_modules.common.dryrun import prepare

    cfg = compose("lm_llama7b", ["debug=dryrun"], output_dir=tmp_path)
    with open_dict(cfg):  # an experiment's own dry-run sizes win over the generic caps
        cfg.dryrun_overrides = {"data.eval_batch_size": 1}
    prepare(cfg)
    assert cfg.data.eval_batch_size == 1 and cfg.data.batch_size == 2
    backbone = cfg.backbone
    assert backbone.pretrained is None and backbone.family == "llama"  # still from scratch, the same family
    assert backbone.config.num_hidden_layers == 2 and backbone.config.hidden_size < 256
    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer.pretrained)
    assert backbone.config.vocab_size == len(tok) and tok.bos_token == "<s>"  # the Llama-2 stand-in
    assert cfg.model.backbone.config.num_hidden_layers == 2  # the module's spec follows the interpolation
    root = Path(cfg.local.data_root)
    assert root == tmp_path / "dryrun_data"
    assert cfg.data.files == f"{root}/pretrain/*.jsonl" and len(list(root.glob("pretrain/*.jsonl"))) == 2
    first = json.loads((root / "pretrain" / "000.jsonl").read_text().splitlines()[0])
    assert len(first["text"]) >= 2000
    tr = cfg.trainer
    assert (tr.accelerator, tr.devices, tr.num_nodes) == ("cpu", 2, 1)
    assert tr.strategy._target_ == "callbacks.deepspeed_cpu.CPUDeepSpeedStrategy" and tr.strategy.stage == 3
    assert cfg.allow_deepspeed_cpu and tr.precision == "bf16-mixed"  # the experiment's precision, kept
    assert tr.max_steps == 2 and tr.limit_val_batches == 1 and cfg.data.seq_len == 256


def test_prepare_points_a_pretrained_backbone_and_its_tokenizer_at_the_twin(tmp_path):
    cfg = _prepared("grpo_qwen25_7b", tmp_path)
    twin = Path(cfg.backbone.pretrained)
    assert (twin / "model.safetensors").exists() and cfg.data.tokenizer.pretrained == str(twin)
    assert cfg.backbone.config.num_attention_heads // cfg.backbone.config.num_key_value_heads == 28 // 4
    assert Path(cfg.data.files).exists() and Path(cfg.data.test_files).exists()  # GSM8K train / test
    record = json.loads(Path(cfg.data.files).read_text().splitlines()[0])
    assert set(record) == {"question", "answer"} and "\n#### " in record["answer"]
    assert cfg.trainer.devices == 1 and cfg.trainer.strategy._target_.endswith("CPUDeepSpeedStrategy")


def test_endpoints_are_answered_on_the_loopback_address(tmp_path, monkeypatch):
    from lightning_modules.common.endpoint import EndpointClient

    for key in ("DEEPSEEK_API_KEY", "OPENAI_API_KEY"):  # unset here, and unset again after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    cfg = _prepared("error_law_deepseek_r1", tmp_path)
    spec = dict(cfg.model.endpoint)
    assert spec["url"].startswith("http://127.0.0.1:") and os.environ["DEEPSEEK_API_KEY"]
    assert spec["cache_dir"].startswith(str(tmp_path))
    assert EndpointClient.from_spec(spec).chat("What is 2 + 2? End with 'Answer: <n>'.") == "Answer: 0"
    from omegaconf import open_dict

    from lightning_modules.common.dryrun import _endpoints  # spard's own data layouts are its helper's: only the endpoint step here

    spard = compose("spard_qwen25_7b_gsm8k", ["debug=dryrun"], output_dir=tmp_path / "spard")
    with open_dict(spard):
        _endpoints(spard, tmp_path / "spard")
    assert spard.model.judge.base_url == spec["url"]  # one stand-in per process, ChatJudge pointed at it
    assert os.environ["OPENAI_API_KEY"]


def test_standin_replies_parse_as_each_rubric():
    from lightning_modules.common.endpoint_standin import reply_for
    from lightning_modules.common.judge import RUBRICS, fill_rubric, parse_attempts, parse_pivot, parse_policy_reply

    harm = parse_policy_reply(reply_for(fill_rubric(RUBRICS["harm"], "p", "r")))
    assert harm["score"] == 1 and not harm["failed"]
    attempts = parse_attempts(reply_for(fill_rubric(RUBRICS["attempts"], "p", "my reply", label="none")))
    assert not attempts["failed"] and attempts["attempts"][0]["text"] == "my reply"
    stated = parse_pivot(reply_for(fill_rubric(RUBRICS["pivot"], "Passage: built by Eiffel.", "Eiffel", label="none")))
    assert stated["value"] == "Eiffel" and not stated["failed"]
    absent = parse_pivot(reply_for(fill_rubric(RUBRICS["pivot"], "Passage: nothing.", "Eiffel", label="none")))
    assert absent["value"] is None and not absent["failed"]


def test_a_path_no_layout_claims_fails_in_one_line(tmp_path):
    from datamodules.common.miniature import MissingLayoutError, write_miniature

    with pytest.raises(MissingLayoutError, match=r"no miniature writer is registered for nowhere/x\.bin") as err:
        write_miniature(tmp_path / "nowhere" / "x.bin", tmp_path, None)
    assert "\n" not in str(err.value)


def test_a_paper_scale_experiment_dry_runs_in_process(tmp_path):
    """llr_llama_60m: LLaMA-60M from scratch on FineWeb parquet shards with the T5 tokenizer, DDP on 8 GPUs; here
    one process (in-process), two optimizer steps, validation, metrics.json as the real run writes it."""
    from runner import run

    cfg = compose("llr_llama_60m", ["debug=dryrun", "dryrun.processes=1", "callbacks.progress_bar=null"],
                  output_dir=tmp_path)
    run(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 2
    assert metrics["final"]["val/loss"] > 0 and metrics["parameters"]["params/total"] < 1e6


# The default suite's dry runs: one paper-scale experiment of each paper (and of the core), the cheapest of its paper,
# as a user runs it but on one CPU process; each in a subprocess, so DeepSpeed and process groups stay out of this one.
# llr's is the in-process test above. HiCI's SFT stage and RLKV's evaluation dry-run their upstream run first (its
# checkpoint converted to one file; its gates).
PER_PAPER = {
    "core": "lm_llama7b", "curvature": "curvature_pythia_2p8b", "dllmquant": "gptq_llada_8b",
    "error_law": "error_law_deepseek_r1", "esr": "esr_gemma2_2b", "growth": "growth_olmoe_depth",
    "hici": "hici_llama7b_sft", "hista": "sveb_qwen25_3b", "infolaw": "infolaw_llama_60m",
    "instemb": "instemb_inbedder_llama3_8b", "manifoldkv": "manifoldkv_qwen3_8b",
    "mdlm_masks": "mdlm_masks_eval_llada_8b", "ps_ppo": "ps_ppo_rlhf_qwen25_7b", "qat_law": "qat_law_llama_74m",
    "real_vqa": "real_vqa_llava15_7b", "rlkv": "rlkv_eval_qwen3_4b_thinking", "spard": "spard_qwen25_7b_obqa",
    "subspace_path": "subspace_path_qwen25_14b", "watersic": "gptq_llama32_1b",
}


def test_every_paper_has_a_dry_run_in_the_default_suite():
    paper_of = {e: str(compose(e).paper.name) for e in paper_scale_experiments()}
    assert set(paper_of.values()) == set(PER_PAPER) | {"llr"}  # llr: the in-process test above
    assert all(paper_of[e] == p for p, e in PER_PAPER.items())


@pytest.mark.parametrize("paper", sorted(PER_PAPER))
def test_each_paper_dry_runs(paper, tmp_path):
    _dry_run(PER_PAPER[paper], tmp_path, "dryrun.processes=1")


@pytest.mark.dryrun
@pytest.mark.parametrize("experiment", paper_scale_experiments())
def test_experiment_dry_runs(experiment, tmp_path):
    _dry_run(experiment, tmp_path)


def _dry_run(experiment: str, tmp_path, *overrides: str) -> None:
    run_dir = tmp_path / experiment
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    proc = subprocess.run([sys.executable, "run.py", f"experiment={experiment}", "debug=dryrun", *overrides,
                           f"hydra.run.dir={run_dir}", "callbacks.progress_bar=null"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[dryrun]" in proc.stdout
    assert "preflight: " in proc.stdout  # the real scale's memory, printed before the shrunk run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok"
    cfg = compose(experiment)
    if "fit" in cfg.task:  # two optimizer steps; manual optimisation may take several in its one batch (RL)
        assert metrics["global_step"] >= 2
