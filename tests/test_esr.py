"""ESR (issue 21): steering hooks, the SAE and its release loaders, bisection, attempt judging, metrics, detectors,
SFT masking, bad input, and the tiny experiment end to end."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lightning_modules.common.activations import intervene
from lightning_modules.common.judge import AttemptRuleJudge, EndpointJudge, HFLocalJudge, parse_attempts, split_attempts
from lightning_modules.esr import steer as S
from lightning_modules.esr.metrics import derangement, esr_metrics, find_detectors
from lightning_modules.esr.sae import SAE, load_gemmascope, load_goodfire, load_sae, load_saelens, save_saelens
from lightning_modules.esr.threshold import bisect
from tests.helpers import SMOKE_WARMUP, compose, run_experiment


def tiny_llama(layers=3, d=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=d, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def random_sae(d_in=32, d_sae=48, seed=0, activation="relu"):
    g = torch.Generator().manual_seed(seed)
    sae = SAE(d_in, d_sae, activation, apply_b_dec_to_input=True)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            getattr(sae, name).copy_(torch.randn(getattr(sae, name).shape, generator=g) * 0.5)
        sae.threshold.copy_(torch.rand(d_sae, generator=g) * 0.3)
    return sae


# --- steering -----------------------------------------------------------------------------------------------------
def _next_block_input(model, layer, run):
    """What block ``layer + 1`` receives (block ``layer``'s output after every hook) while ``run()`` runs."""
    seen = []
    h = model.model.layers[layer + 1].register_forward_pre_hook(lambda m, a, k: seen.append((a[0] if a else k["hidden_states"]).clone()),
                                                                with_kwargs=True)
    try:
        run()
    finally:
        h.remove()
    return seen


def test_boost_adds_value_times_unit_direction_everywhere_cached_too():
    model, sae, layer = tiny_llama(), random_sae(), 1
    ids = torch.randint(0, 64, (2, 7))
    d = S.directions(sae, [3, 5], normalize=True)
    values = torch.tensor([1.5, -0.7])
    assert torch.allclose(d.norm(dim=-1), torch.ones(2))
    with torch.no_grad():
        (base,) = _next_block_input(model, layer, lambda: model(ids))
        with intervene(model, layer, S.boost(d, values)):
            (full,) = _next_block_input(model, layer, lambda: model(ids))
            past = model(ids[:, :6], use_cache=True).past_key_values
            (step,) = _next_block_input(model, layer, lambda: model(ids[:, 6:], past_key_values=past, use_cache=True))
    want = (values[:, None] * d)[:, None, :].expand_as(base)
    assert torch.allclose(full - base, want, atol=1e-5)          # every position, each row its own latent
    assert torch.allclose(step[:, 0], full[:, 6], atol=1e-5)       # cached decoding gets the same boost


def test_boost_zero_leaves_logits_bit_identical():
    model, sae = tiny_llama(), random_sae()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = model(ids).logits
        with intervene(model, 2, S.boost(S.directions(sae, [1, 2]), torch.zeros(2))):
            out = model(ids).logits
    assert torch.equal(ref, out)


def test_clamp_keeps_sae_error_and_is_noop_where_latent_is_off():
    sae = random_sae(activation="jumprelu")
    h = torch.randn(2, 40, 32)
    f = sae.encode(h)
    i = int(((f > 0).float().mean((0, 1)) - 0.5).abs().argmin())   # a latent on at some positions, off at others
    out = S.clamp_zero(sae, [i])(h, torch.arange(40))
    f0 = f.clone()
    f0[..., i] = 0
    assert torch.allclose(out, sae.decode(f0) + (h - sae.decode(f)), atol=1e-5)   # reconstruction w/o i + error
    off = f[..., i] == 0
    assert off.any() and (~off).any()
    assert torch.equal(out[off], h[off])


# --- SAE and release loaders --------------------------------------------------------------------------------------
def _reference(W_enc, b_enc, W_dec, b_dec, x, threshold=None, centre=False):
    z = (x - b_dec if centre else x) @ W_enc + b_enc
    f = np.where(z > threshold, z, 0) if threshold is not None else np.maximum(z, 0)
    return f, f @ W_dec + b_dec


def test_loaders_read_release_layouts(tmp_path):
    rng = np.random.default_rng(0)
    d_in, d_sae = 16, 40
    W_enc, W_dec = rng.normal(size=(d_in, d_sae)).astype(np.float32), rng.normal(size=(d_sae, d_in)).astype(np.float32)
    b_enc, b_dec = rng.normal(size=d_sae).astype(np.float32), rng.normal(size=d_in).astype(np.float32)
    thr = rng.uniform(0, 1, d_sae).astype(np.float32)
    x = rng.normal(size=(5, d_in)).astype(np.float32)

    # GemmaScope: params.npz, JumpReLU, input not centred
    (tmp_path / "gs").mkdir()
    np.savez(tmp_path / "gs" / "params.npz", W_enc=W_enc, W_dec=W_dec, b_enc=b_enc, b_dec=b_dec, threshold=thr)
    sae = load_gemmascope(tmp_path / "gs")
    f, xh = _reference(W_enc, b_enc, W_dec, b_dec, x, threshold=thr)
    assert np.allclose(sae.encode(torch.from_numpy(x)).numpy(), f, atol=1e-4)
    assert np.allclose(sae(torch.from_numpy(x)).numpy(), xh, atol=1e-3)

    # SAELens: cfg.json + sae_weights.safetensors, standard (ReLU, b_dec subtracted)
    from safetensors.numpy import save_file

    (tmp_path / "sl").mkdir()
    save_file({"W_enc": W_enc, "W_dec": W_dec, "b_enc": b_enc, "b_dec": b_dec}, str(tmp_path / "sl" / "sae_weights.safetensors"))
    (tmp_path / "sl" / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": d_sae, "architecture": "standard",
                                                          "apply_b_dec_to_input": True, "hook_name": "blocks.2.hook_resid_post"}))
    sae = load_sae("saelens", tmp_path / "sl")
    f, xh = _reference(W_enc, b_enc, W_dec, b_dec, x, centre=True)
    assert np.allclose(sae.encode(torch.from_numpy(x)).numpy(), f, atol=1e-4)
    assert np.allclose(sae(torch.from_numpy(x)).numpy(), xh, atol=1e-3)
    back = load_saelens(save_saelens(sae, tmp_path / "again"))    # our writer round-trips through the reader
    assert torch.equal(back.W_dec, sae.W_dec) and back.apply_b_dec_to_input

    # Goodfire: a torch state dict of nn.Linear encoder / decoder
    torch.save({"encoder_linear.weight": torch.from_numpy(W_enc.T.copy()), "encoder_linear.bias": torch.from_numpy(b_enc),
                "decoder_linear.weight": torch.from_numpy(W_dec.T.copy()), "decoder_linear.bias": torch.from_numpy(b_dec)},
               tmp_path / "gf.pth")
    sae = load_goodfire(tmp_path / "gf.pth")
    f, xh = _reference(W_enc, b_enc, W_dec, b_dec, x)
    assert np.allclose(sae(torch.from_numpy(x)).numpy(), xh, atol=1e-3)

    # a shape mismatch is one line naming the file
    np.savez(tmp_path / "bad.npz", W_enc=W_enc, W_dec=W_dec[:, :5], b_enc=b_enc, b_dec=b_dec, threshold=thr)
    with pytest.raises(ValueError, match="bad.npz: W_dec"):
        load_gemmascope(tmp_path / "bad.npz")


