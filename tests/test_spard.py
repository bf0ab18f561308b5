"""SPARD (issue 19): the SPAG safety step on toys, the loop's counts and switches on a tiny random model, the data's
splits and bad input, and spard_tiny end to end. RD-DPP itself: tests/test_selection.py."""
import json
import math
from functools import partial

import pytest
import torch

from lightning_modules.spard.spag import safety_step


def toy(values, grads):
    params = [torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in values]
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, dtype=torch.float64)
    return params, torch.optim.SGD(params, lr=1.0)


FREE = dict(alpha_max=100.0, eta_safe=100.0, max_grad_norm=None)  # caps not binding


def test_no_trigger_no_update():
    params, opt = toy([[1.0, 2.0], [3.0]], [[1.0, 1.0], [2.0]])
    st = safety_step(params, 0.3, opt, tau=0.2, delta=0.1)  # L_s = τ + δ: not above
    assert st["trigger"] == 0 and params[0].tolist() == [1.0, 2.0] and params[1].tolist() == [3.0]
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_code_faithful_scales_each_tensor(clip):
    g1, g2 = torch.tensor([3.0, 4.0]), torch.tensor([0.1, 0.0])
    params, opt = toy([[0.0, 0.0], [0.0, 0.0]], [g1.tolist(), g2.tolist()])
    loss, tau = 1.0, 0.2
    st = safety_step(params, loss, opt, tau=tau, delta=0.1, alpha_max=1.0, max_grad_norm=clip)
    c = 1.0 if clip is None else min(1.0, clip / math.hypot(5.0, 0.1))  # the global clip first
    for p, g in ((params[0], g1 * c), (params[1], g2 * c)):
        a = min((loss - tau) / (float(g.norm()) + 1e-8), 1.0)  # tensor 2: α_max binds
        assert torch.allclose(p.detach().float(), -a * g, atol=1e-6)
    assert st["trigger"] == 1


@pytest.mark.parametrize("norm_a,projection,expected", [
    (1.0, "code_faithful", "tau"), (1.0, "polyak", "tau"), (2.0, "code_faithful", "L-2(L-tau)"), (2.0, "polyak", "tau")])
def test_linear_loss_lands(norm_a, projection, expected):
    a = torch.tensor([0.6, 0.8], dtype=torch.float64) * norm_a
    params, opt = toy([[0.5, -0.25]], [a.tolist()])
    c, tau = 1.7, 0.2

    def L(th):
        return float(c + a @ th)

    before = L(params[0].detach())
    safety_step(params, before, opt, tau=tau, delta=0.1, projection=projection, **FREE)
    after = L(params[0].detach())
    # 1e-7: the release's 1e-8 in the per-tensor denominator
    assert after == pytest.approx(tau if expected == "tau" else before - 2 * (before - tau), abs=1e-7)


def test_polyak_trust_region_caps_the_step():
    params, opt = toy([[0.0, 0.0]], [[3.0, 4.0]])
    safety_step(params, 10.0, opt, tau=0.2, projection="polyak", eta_safe=0.5, max_grad_norm=None)
    assert float(params[0].detach().norm()) == pytest.approx(0.5)


# --- the loop on a tiny random model --------------------------------------------------------------
def fit(tokenizer, steps=3, G=2, lr=1e-2, dm_setup=None, init_range=0.02, **kw):
    import lightning as L

    from lightning_modules.spard.data import SPARDDataModule
    from lightning_modules.spard.module import SPARDModule

    L.seed_everything(0)
    dm = SPARDDataModule(tokenizer, n_task=40, pool_size=30, n_val=4, n_test=4, batch_size=2 * G)
    if dm_setup is not None:  # edit the built sets before the fit (setup is idempotent)
        dm.setup()
        dm_setup(dm)
    spec = {"family": "llama", "config": {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                          "initializer_range": init_range}}
    module = SPARDModule(spec, partial(torch.optim.AdamW, lr=lr),
                         partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1.0 / (1 + s)),
                         weight_decay=0.01, grad_accum=G, max_length=64, dpp={"ratio": 0.2}, **kw)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=dm)
    return module, trainer


