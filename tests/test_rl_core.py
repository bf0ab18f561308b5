"""The shared RL core: advantages on hand-worked groups, PPO-clip/KL terms, answer extraction, padding-exact
log-probs, and the verifiable datamodule."""
import json
import math
import os

import pytest
import torch

from lightning_modules.common.rl.advantages import compute_advantages
from lightning_modules.common.rl.losses import divisors, k3_kl, policy_loss, ppo_clip_terms
from lightning_modules.common.rl.rewards import exact_match_reward, extract_answer
from lightning_modules.common.rl.rollouts import left_pad, response_logprobs, response_mask_from


def tiny_policy(seed=0, vocab=16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def test_advantages_hand_worked():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    std = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    torch.testing.assert_close(compute_advantages("grpo", r, 4)[:4], torch.tensor([1, -1, -1, 1.0]) * 0.5 / (std + 1e-4))
    torch.testing.assert_close(compute_advantages("grpo", r, 4)[4:], torch.zeros(4))  # a solved group carries no signal
    torch.testing.assert_close(compute_advantages("dr_grpo", r, 4), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # RLOO: 1 - mean(1, 0, 0) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(compute_advantages("rloo", r, 4), torch.tensor([2, -2, -2, 2, 0, 0, 0, 0]) / 3.0)
    r3 = torch.tensor([3.0, 1.0, 2.0])  # RLOO = G/(G-1) (R - mean)
    torch.testing.assert_close(compute_advantages("rloo", r3, 3), 1.5 * (r3 - 2.0))
    with pytest.raises(ValueError, match="model.advantage"):
        compute_advantages("ppo", r, 4)


def test_ppo_clip_and_k3_by_hand():
    logp_old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    loss, clipped = ppo_clip_terms(logp, logp_old, torch.tensor([1.0]), 0.2, 0.28)
    torch.testing.assert_close(loss, -torch.tensor([[1.28, 0.5, 1.1]]))  # ratio 1.5 clipped at 1+eps_high
    assert clipped.tolist() == [[True, False, False]]
    loss, clipped = ppo_clip_terms(logp, logp_old, torch.tensor([-1.0]), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[1.5, 0.8, 1.1]]))  # negative A: the low side clips at 1-eps_low
    assert clipped.tolist() == [[False, True, False]]
    torch.testing.assert_close(k3_kl(logp, logp), torch.zeros(1, 3))
    d = math.log(2.0)  # log pi_ref - log pi = log 2 -> 2 - log 2 - 1
    assert abs(float(k3_kl(torch.zeros(1), torch.tensor([d]))) - (1 - d)) < 1e-6


def test_aggregation_divisors_count_full_lengths():
    T = torch.tensor([2, 4])
    lp = torch.zeros(2, 4)
    w = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, 2.0])  # ratio 1 -> each token's term is -A
    seq, _ = policy_loss(lp, lp, adv, w, divisors("seq_mean", T, 8))
    assert abs(float(seq) - (-(2 * 1 / 2 + 4 * 2 / 4) / 2)) < 1e-6
    tok, _ = policy_loss(lp, lp, adv, w, divisors("token_mean", T, 8))
    assert abs(float(tok) - (-(2 + 8) / 6)) < 1e-6
    dr, _ = policy_loss(lp, lp, adv, w, divisors("dr_grpo", T, 8))
    assert abs(float(dr) - (-(2 + 8) / 16)) < 1e-6
    with pytest.raises(ValueError, match="model.aggregation"):
        divisors("seq_sum", T, 8)
    # the k3 KL term gets the same per-token weights as the policy term (PS-PPO spec 1.4)
    ref = torch.full((2, 4), math.log(0.5))
    w2 = torch.tensor([[2.0, 0.5, 0, 0], [1, 1, 3, 1]])
    kl = k3_kl(lp, ref)
    withkl, st = policy_loss(lp, lp, adv, w2, divisors("token_mean", T, 8), logp_ref=ref, beta=0.1)
    expect = ((w2 * (-adv.unsqueeze(1) + 0.1 * kl)).sum() / 6)
    assert abs(float(withkl) - float(expect)) < 1e-6 and float(st["kept"]) == 6