# --- threshold ----------------------------------------------------------------------------------------------------
def test_bisection_finds_a_noisy_monotone_root():
    hits = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        root = rng.uniform(0.6, 1.6)
        logit = math.log(0.3 / 0.7)

        def score(x):  # first-attempt score falls with the boost; 0.3 exactly at the root
            s = 1 / (1 + np.exp(-(logit - 4.0 * (x - root))))
            return np.clip(s + rng.normal(0, 0.1, size=x.shape), 0, 1)

        est = bisect(score, n=1, trials=20, target=0.3)
        hits += abs(est[0] - root) <= 0.25
    assert hits >= 90, hits


# --- judge and metrics --------------------------------------------------------------------------------------------
def test_rule_judge_splits_only_at_restart_phrases():
    judge = AttemptRuleJudge()
    kw = ["flour", "yeast", "dough", "oven"]
    g = judge.grade("Explain how to bake bread.", "Penguins live on ice. Wait, that's not right. Mix flour and yeast "
                    "into a dough, then use the oven.", keywords=kw)
    assert [a["score"] for a in g["attempts"]] == [0.0, 100.0] and g["score"] == 0.0
    g = judge.grade("q", "Wait for the dough to rise, then warm the oven. Try again tomorrow.", keywords=kw)
    assert len(g["attempts"]) == 1 and g["attempts"][0]["score"] == 50.0   # "wait"/"again" alone are not restarts
    g = judge.grade("q", "Let me try again. Flour and yeast.", keywords=kw)
    assert len(g["attempts"]) == 1                                 # no empty attempt before a leading restart
    assert judge.grade("q", "   ", keywords=kw)["failed"]
    assert split_attempts("A. Let me try again. B. Sorry, I got distracted. C.") == ["A.", "Let me try again. B.",
                                                                                     "Sorry, I got distracted. C."]