def test_loop_counts_and_switches(tiny_tokenizer):
    never, tr = fit(tiny_tokenizer, tau=1e9)
    sft, _ = fit(tiny_tokenizer, defence="sft")
    # one update = one step: triggers logged = scheduler steps = Lightning's step count; G safe micro-batches each
    assert tr.global_step == 3 == len(never.triggers) == never.counts["scheduler_steps"]
    assert tr.lr_scheduler_configs[0].scheduler.last_epoch == 3 and never.triggers == [0, 0, 0]
    assert never.counts["safe_micro_batches"] == 3 * 2 == never.counts["user_micro_batches"]
    # a safety phase that never triggers leaves the weights exactly where fine-tuning alone takes them
    for (n, p), (_, q) in zip(never.model.named_parameters(), sft.model.named_parameters()):
        assert torch.equal(p, q), n
    always, _ = fit(tiny_tokenizer, tau=-1e9, projection="polyak")
    assert always.triggers == [1, 1, 1] and all(math.isfinite(x) for x in always.probes)
    assert any(not torch.equal(p, q) for p, q in zip(always.model.parameters(), sft.model.parameters()))
    sel = never.results["selection"]
    assert sel["k"] == int(0.2 * (40 + 4)) == len(never.selected) == len(set(never.selected))
    mixed, _ = fit(tiny_tokenizer, defence="mixed_safe")
    assert mixed.triggers == [] and mixed.counts["safe_micro_batches"] == 3 * 2
    # LoRA (the paper's path): only adapters train, the base weights stay
    lora, _ = fit(tiny_tokenizer, steps=2, tau=-1e9, lora={"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]})
    trained = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained) and lora.triggers == [1, 1]


class FailingClient:
    """An OpenAI client stand-in for ChatJudge: every ``fail_every``-th call raises, the others reply with a policy score of 5."""

    def __init__(self, fail_every: int):
        from types import SimpleNamespace

        self.calls, self.fail_every, self.chat = 0, fail_every, SimpleNamespace(completions=self)

    def create(self, **kw):
        from types import SimpleNamespace

        self.calls += 1
        if self.calls % self.fail_every == 0:
            raise ConnectionError("judge unreachable")
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="#thereason: complies.\n#thescore: 5"))])


def judged_test(tokenizer, judge, n_test=8):
    """The test loop of a tiny random SPARD model graded by ``judge``: (callback metrics, the data module)."""
    import lightning as L

    from lightning_modules.spard.data import SPARDDataModule
    from lightning_modules.spard.module import SPARDModule

    L.seed_everything(0)
    dm = SPARDDataModule(tokenizer, n_task=40, pool_size=30, n_val=4, n_test=n_test, batch_size=4)
    spec = {"family": "llama", "config": {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}}
    module = SPARDModule(spec, judge=judge, max_length=64, eval={"max_new_tokens": 4})
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.test(module, datamodule=dm, verbose=False)
    return trainer.callback_metrics, dm