@pytest.mark.parametrize("text,expected", [
    ("12 + 30 = 42\n#### 42", "42"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("It costs $18.00 in total.", "18"),        # no ####: the last number
    ("first 3 then -7", "-7"),
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("no digits here", None),
])
def test_extract_answer_gsm8k_format(text, expected):
    assert extract_answer(text) == expected


def test_exact_match_reward():
    assert exact_match_reward("12 + 30 = 42\n#### 42", "42") == 1.0
    assert exact_match_reward("12 + 30 = 42\n#### 41", "42") == 0.0
    assert exact_match_reward("the result is 42.0", "#### 42") == 1.0
    assert exact_match_reward("", "42") == 0.0
    assert exact_match_reward("#### -7", "7") == 0.0 and exact_match_reward("#### 6.50", "6.5") == 1.0


# (completion, gold as stored, reward): issue 37's planted pairs; the exact-match path scored the first 0 and the
# second 1 (the bare gold \frac{1}{2} was reduced to its last number, 2)
MATH_PAIRS = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("so \\boxed{2}", "\\frac{1}{2}", 0.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{2}", "(1, 2)", 0.0),
    ("\\boxed{(2, 1)}", "(1, 2)", 0.0),
    ("\\boxed{1 + x^2}", "x^2+1", 1.0),
    ("\\boxed{1}", "x^2+1", 0.0),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", 1.0),
    ("\\boxed{2}", "3\\sqrt{2}", 0.0),
    ("12 + 30 = 42\n#### 42", "42", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "half of it, so \\boxed{0.5}", 1.0),  # a gold solution: its boxed answer
]


@pytest.mark.parametrize("completion,gold,want", MATH_PAIRS)
def test_math_equivalence_reward_on_planted_pairs(completion, gold, want):
    from lightning_modules.common.rl.rewards import math_equivalence_reward

    assert math_equivalence_reward(completion, gold) == want


def test_latex_gold_read_as_stored_and_scored_by_rlkvs_reward(tmp_path):
    """DeepScaleR / MATH-500 store a bare LaTeX ``answer``: the data keeps it as stored and the paper-scale rlkv
    reward (model.reward.compare=math) scores a boxed equivalent 1 and the number the old path read (its last
    number) 0; the integer tiny tasks keep exact match."""
    from hydra.utils import instantiate

    from datamodules.verifiable import load_problems
    from tests.helpers import compose

    golds = ["\\frac{1}{2}", "3\\sqrt{2}", "(1, 2)", "x^2+1", "\\text{(C)}"]
    f = tmp_path / "deepscaler.jsonl"
    f.write_text("".join(json.dumps({"problem": f"p{i}", "answer": g, "solution": "long text 7"}) + "\n"
                         for i, g in enumerate(golds)))
    problems = load_problems("math", str(f), "problem", "answer")
    assert [p["answer"] for p in problems] == golds
    for exp in ("rlkv_r1_llama8b", "hista_qwen25_3b", "sveb_qwen25_3b"):
        reward = instantiate(compose(exp).model.reward)
        answers = [p["answer"] for p in problems]
        right = ["\\boxed{0.5}", "\\boxed{\\sqrt{18}}", "\\boxed{(1,2)}", "\\boxed{1+x^2}", "\\boxed{\\text{(C)}}"]
        wrong = ["\\boxed{2}", "\\boxed{2}", "\\boxed{2}", "\\boxed{1}", "\\boxed{\\text{(D)}}"]
        assert reward([""] * 5, right, answers).tolist() == [1.0] * 5, exp
        assert reward([""] * 5, wrong, answers).tolist() == [0.0] * 5, exp
    tiny = instantiate(compose("rlkv_tiny").model.reward)
    assert tiny.compare == "exact" and tiny([""] * 2, ["#### 7", "#### 8"], ["7", "7"]).tolist() == [1.0, 0.0]
    with pytest.raises(Exception, match="model.reward.compare='sympy': choose exact"):  # hydra wraps the ValueError
        instantiate(compose("rlkv_tiny", ["model.reward.compare=sympy"]).model.reward)


def test_math_as_released_and_metamathqa_are_read_in_their_own_layouts(tmp_path):
    """Issue 37: MATH as released is a folder tree of one-problem .json files ({problem, level, type, solution}, the
    answer in the solution's last boxed), which the loader refused; MetaMathQA's query / response states its answer
    after 'The answer is:', which extraction read as the last number."""
    from datamodules.verifiable import load_problems

    math_dir = tmp_path / "MATH" / "train"
    records = {"algebra/1.json": ("What is half of one?", "Half of one is $\\boxed{\\frac{1}{2}}$."),
               "algebra/20.json": ("Solve for x.", "So $x = \\boxed{(1, 2)}$, not $3$."),
               "geometry/3.json": ("Side of a square of area 18?", "It is $\\boxed{3\\sqrt{2}}$.")}
    for name, (problem, solution) in records.items():
        (math_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (math_dir / name).write_text(json.dumps({"problem": problem, "level": "Level 2", "type": name.split("/")[0],
                                                 "solution": solution}, indent=4))
    (math_dir / ".DS_Store").write_text("not data")
    got = {p["question"]: p["answer"] for p in load_problems("math", str(math_dir))}
    assert got == {"What is half of one?": "\\frac{1}{2}", "Solve for x.": "(1, 2)",
                   "Side of a square of area 18?": "3\\sqrt{2}"}
    meta = tmp_path / "MetaMathQA-395K.json"  # released as one JSON array
    meta.write_text(json.dumps([
        {"query": "What is 3 times 6?", "response": "3 times 6 is 18.\nThe answer is: 18", "type": "GSM_Rephrased",
         "original_question": "?"},
        {"query": "Simplify 2/4.", "response": "Divide by 2: $\\frac{1}{2}$ of 1 and 7 more.\nThe answer is: \\frac{1}{2}",
         "type": "MATH_AnsAug", "original_question": "?"}]))
    got = load_problems("gsm8k", str(meta), "query", "response")
    assert [p["answer"] for p in got] == ["18", "\\frac{1}{2}"]
    assert extract_answer("7 more.\nThe answer is: 1,000") == "1000"
    assert exact_match_reward("So it is 18.\nThe answer is: 18", "18") == 1.0


def test_response_mask_stops_after_first_eos():
    resp = torch.tensor([[5, 6, 0, 7, 0], [5, 5, 5, 5, 5], [0, 3, 3, 3, 3]])
    assert response_mask_from(resp, 0).tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]


def test_left_padding_and_truncation_give_exact_logprobs():
    """Left-padded batched log-probs equal each row alone, and a truncated forward equals the full one for t <= C."""
    model = tiny_policy()
    g = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]
    ids, mask = left_pad(prompts, pad_id=1)
    T = 9
    resp = torch.randint(2, 16, (3, T), generator=g)
    full_ids, full_mask = torch.cat([ids, resp], 1), torch.cat([mask, torch.ones(3, T, dtype=torch.long)], 1)
    P = ids.shape[1]
    with torch.no_grad():
        full = response_logprobs(model, full_ids, full_mask, P, T)
        for i, p in enumerate(prompts):
            alone_ids = torch.cat([torch.tensor([p]), resp[i:i + 1]], 1)
            alone = response_logprobs(model, alone_ids, torch.ones_like(alone_ids), len(p), T)
            torch.testing.assert_close(full[i:i + 1], alone, atol=1e-5, rtol=0)
        for C in (1, 4, 8):
            torch.testing.assert_close(response_logprobs(model, full_ids, full_mask, P, C), full[:, :C], atol=1e-6, rtol=0)