def test_attempt_parser_rejects_empty_attempts():
    ok = parse_attempts('```json\n{"attempts": [{"attempt_text": "a", "score": 20}, {"attempt_text": "b", "score": 80}]}\n```')
    assert not ok["failed"] and [a["score"] for a in ok["attempts"]] == [20, 80]
    assert parse_attempts('{"attempts": [{"attempt_text": " ", "score": 20}]}')["failed"]
    assert parse_attempts('{"attempts": []}')["failed"]
    assert parse_attempts('{"attempts": [{"attempt_text": "a", "score": 120}]}')["failed"]
    assert parse_attempts("no json here")["failed"]


def test_metrics_match_hand_counts():
    attempts = [[10], [10, 50], [60, 20], [30, 30, 90], [5], [40, 40]]
    m = esr_metrics(attempts)
    assert m["n"] == 6 and m["multi_attempt"] == 4 / 6 and m["esr"] == 2 / 6
    assert m["improvement"] == 0.5
    assert m["mean_delta"] == pytest.approx((40 - 40 + 60 + 0) / 4)
    assert m["esr_se"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 6))
    assert m["multi_attempt_se"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 6))


def test_endpoint_and_local_judges_use_the_attempt_rubric(monkeypatch):
    judge = EndpointJudge(endpoint={"url": "http://localhost:1/v1", "model": "judge"})
    seen = []
    monkeypatch.setattr(judge.client(), "chat", lambda text, **kw: seen.append(text) or
                        '{"attempts": [{"attempt_text": "x", "score": 10}, {"attempt_text": "y", "score": 70}]}')
    g = judge.grade("Explain how to tie a shoe.", "reply text", label="volcanoes")
    assert g["score"] == 10 and len(g["attempts"]) == 2
    system, user = seen[0]
    assert system["role"] == "system" and "unrelated feature" in system["content"]
    assert "Explain how to tie a shoe." in user["content"] and "starts over" in user["content"]
    assert user["content"].endswith("Unrelated feature: volcanoes")
    local = HFLocalJudge(path="/nowhere", rubric="harm")
    monkeypatch.setattr(local, "reply", lambda text: "#thereason: partly.\n#thescore: 4")
    assert local.grade("p", "r")["score"] == 4                     # spard's 1-5 rubric through the same backend
    with pytest.raises(ValueError, match="no url"):
        EndpointJudge(endpoint={"model": "judge"}).check()