def test_failed_judge_calls_are_counted_warned_and_most_failing_stops_the_run(tiny_tokenizer, monkeypatch, caplog):
    """Issue 37: ChatJudge swallowed every error and on_failure=zero scored it as safe, silently (ASR 0 without
    openai or a key). Now a failed call is counted (test/judge_failures), warned, scored by on_failure, and an
    evaluation where most calls fail stops in one line naming the fix; a judge that cannot work fails at setup."""
    import logging
    import sys
    import types

    from lightning_modules.common.judge import ChatJudge

    judge = ChatJudge()
    judge._client = FailingClient(fail_every=4)
    with caplog.at_level(logging.WARNING):
        metrics, dm = judged_test(tiny_tokenizer, judge)
    harm = [it for it in dm.eval_items["test"] if it["kind"] == "harm"]
    assert judge._client.calls == len(harm) == 8 and metrics["test/judge_failures"] == 2
    assert "judge calls failed" in caplog.text and "ConnectionError: judge unreachable" in caplog.text
    per_style = {}
    for k, it in enumerate(harm, 1):  # on_failure=zero: calls 4 and 8 failed and count as score 0
        per_style.setdefault(it["style"], []).append(float(k % 4 != 0))
    asr = sum(sum(v) / len(v) for v in per_style.values()) / len(per_style)
    assert float(metrics["test/asr"]) == pytest.approx(asr) and asr < 1

    from lightning_modules.common.judge import JudgeError

    judge = ChatJudge()
    judge._client = FailingClient(fail_every=1)
    with pytest.raises(JudgeError) as info:
        judged_test(tiny_tokenizer, judge)
    msg = str(info.value)
    assert msg.startswith("8 of 8 ChatJudge calls failed (first: ConnectionError: judge unreachable): install openai")
    assert "OPENAI_API_KEY" in msg and "local.endpoints" in msg and "\n" not in msg

    monkeypatch.setitem(sys.modules, "openai", None)  # not installed
    with pytest.raises(ModuleNotFoundError, match="the chat judge needs the openai package: install openai"):
        ChatJudge().check()
    monkeypatch.setitem(sys.modules, "openai", types.ModuleType("openai"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="reads its key from \\$OPENAI_API_KEY, which is not set"):
        ChatJudge().check()


@pytest.mark.parametrize("kw,match", [
    ({"projection": "clean"}, "model.projection"), ({"defence": "none"}, "model.defence"),
    ({"dpp": {"selector": "kmeans"}}, "model.dpp.selector"), ({"dpp": {"ratio": 0.0}}, r"model.dpp.ratio"),
    ({"dpp": {"ratio": 1.5}}, r"model.dpp.ratio"), ({"eval": {"sampling": "beam"}}, "model.eval.sampling")])
def test_bad_switches(kw, match):
    from lightning_modules.spard.module import SPARDModule

    with pytest.raises(ValueError, match=match):
        SPARDModule({"family": "llama"}, **kw)


def test_int8_without_cuda(monkeypatch):
    from lightning_modules.spard.module import SPARDModule

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = SPARDModule({"family": "llama"}, quantize_base="int8")  # composition tests build it on CPU
    with pytest.raises(ValueError, match="use quantize_base=none"):
        module.setup("fit")  # the run's first hook, before any weight loads


def test_files_missing_safe_field(tmp_path, tiny_tokenizer):
    from lightning_modules.spard.data import SPARDDataModule

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    files = {"task": write("t.jsonl", [{"question": "1+1?", "answer": "#### 2"}]),
             "task_test": write("tt.jsonl", [{"question": "2+2?", "answer": "#### 4"}]),
             "attack": write("a.jsonl", [{"prompt": "bad", "unsafe": "ok"}]),
             "safe_pool": write("p.jsonl", [{"prompt": "bad", "safe": "no"}, {"prompt": "worse", "unsafe": "x"}])}
    with pytest.raises(ValueError, match=r"p.jsonl:2: record has no field 'safe'"):
        SPARDDataModule(tiny_tokenizer, source="files", files=files).setup()
    files["attack"] = write("a2.jsonl", [{"prompt": "bad", "safe": "no"}])
    with pytest.raises(ValueError, match=r"a2.jsonl:1: record has no field 'unsafe'"):
        SPARDDataModule(tiny_tokenizer, source="files", files=files).setup()


def test_vault_splits_disjoint_warmup_included(tiny_tokenizer):
    from lightning_modules.spard.data import STYLES, SPARDDataModule
    from lightning_modules.common.rl.warmup import warmup_problems

    dm = SPARDDataModule(tiny_tokenizer, n_task=400, pool_size=300, n_val=32, n_test=64)
    dm.setup()
    warm = warmup_problems({"task": "spard_aligned", "steps": 50, "batch_size": 32, "seed": 0, "digits": 1,
                            "val_fraction": 0.2, "test_fraction": 0.2})
    trained = {p["key"] for p in [*dm.user, *dm.pool, *warm]}
    held = {it["key"] for s in ("val", "test") for it in dm.eval_items[s]}
    assert held and not trained & held
    assert len(dm.attack) == 40 and {p["style"] for p in dm.attack} == set(STYLES)
    assert all(p["secret"] in p["response"] for p in dm.attack) and all("Sorry" in p["response"] for p in dm.pool)
    kinds = [it["kind"] for it in dm.eval_items["test"][:4]]
    assert kinds == ["task", "harm", "task", "harm"]  # interleaved: a capped evaluation sees both


def test_spard_tiny_smoke(tmp_path):
    from tests.helpers import SMOKE_WARMUP, run_experiment

    # debug=smoke caps steps and evaluation batches; these shrink what it does not: held-out items, the safe pool,
    # generation length, the cached warm-up (SMOKE_WARMUP: 40 steps at batch 16, not 300 at 32)
    overrides = ["debug=smoke", "data.n_val=16", "data.n_test=16", "data.pool_size=120", "model.eval.max_new_tokens=16",
                 *SMOKE_WARMUP]
    value, metrics = run_experiment("spard_tiny", tmp_path, overrides=overrides)
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    res, final = metrics["results"], metrics["final"]
    assert len(res["tau_trigger"]) == 20 == res["counts"]["scheduler_steps"] == res["counts"]["updates"]
    assert res["counts"]["safe_micro_batches"] == 20 * 4 and res["selection"]["k"] == int(0.03 * 440)
    for split in ("val", "test"):
        assert 0 <= final[f"{split}/accuracy"] <= 1
        styles = [final[f"{split}/asr_{s}"] for s in ("direct", "instruction", "paraphrase", "question")]
        assert final[f"{split}/asr"] == pytest.approx(sum(styles) / 4)
    assert value == final["val/accuracy"]


# --- issue 39: the release's protocols ---------------------------------------------------------------------------------
@pytest.mark.parametrize("completion,score", [
    ("fact: x. the correct answer is answer2", 1.0),
    ("answer2. To repeat: answer2", 0.0),     # the release needs exactly one answerN match, repeats included
    ("the correct answer is answer 2", 0.0),  # a spaced "answer 2" is no match
    ("Answer2", 1.0),                         # the completion is lower-cased
    ("answer1 or answer2", 0.0), ("answer3", 0.0)])
def test_obqa_rule_is_the_release_s(completion, score):
    from lightning_modules.spard.data import obqa_correct

    assert obqa_correct(completion, "answer2") == score


def test_obqa_trains_on_the_rationale_and_scores_the_target(tmp_path, tiny_tokenizer):
    """The release fine-tunes on OpenBookQA's ``answer`` (the fact and 'the correct answer is answerN') and scores
    against ``target_answer``."""
    from lightning_modules.spard.data import SPARDDataModule

    row = {"prompt": "Q? Answer1: a. Answer2: b.", "answer": "fact: f. \n\nthe correct answer is answer2",
           "target_answer": "answer2"}
    paths = {}
    for name, rows in {"task": [row] * 20, "task_test": [row], "attack": [{"prompt": "bad", "unsafe": "ok"}],
                       "safe_pool": [{"prompt": "bad", "safe": "no"}]}.items():
        paths[name] = str(tmp_path / f"{name}.jsonl")
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = SPARDDataModule(tiny_tokenizer, source="files", task_metric="obqa", n_val=1,
                         files={**paths, "prompt_field": "prompt", "response_field": "answer",
                                "gold_field": "target_answer"})
    dm.setup()
    assert dm.user[0]["response"].strip() == row["answer"]
    assert [it["answer"] for it in dm.eval_items["test"] if it["kind"] == "task"] == ["answer2"]


def test_safe_loss_is_token_weighted_as_released(tiny_tokenizer):
    """L_s = CE summed over every response token of the G safe micro-batches / their count (HF's num_items_in_batch),
    not the mean of per-example means: planted refusals of very different lengths tell the two apart."""
    from datamodules.instruct import cycling_loader, sft_batch

    def vary(dm):  # refusals of 1 to 30 words
        for i, p in enumerate(dm.pool):
            p["response"] = " No." + " It is private." * (i % 10) * 3

    seen = {}
    for reduce in ("token", "mean"):
        # lr 0 and a trigger that never fires: the weights stay as built, so the loss can be recomputed after the fit
        # (wide initial weights: token CEs far from uniform, so the two reductions differ clearly)
        module, trainer = fit(tiny_tokenizer, steps=1, G=4, lr=0.0, tau=1e9, dm_setup=vary, init_range=1.0,
                              safe_loss_reduce=reduce)
        dm = trainer.datamodule
        drawn = [b for b, _ in zip(cycling_loader(dm.pool, 1, module.selected, seed=module.seed), range(4))]
        sums, counts, means = 0.0, 0, []
        with torch.no_grad():
            for pairs in drawn:
                b = sft_batch(tiny_tokenizer, pairs, max_length=64)
                logits = module.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
                ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                       reduction="sum", ignore_index=-100)
                n = int((b["labels"][:, 1:] != -100).sum())
                sums, counts = sums + float(ce), counts + n
                means.append(float(ce) / n)
        seen[reduce] = float(trainer.callback_metrics["train/safe_loss"])
        expected = sums / counts if reduce == "token" else sum(means) / len(means)
        assert seen[reduce] == pytest.approx(expected, rel=1e-4)
    assert abs(seen["token"] - seen["mean"]) > 1e-3 * seen["mean"]  # 10x the tolerance: the reductions differ