def test_buffers_stay_float32_under_lightnings_bf16_true():
    """Lightning's bf16-true sets the default dtype to bf16 around each step (ENVIRONMENT.md). The core's buffers
    made inside a step keep float32 there (issue 37: batched_logprobs' bare torch.zeros made the first rlkv update
    raise 'Index put requires the source and destination dtypes match'), and their values equal fp32's."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    from lightning_modules.common.kv_press import Random
    from lightning_modules.common.rl.advantages import scale_rewards, segment_gae
    from lightning_modules.common.rl.rollouts import Rollouts, batched_logprobs
    from lightning_modules.common.rl.scorers import ExactMatch
    from lightning_modules.hista.hista import HistaConfig, hista_values

    model = tiny_policy().to(torch.bfloat16)
    ids, mask = left_pad([[3, 4, 5], [6, 7]], pad_id=1)
    resp = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 1]])
    rmask = response_mask_from(resp, 0)
    ro = Rollouts(torch.cat([ids, resp], 1), torch.cat([mask, rmask.long()], 1), ids.shape[1], rmask, 1)
    with torch.no_grad():
        want = response_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, 4)
    keys = torch.zeros(1, 2, 64, 4, dtype=torch.bfloat16)
    with HalfPrecision("bf16-true").forward_context():
        assert torch.get_default_dtype() == torch.bfloat16
        logp, hidden = batched_logprobs(model, ro, ro.lengths, micro_batch_size=1, return_hidden=True)
        rewards = ExactMatch()(["", ""], ["#### 2", "#### 3"], ["2", "2"])
        adv = scale_rewards(torch.tensor([0.5, -0.5], dtype=torch.float32), rewards, group_size=1)
        gae = segment_gae([0.25, 1.0], [0, 3], T=4)
        chains = hista_values([torch.randn(5, 3, dtype=torch.float32)] * 2, [[0, 4]] * 2, rewards,
                              HistaConfig(mean_window=1, min_interval=4))
        scores = Random().score(None, None, keys, keys, {})
    assert logp.dtype == rewards.dtype == adv.dtype == gae.dtype == chains[0].dtype == scores.dtype == torch.float32
    assert hidden.dtype == torch.bfloat16  # states keep the model's dtype
    torch.testing.assert_close(logp, want * rmask, atol=0, rtol=0)
    assert rewards.tolist() == [1.0, 0.0] and gae.tolist() == [0.75, 0.75, 0.75, 0.0]
    assert len(torch.unique(scores)) > 100  # float32 uniforms, not bf16's few hundred values with ties


@pytest.mark.slow
def test_rlkv_and_sveb_run_under_bf16_true(tmp_path, tiny_lm_dir):
    """The paper configs' precision end to end on the tiny model: two rlkv updates and SVEB's test batches under
    trainer.precision=bf16-true (issue 37: the first update and the first SVEB test batch raised)."""
    from tests.helpers import SMOKE_WARMUP, run_experiment

    _, metrics = run_experiment("rlkv_tiny", tmp_path / "rlkv", overrides=(
        "debug=smoke", "trainer.max_steps=2", "trainer.limit_val_batches=1", "data.n_val=4", "model.self_filter=4",
        "trainer.precision=bf16-true", *SMOKE_WARMUP))
    assert metrics["status"] == "ok" and metrics["global_step"] == 2 and math.isfinite(metrics["final"]["train/loss"])
    _, metrics = run_experiment("sveb_tiny", tmp_path / "sveb", overrides=(
        "debug=smoke", "data.n_test=2", "model.group_size=4", "model.mcs_num=2", "model.critic_problems=2",
        "trainer.precision=bf16-true"))
    assert metrics["status"] == "ok" and len(metrics["results"]["sveb"]["cases"]) == 2


def test_verifiable_problems_are_correct_and_files_load(tmp_path, tiny_tokenizer):
    from datamodules.verifiable import VerifiableDataModule, generate_problems, load_problems

    for p in generate_problems("arithmetic", 50, seed=3, digits=3, operations=("+", "-", "*")):
        expr = p["question"].removeprefix("What is ").rstrip("?")
        assert str(eval(expr)) == p["answer"] == extract_answer(p["solution"])  # noqa: S307 - our own digits
    for p in generate_problems("word_problems", 20, seed=1):
        assert extract_answer(p["solution"]) == p["answer"] and int(p["answer"]) >= 0
    assert generate_problems("arithmetic", 5, seed=7) == generate_problems("arithmetic", 5, seed=7)
    f = tmp_path / "gsm8k.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"step\n#### {i * 3}"}) for i in range(4)) + "\n")
    assert [p["answer"] for p in load_problems("gsm8k", str(f))] == ["0", "3", "6", "9"]
    m = tmp_path / "math.jsonl"
    m.write_text(json.dumps({"problem": "p", "solution": "so \\boxed{12}"}) + "\n")
    assert load_problems("math", str(m))[0]["answer"] == "12"
    dm = VerifiableDataModule(tiny_tokenizer, task="gsm8k", files=str(f), val_files=str(f), test_files=str(f), n_val=2)
    dm.setup()
    assert len(dm.train_set) == 4 and len(dm.val_set) == 2 and len(dm.test_set) == 4
    assert dm.train_set[1]["prompt"].startswith("Question: q1") and dm.train_set[1]["prompt_ids"]
    with pytest.raises(ValueError, match="data.files"):
        VerifiableDataModule(tiny_tokenizer, task="gsm8k").setup()
    with pytest.raises(ValueError, match="data.task"):
        VerifiableDataModule(tiny_tokenizer, task="mmlu")


def _tiny_reward_model(path, tok, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels)
    model = LlamaForSequenceClassification(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


def test_reward_model_scores_each_text_by_its_last_token(tmp_path, tiny_tokenizer):
    """Batched, right-padded scoring equals the head on the last hidden state of each text fed alone."""
    from types import SimpleNamespace

    from lightning_modules.common.rl.module import RLModule
    from lightning_modules.common.rl.scorers import RewardModel

    model = _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)
    prompts = ["Question: 1 + 2\nAnswer:", "Question: tell a story\nAnswer:", "Hi", "Question: 7 - 3\nAnswer:"]
    completions = [" 3", " Once upon a time there was a long story", " hello there friend", " 4\n#### 4"]
    rm = RewardModel(str(tmp_path / "rm"), batch_size=3, dtype="float32", chat_template=False)
    got = rm(prompts, completions, ["3", "", "", "4"])
    with torch.no_grad():
        ref = torch.stack([model.score(model.model(tiny_tokenizer(p + c, return_tensors="pt").input_ids)
                                       .last_hidden_state[0, -1])[0] for p, c in zip(prompts, completions)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert got.std() > 0  # the texts are told apart

    tiny_tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "chat").mkdir()
    _tiny_reward_model(tmp_path / "chat", tiny_tokenizer)
    chat = RewardModel(str(tmp_path / "chat"), dtype="float32")
    chat.load("cpu")
    assert chat.texts(["q"], ["a"]) == (["<user>q<assistant>a"], True)

    _tiny_reward_model(tmp_path / "two", tiny_tokenizer, num_labels=2)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModel(str(tmp_path / "two"))(["q"], ["a"])
    with pytest.raises(FileNotFoundError, match="model.reward.path"):
        RewardModel(str(tmp_path / "missing"))(["q"], ["a"])
    module = RLModule(dict(family="llama", pretrained=None), reward=RewardModel(str(tmp_path / "missing")))
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(config=None))
    with pytest.raises(FileNotFoundError, match="model.reward.path"):  # at setup, before the policy is built
        module.setup("fit")


def test_rl_module_scores_each_sample_with_its_own_prompt(tmp_path, tiny_tokenizer):
    """The reward chosen by _target_ reaches the rollouts: the G samples of prompt i are scored against prompt i."""
    from types import SimpleNamespace

    from lightning_modules.common.rl.module import RLModule
    from lightning_modules.common.rl.scorers import ExactMatch, RewardModel

    _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)
    rm = RewardModel(str(tmp_path / "rm"), dtype="float32", chat_template=False)
    module = RLModule(dict(family="llama", pretrained=None), group_size=2, reward=rm)
    batch = {"prompt": ["A:", "B:"], "answer": ["", ""]}
    ro = SimpleNamespace(group_size=2, completions=[" x", " y", " x", " y"], input_ids=torch.zeros(4, 1, dtype=torch.long))
    got = module.score(ro, batch)
    torch.testing.assert_close(got, rm(["A:", "A:", "B:", "B:"], ro.completions))
    assert got[0] != got[2]  # same completion, other prompt
    assert RLModule(dict(family="llama", pretrained=None)).reward == ExactMatch()
    exact = RLModule(dict(family="llama", pretrained=None), group_size=2)
    batch = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}
    ro.completions = ["#### 2", "#### 3", "#### 2", "#### 4"]
    assert exact.score(ro, batch).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_prompt_datamodule_reads_prompts_without_answers(tmp_path, tiny_tokenizer):
    from datamodules.prompts import PromptDataModule

    f, t = tmp_path / "prompts.jsonl", tmp_path / "test.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"p{i}", "chosen": "x"}) for i in range(40)) + "\n")
    t.write_text(json.dumps({"prompt": "held out"}) + "\n" + json.dumps({"prompt": " "}) + "\n")
    dm = PromptDataModule(tiny_tokenizer, files=str(f), test_files=str(t), val_fraction=0.25, n_val=None)
    dm.setup()
    train, val = ({it["prompt"] for it in d} for d in (dm.train_set, dm.val_set))
    assert train | val == {f"Question: p{i}\nAnswer:" for i in range(40)} and not train & val and val
    assert [it["prompt"] for it in dm.test_set] == ["Question: held out\nAnswer:"]  # blank prompts dropped
    assert all(it["answer"] == "" and it["prompt_ids"] for it in dm.train_set)
    with pytest.raises(ValueError, match="data.files"):
        PromptDataModule(tiny_tokenizer)


def _score_under_zero3(rank: int, port: int, path: str, out):
    """One ZeRO-3 rank as a run holds it: a process group and transformers' HfDeepSpeedConfig alive."""
    import deepspeed
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from lightning_modules.common.rl.scorers import RewardModel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed("gloo")
    alive = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        rm = RewardModel(path, dtype="float32", chat_template=False)
        out["score"] = rm(["Question: 1 + 2\nAnswer:"], [" 3"]).tolist()
        out["shape"] = tuple(rm._model.model.embed_tokens.weight.shape)
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        out["still_zero3"] = is_deepspeed_zero3_enabled()  # the run's own config is back after the load
    finally:
        del alive
        torch.distributed.destroy_process_group()


def test_reward_model_loads_whole_under_zero3(tmp_path, tiny_tokenizer):
    """ps_ppo_rlhf's reward model is loaded mid-run, while a ZeRO-3 run keeps transformers' DeepSpeed config alive:
    loaded through ZeRO-3's path, its weights were partitioned with no engine to gather them and the first
    reward raised ``'weight' must be 2-D``. It must load whole and score as it does alone."""
    import torch.multiprocessing as mp

    from lightning_modules.common.rl.scorers import RewardModel
    from tests.test_rl_ranks import _free_port

    model = _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)
    alone = RewardModel(str(tmp_path / "rm"), dtype="float32", chat_template=False)(["Question: 1 + 2\nAnswer:"], [" 3"])
    out = mp.Manager().dict()
    mp.spawn(_score_under_zero3, args=(_free_port(), str(tmp_path / "rm"), out), nprocs=1, join=True)
    assert out["shape"] == tuple(model.model.embed_tokens.weight.shape) and out["still_zero3"]
    torch.testing.assert_close(torch.tensor(out["score"]), alone)