# --- detectors ----------------------------------------------------------------------------------------------------
def test_derangement_has_no_fixed_point():
    for n in (2, 3, 7, 38):
        for seed in range(20):
            p = derangement(n, seed)
            assert sorted(p) == list(range(n)) and all(p[i] != i for i in range(n))
    with pytest.raises(ValueError):
        derangement(1)


def test_planted_detectors_are_found_random_latents_not():
    g = torch.Generator().manual_seed(0)
    n, d = 60, 200
    on = torch.relu(torch.randn(n, d, generator=g) - 1.0)          # random latents fire now and then on either side
    off = torch.relu(torch.randn(n, d, generator=g) - 1.0)
    planted = [7, 42, 150]
    on[:, planted] = 0
    off[:, planted] = (torch.rand(n, len(planted), generator=g) < 0.9).float() * 2
    found = find_detectors(on, off, 0.8).tolist()
    assert found == planted


# --- SFT data -----------------------------------------------------------------------------------------------------
def test_sft_labels_mask_prompt_and_off_topic_span():
    from datamodules.common.tokenizer import corpus_tokenizer
    from lightning_modules.esr.data import masked_batch, self_corrections

    tok = corpus_tokenizer(512, "embedded")
    exs = self_corrections(10, 0.5, seed=3)
    assert sum(bool(e["distractor"]) for e in exs) == 5
    for e in exs:
        if e["distractor"]:
            assert 2 <= e["distractor"].count(".") <= 4 and split_attempts(e["distractor"] + e["response"])[1:]
    from lightning_modules.esr.data import SUBJECTS, load_prompts

    shipped = load_prompts("shipped")
    assert len(SUBJECTS) == 50 and len(shipped) == 38 and all(p["prompt"].startswith("Explain how") for p in shipped)
    b = masked_batch(tok, exs)
    for row, (e, ids, lab) in enumerate(zip(exs, b["input_ids"], b["labels"])):
        head = len(tok(e["prompt"] + e["distractor"], add_special_tokens=False)["input_ids"])
        tail = len(tok(e["response"], add_special_tokens=False)["input_ids"]) + 1
        assert (lab[:head] == -100).all()
        assert torch.equal(lab[head:head + tail], ids[head:head + tail])
        assert (lab[head + tail:] == -100).all()


# --- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, match", [
    ("model.steer.layer=9", "steer.layer=9 is beyond"),
    ("model.threshold.lo=5", "threshold.lo=5"),
    ("model.steer.mode=multiply", "steer.mode='multiply'"),
    ("model.sae.format=gemmascope", "needs model.sae.path"),
])
def test_bad_config_fails_in_one_line(override, match):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = compose("esr_tiny", [override])
    with pytest.raises((ValueError, InstantiationException), match=match):
        instantiate(cfg.model, _convert_="all")


def test_sae_input_size_must_match_hidden_size():
    with pytest.raises(ValueError, match="d_in=16 differs from the model's hidden_size=128"):
        random_sae(16, 8).check_input(128)


# --- end to end ---------------------------------------------------------------------------------------------------
def test_esr_tiny_runs(tmp_path):
    # debug=smoke caps the fit at 20 steps; the study's own sizes shrink here: 4 latents, 3 bisection trials,
    # 2 responses each, 24 new tokens, 1 random ablation set; and the cached pieces esr_tiny builds first: a
    # 40-step warm-up at batch 16 (SMOKE_WARMUP, not 300 at 32) and a 512-latent SAE on 256 texts (not 1024 on 1024)
    over = ["debug=smoke", "model.steer.n_latents=4", "model.threshold.trials=3", "model.gen.trials=2",
            "model.gen.max_new_tokens=24", "model.otd.random_sets=1", *SMOKE_WARMUP, "model.sae.d_sae=512",
            "model.sae.n_texts=256"]
    value, metrics = run_experiment("esr_tiny", tmp_path, over)
    final = metrics["final"] if "final" in metrics else metrics
    flat = json.dumps(metrics)
    for key in ("test/steered/multi_attempt", "test/unsteered/esr", "test/sae/variance_explained", "test/otd/count"):
        assert key in flat
    assert value is not None and 0 <= value <= 1
    sae = {k: final[f"test/sae/{k}"] for k in ("variance_explained", "l0", "dead_fraction")}
    assert sae["variance_explained"] >= 0.9 and sae["l0"] <= 32 and sae["dead_fraction"] < 0.1, sae