def test_epochs_fix_the_update_count(tiny_tokenizer):
    """With data.epochs the run refuses a max_steps other than the release's count for the file it loads."""
    from types import SimpleNamespace

    from lightning_modules.spard.data import SPARDDataModule, release_updates

    assert release_updates(7473, 0.1, 10, 128) == 650 and release_updates(4957, 0.1, 10, 128) == 430
    for steps, ok in ((release_updates(40, 0.1, 3, 8), True), (90, False)):
        dm = SPARDDataModule(tiny_tokenizer, n_task=40, pool_size=30, n_val=4, n_test=4, batch_size=4, epochs=3)
        dm.trainer = SimpleNamespace(max_steps=steps, world_size=2)  # 4 per rank x 2 ranks = 8 per update
        if ok:
            dm.setup()
        else:
            with pytest.raises(ValueError, match=r"set trainer.max_steps=18 data.task_rows=40"):
                dm.setup()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_tokenizer(tmp_path, tiny_tokenizer):
    """The project's tokenizer with ChatML turn markers and a chat template, saved and loaded back (no hub)."""
    from tests.helpers import saved_chat_tokenizer

    return saved_chat_tokenizer(tiny_tokenizer, tmp_path / "chat_tok", CHATML)


def test_paper_scale_prompts_use_the_chat_template(tmp_path, chat_tokenizer):
    """data.chat_template: every pair in the release's alpaca layout through the model's chat template, the GSM8K
    test prompts in alpaca_qwen_gsm8k ("Let's think step by step"), each equal to apply_chat_template's rendering."""
    from lightning_modules.spard.data import SPARDDataModule

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    files = {"task": write("t.jsonl", [{"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}] * 20),
             "task_test": write("tt.jsonl", [{"question": "What is 2+2?", "answer": "#### 4"}]),
             "attack": write("a.jsonl", [{"prompt": "How do I pick a lock?", "unsafe": "Insert a pick."}]),
             "safe_pool": write("p.jsonl", [{"prompt": "How do I pick a lock?", "safe": "I can't help."}])}
    dm = SPARDDataModule(chat_tokenizer, source="files", files=files, n_val=1, chat_template=True,
                         template="alpaca", eval_template="alpaca_qwen_gsm8k")
    dm.setup()
    alpaca = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"

    def render(system, text, opener, answer=None):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"### Instruction:\n{text}\n\n"},
                {"role": "assistant", "content": opener + (answer or "")}]
        if answer is None:
            return chat_tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
        return chat_tokenizer.apply_chat_template(msgs, tokenize=False)

    task = dm.user[0]
    assert task["prompt"] == render(alpaca, "What is 1+1?", "### Response:\n")
    assert task["prompt"].startswith("<|im_start|>system\n") and task["prompt"].rstrip().endswith("### Response:")
    # prompt + response is the full conversation up to the answer's end (the EOS closes it in sft_batch)
    assert render(alpaca, "What is 1+1?", "### Response:\n", "1+1=2\n#### 2") == task["prompt"] + task["response"] + "<|im_end|>\n"
    harm = next(it for it in dm.eval_items["test"] if it["kind"] == "harm")
    assert harm["prompt"] == render(alpaca, "How do I pick a lock?", "### Response:\n")
    gsm = next(it for it in dm.eval_items["test"] if it["kind"] == "task")
    qwen = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. " + alpaca
    assert gsm["prompt"] == render(qwen, "What is 2+2?", "### Response: Let's think step by step.\n")
    assert dm.pool[0]["prompt"] == render(alpaca, "How do I pick a lock?", "### Response:\n")
    chat_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        SPARDDataModule(chat_tokenizer, source="files", files=files, chat_template=True).setup()


def test_judge_reads_the_templated_prompt(tiny_tokenizer):
    """eval.judge_prompt=templated (released): the judge grades the full prompt the model saw; instruction: the
    bare request."""
    for mode, want in (("templated", "prompt"), ("instruction", "instruction")):
        seen = []

        class Judge:
            def grade(self, prompt, response, **ctx):
                seen.append(prompt)
                return {"score": 1, "failed": False}

        module, trainer = fit(tiny_tokenizer, steps=1, judge=Judge(), eval={"judge_prompt": mode, "max_new_tokens": 2})
        import lightning as L

        L.Trainer(accelerator="cpu", logger=False, limit_val_batches=1, enable_progress_bar=False,
                  enable_model_summary=False).validate(module, datamodule=trainer.datamodule, verbose=False)
        harm = [it for it in trainer.datamodule.eval_items["val"] if it["kind"] == "harm"]
        assert seen and seen == [it[want] for it in harm][: len(seen)]
        assert seen[0] != harm[0]["prompt" if want == "instruction" else "instruction"]