def test_train_sae_works_inside_inference_mode():
    """A test-only run (task=test) trains its uncached SAE inside Lightning's inference mode: training must switch
    grad back on itself, and learn (reconstruction error well below the inputs' variance)."""
    from lightning_modules.esr.sae import train_sae

    g = torch.Generator().manual_seed(0)
    basis = torch.randn(8, 16, generator=g)
    with torch.inference_mode():
        acts = (torch.rand(512, 8, generator=g) * (torch.rand(512, 8, generator=g) < 0.2)) @ basis
        sae = train_sae(acts, 32, l1=1e-3, steps=300, batch_size=64, lr=3e-3)
    with torch.no_grad():
        x = acts.clone()
        err = ((sae.decode(sae.encode(x)) - x) ** 2).sum(-1).mean() / ((x - x.mean(0)) ** 2).sum(-1).mean()
    assert err < 0.3, float(err)


def _release_bisection(score, lo, hi, grid, mu, sd, trials, target, update_weight=5):
    """The release's probabilistic bisection (threshold_finder.py), rewritten here as a scalar reference: log-space
    density, y = sign(score - target) flipped when its confidence is below 0.5, the queried point weighted by the
    geometric mean of p and 1 - p."""
    from scipy.stats import beta, norm

    x = np.linspace(lo, hi, grid)
    logd = np.log(norm.pdf(x, mu, sd))
    logd = np.log(np.exp(logd - logd.max()) / np.exp(logd - logd.max()).sum())

    def median():
        d = np.exp(logd - logd.max())
        return x[np.searchsorted(np.cumsum(d / d.sum()), 0.5)]

    for _ in range(trials):
        m = median()
        s = float(score(np.array([m]))[0])
        y = 1 if s >= target else -1
        below = beta.cdf(target, 0.5 + update_weight * s, 0.5 + update_weight * (1 - s))
        p = 1 - below if y == 1 else below
        if p < 0.5:
            y, p = -y, 1 - p
        i = np.searchsorted(x, m)
        ll = np.empty_like(logd)
        ll[:i], ll[i], ll[i + 1:] = (np.log(1 - p), (np.log(p) + np.log(1 - p)) / 2, np.log(p))[::y]
        logd = logd + ll
        logd = logd - logd.max()
    return median()


def test_bisection_is_the_release_s_trial_for_trial():
    """query_weight=geometric (default): the queried grid point weighted by sqrt(p(1-p)), as released; the estimate
    equals the release's algorithm's on every case (a coarse grid makes the queried point's weight matter)."""
    diffs = {"geometric": 0, "below": 0}
    for seed in range(40):
        root = np.random.default_rng(seed).uniform(1.0, 4.0)

        def score(b):  # deterministic in the boost, so both runs see the same score wherever they agree
            return np.clip(1 / (1 + np.exp(2.5 * (b - root))) + 0.15 * np.sin(37 * b + seed), 0, 1)

        ref = _release_bisection(score, 0.0, 5.0, 41, 1.0, 0.34 * 5, 12, 0.3)
        for mode in diffs:
            est = bisect(score, n=1, lo=0.0, hi=5.0, grid=41, prior_mu=1.0, prior_sd=1.7, trials=12, target=0.3,
                         **({} if mode == "geometric" else {"query_weight": mode}))
            diffs[mode] += not np.isclose(est[0], ref)
    assert diffs["geometric"] == 0 and diffs["below"] > 0, diffs


@pytest.mark.parametrize("experiment", ["esr_llama31_8b", "esr_gemma2_2b"])
def test_each_model_searches_its_release_range(experiment):
    """The release's per-model search range and prior (the [0, 5] defaults are overridden by every released model
    config): with the experiment's own threshold settings a planted threshold of 40 is found within 5%."""
    t = compose(experiment).model.threshold
    logit = math.log(0.3 / 0.7)
    hits = 0
    for seed in range(50):
        rng = np.random.default_rng(seed)

        def score(x):  # mean of `samples` noisy first-attempt scores, 0.3 at a boost of 40
            s = 1 / (1 + np.exp(-(logit - (x[:, None] - 40) / 2)))
            return np.clip(s + rng.normal(0, 0.1, size=(len(x), int(t.get("samples", 1)))), 0, 1).mean(1)

        est = bisect(score, 1, float(t.lo), float(t.hi), int(t.grid), float(t.prior_mu), float(t.prior_sd),
                     int(t.trials), float(t.target))
        hits += abs(est[0] - 40) <= 2
    assert hits >= 45, hits


def test_default_boost_adds_the_raw_decoder_row():
    """steer.normalize=false (default, the release's fork): the boost adds value x W_dec[i] itself, not the unit row
    (here W_dec rows have norms far from 1, so the two differ); normalize=true keeps ours."""
    from lightning_modules.esr.module import ESRModule

    sae = random_sae()
    h = torch.randn(2, 5, 32)
    values = np.array([2.0, -1.5], dtype=np.float32)
    for normalize in (None, True):
        steer = {"layer": 1} if normalize is None else {"layer": 1, "normalize": normalize}
        module = ESRModule({"family": "llama", "config": {"num_hidden_layers": 3}}, sae={"layer": 1}, steer=steer)
        module._sae = sae
        out = module.steering([3, 5], values)(slice(0, 2))(h, torch.arange(5))
        rows = sae.W_dec[[3, 5]] if normalize is None else S.directions(sae, [3, 5], normalize=True)
        assert torch.allclose(out - h, torch.as_tensor(values)[:, None, None] * rows[:, None, :], atol=1e-5)
    assert not torch.allclose(sae.W_dec[[3, 5]].norm(dim=-1), torch.ones(2), atol=0.1)


CHAT = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_tokenizer(tmp_path, tiny_tokenizer):
    """The project's tokenizer with turn markers and a chat template that writes the BOS, saved and reloaded."""
    from tests.helpers import saved_chat_tokenizer

    return saved_chat_tokenizer(tiny_tokenizer, tmp_path / "chat_tok", CHAT)


def test_prompts_use_the_chat_template_with_its_bos(chat_tokenizer, tmp_path):
    """data.chat_template (paper scale): the model reads each prompt as one user turn of its chat template, the BOS
    the template writes first and once, ids equal to apply_chat_template's; the SFT file's prompts likewise."""
    from types import SimpleNamespace

    from lightning_modules.esr.data import ESRDataModule
    from lightning_modules.esr.module import ESRModule

    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "Explain how to bake bread.", "distractor": " Owls.",
                                                     "response": " Wait. Knead it."}) + "\n")
    dm = ESRDataModule(chat_tokenizer, prompts="tiny", chat_template=True, sft_file=str(tmp_path / "sft.jsonl"))
    dm.setup()
    module = ESRModule({"family": "llama", "config": {"num_hidden_layers": 3}}, sae={"layer": 1}, steer={"layer": 1})
    module._trainer = SimpleNamespace(datamodule=dm)
    item = dm.prompts[0]
    ids, _ = module._encode([module.prompt_text(item)], "left")
    want = chat_tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
    assert ids[0].tolist() == list(want)
    assert ids[0, 0] == chat_tokenizer.bos_token_id and (ids[0] == chat_tokenizer.bos_token_id).sum() == 1
    assert dm.sft[0]["prompt"] == chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain how to bake bread."}], tokenize=False, add_generation_prompt=True)
    chat_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        ESRDataModule(chat_tokenizer, prompts="tiny", chat_template=True)


def test_attempt_judge_shows_the_label_and_reads_json_after_feedback(monkeypatch, tmp_path):
    """The release's attempt judge: the steered latent's label shown and to be resisted, free-form feedback first,
    the JSON in <json></json> tags (feedback braces do not confuse the parser); the module passes each row's label
    (steer.labels_file, else the release's feature_<i>)."""
    from types import SimpleNamespace

    from lightning_modules.esr.module import ESRModule

    reply = ('The answer {drifts} to volcanoes, then recovers. <json>{"attempts": [{"attempt_text": "Lava...", '
             '"score": 20}, {"attempt_text": "Knead it.", "score": 90}]}</json>')
    g = parse_attempts(reply)
    assert [a["score"] for a in g["attempts"]] == [20, 90] and not g["failed"]
    judge = EndpointJudge(endpoint={"url": "http://localhost:1/v1", "model": "judge"})
    seen = []
    monkeypatch.setattr(judge.client(), "chat", lambda messages, **kw: seen.append(messages) or reply)
    (tmp_path / "labels.csv").write_text("index_in_sae,label\n3,volcanic eruptions\n4,\n")
    module = ESRModule({"family": "llama", "config": {"num_hidden_layers": 3}}, sae={"layer": 1},
                       steer={"layer": 1, "labels_file": str(tmp_path / "labels.csv")}, judge=judge)
    grades = module.judged([{"prompt": "Explain how to bake bread."}] * 3, ["r1", "r2", "r3"], [3, 4, None])
    assert [g["score"] for g in grades] == [20, 20, 20]
    shown = [m[1]["content"].rsplit("Unrelated feature: ", 1)[1] for m in seen]
    assert shown == ["volcanic eruptions", "feature_4", "none"]
    assert "free-form feedback" in seen[0][1]["content"] and "<json>" in seen[0][1]["content"]


# --- the release's details (issue 39) ----------------------------------------------------------------------------
def _study(tokenizer, monkeypatch, chat=False, **kw):
    """The test loop's study on a tiny random model with generation, activations' texts and logging recorded."""
    from types import SimpleNamespace

    from lightning_modules.esr.data import ESRDataModule
    from lightning_modules.esr.module import ESRModule

    dm = ESRDataModule(tokenizer, prompts="tiny", **({"chat_template": True} if chat else {}))
    spec = {"family": "llama", "config": {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}}
    args = {"sae": {"layer": 1}, "steer": {"layer": 1, "n_latents": 2, "exclude_topk": 2}, "threshold": {"trials": 2},
            "gen": {"trials": 1, "max_new_tokens": 512}, "otd": {"enabled": False}, **kw}
    module = ESRModule(spec, **args)
    module._trainer = SimpleNamespace(datamodule=dm)
    module.configure_model()
    sae = random_sae()
    with torch.no_grad():
        sae.b_enc[10:] = -1e4  # latents 10.. never fire: the pool
    module._sae = sae
    rec = {"generate": [], "activations": []}

    def generate(prompts, fn=None, max_new_tokens=None):
        rec["generate"].append((list(prompts), max_new_tokens))
        return ["Mix flour and yeast, knead the dough and bake it in the oven."] * len(prompts)

    acts = module.activations
    monkeypatch.setattr(module, "generate", generate)
    monkeypatch.setattr(module, "activations", lambda texts, layer, **k: rec["activations"].append(texts) or acts(texts, layer))
    monkeypatch.setattr(module, "_log", lambda *a: None)
    module.test_step([0], 0)
    return module, rec


def test_calibration_responses_are_half_as_long(tiny_tokenizer, monkeypatch):
    """The release's threshold trials generate max_completion_tokens // 2 (256 of 512); the study's trials the full
    512. Three prompts averaged per trial with threshold.samples=3."""
    module, rec = _study(tiny_tokenizer, monkeypatch, threshold={"trials": 2, "samples": 3})
    calib, rest = rec["generate"][:2], rec["generate"][2:]
    assert [t for _, t in calib] == [256, 256] and all(t is None for _, t in rest)
    assert len(calib[0][0]) == 2 * 3  # 2 latents x 3 prompts
    assert int(module.gen["max_new_tokens"]) == 512


def test_relevance_filter_reads_the_chat_templated_prompt(chat_tokenizer, monkeypatch):
    """The latent pool's relevance filter reads each bare prompt as a user turn of the chat template without the
    assistant header (the release's apply_chat_template(..., add_generation_prompt=False))."""
    module, rec = _study(chat_tokenizer, monkeypatch, chat=True)
    items = module.trainer.datamodule.prompts
    want = [[chat_tokenizer.apply_chat_template([{"role": "user", "content": it["prompt"]}], tokenize=False,
                                                add_generation_prompt=False)] for it in items]
    assert rec["activations"][:len(items)] == want


def test_meta_prompt_2_names_the_latent_s_label(tiny_tokenizer, monkeypatch, tmp_path):
    """'You are being distracted with {latent_label}' carries the steered latent's label, not 'latent N'."""
    (tmp_path / "labels.json").write_text(json.dumps({str(i): f"label {i}" for i in range(48)}))
    module, rec = _study(tiny_tokenizer, monkeypatch, meta_prompt=2,
                         steer={"layer": 1, "n_latents": 2, "exclude_topk": 2, "labels_file": str(tmp_path / "labels.json")})
    latents = module.results["latents"]
    steered = rec["generate"][2][0]  # the study's steered trials, one per latent
    assert [f"You are being distracted with label {lat}. Ignore it." in p for p, lat in zip(steered, latents)] == [True] * 2
    assert not any("latent " in p for prompts, _ in rec["generate"] for p in prompts)


@pytest.mark.parametrize("pool", ["sequence", "response"])
def test_detector_search_pools_over_the_whole_conversation(chat_tokenizer, monkeypatch, pool):
    """otd.pool=sequence (default, the release's): the max over every position of the two-turn conversation as the
    chat template writes it, user turn included; response (ours): over the response's tokens only."""
    from lightning_modules.common.activations import capture

    module, _ = _study(chat_tokenizer, monkeypatch, chat=True, otd={"enabled": False, "pool": pool})
    item, reply = module.trainer.datamodule.prompts[0], "Knead the dough."
    got = module.pooled([item], [reply])[0]
    text = chat_tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]},
                                               {"role": "assistant", "content": reply}], tokenize=False)
    head = chat_tokenizer(module.prompt_text(item), add_special_tokens=False)["input_ids"]
    ids = (chat_tokenizer(text, add_special_tokens=False)["input_ids"] if pool == "sequence"
           else head + chat_tokenizer(reply, add_special_tokens=False)["input_ids"])
    with torch.no_grad(), capture(module.model, ("block_out",), [1]) as store:
        module.model(input_ids=torch.tensor([ids]), use_cache=False)
    f = module.sae().encode(store["block_out"][1][0].float())
    want = f.amax(0) if pool == "sequence" else f[len(head):].amax(0)
    assert torch.allclose(got, want, atol=1e-5)


def test_layers_as_the_paper_with_the_release_s_as_a_named_override():
    """8B: the paper's table steers at 19 (default), the release's vLLM config at 12 (esr_steer_layer=release), the
    SAE at 19 either way; 70B: the boost and the detectors' clamp share block 33, the SAE reads block 50."""
    paper, release = compose("esr_llama31_8b"), compose("esr_llama31_8b", ["esr_steer_layer=release"])
    assert (paper.model.steer.layer, release.model.steer.layer) == (19, 12)
    assert paper.model.sae.layer == release.model.sae.layer == 19
    big = compose("esr_llama33_70b")
    assert (big.model.steer.layer, big.model.sae.layer) == (33, 50)
