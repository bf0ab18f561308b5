"""InstEmb (issue 20): SupCon, DAAP, look-ahead distillation alignment, teacher freezing, views, the tiny run."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lightning_modules.common.embedding import daap
from lightning_modules.instemb.module import InstEmbModule, supcon

SPEC = {"family": "llama", "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "num_key_value_heads": 2}}
BATCH = [{"instruction": "What colour is the object?", "input": "A small red cube lies in the kitchen.", "output": " red"},
         {"instruction": "What shape is the object?", "input": "In the attic there is a tiny blue ball.", "output": " red"},
         {"instruction": "Where is the object?", "input": "The large star in the office is green.", "output": " red"}]


def make(tokenizer, **kw):
    torch.manual_seed(0)
    spec = {**SPEC, "config": {**SPEC["config"], "vocab_size": len(tokenizer)}}
    kw.setdefault("lora", {"r": 4, "alpha": 8, "dropout": 0.0})
    if kw["lora"]["dropout"] == 0 and not kw.get("attention_dropout"):
        kw.setdefault("views", ["s1", "teacher_input", "student_output"])
    m = InstEmbModule(spec, partial(torch.optim.AdamW, lr=1e-3), max_length=64, **kw)
    m.tokenizer = tokenizer
    m.configure_model()
    return m


# --- the formulas --------------------------------------------------------------------------------
def test_supcon_with_one_positive_is_infonce():
    torch.manual_seed(0)
    n, tau = 5, 0.1
    z = torch.randn(2 * n, 8)
    got = supcon(z, torch.arange(n).repeat(2), tau)
    zn = F.normalize(z, dim=-1)
    logits = (zn @ zn.T / tau).fill_diagonal_(float("-inf"))  # NT-Xent: every other row is a candidate
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    assert got.item() == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-5)


@pytest.mark.parametrize("V,N,tau", [(4, 3, 0.05), (2, 6, 0.5), (3, 4, 1.0)])
def test_supcon_identical_views_orthonormal(V, N, tau):
    z = torch.eye(N)[torch.arange(N).repeat(V)]  # V identical views of N orthonormal examples
    expected = math.log((V - 1) * math.exp(1 / tau) + V * (N - 1)) - 1 / tau
    assert supcon(z, torch.arange(N).repeat(V), tau).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_daap_formula():
    torch.manual_seed(0)
    last, la = torch.randn(3, 6), torch.randn(3, 4, 6)
    m = la.mean(1)
    by_hand = last / last.norm(dim=-1, keepdim=True) + m / m.norm(dim=-1, keepdim=True)
    assert torch.allclose(daap(last, la), by_hand / by_hand.norm(dim=-1, keepdim=True), atol=1e-6)
    assert torch.allclose(daap(last, la, "none"), (last + m) / 2)
    with pytest.raises(ValueError, match="daap_normalize"):
        daap(last, la, "both")


# --- the module on a tiny random LLaMA --------------------------------------------------------------
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_teacher_frozen_lookahead_learns(tiny_tokenizer, finetune):
    m = make(tiny_tokenizer, finetune=finetune, n_lookahead=3, lora={"r": 4, "alpha": 8, "dropout": 0.1},
             attention_dropout=0.1 if finetune == "full" else 0.0)  # full: attention dropout is the s2 source
    before = [p.detach().clone() for p in (m._teacher[0].parameters() if finetune == "full" else
                                           (p for n, p in m.model.named_parameters() if "lora_" not in n))]
    loss = m.compute_loss(BATCH)
    loss.backward()
    assert m.lookahead.grad is not None and m.lookahead.grad.abs().sum() > 0
    if finetune == "lora":  # the teacher is the base weights: frozen, no gradient
        frozen = [p for n, p in m.model.named_parameters() if "lora_" not in n]
        assert all(not p.requires_grad and p.grad is None for p in frozen)
        assert any(p.grad is not None for n, p in m.model.named_parameters() if "lora_" in n)
    else:  # a copy outside the module tree: not optimised, never gets a gradient
        teacher = m._teacher[0]
        assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
        ids = {id(p) for p in m.parameters()}
        assert not any(id(p) in ids for p in teacher.parameters())
        assert m.model.get_input_embeddings().weight.grad is not None  # the student trains in full
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
    opt.step()
    after = list(m._teacher[0].parameters()) if finetune == "full" else [p for n, p in m.model.named_parameters() if "lora_" not in n]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_full_finetune_teacher_states_do_not_move(tiny_tokenizer):
    """Issue 40: under finetune=full the student's embedding table trains; the teacher must embed its prompt and
    gold tokens with the frozen copy's table, so its states (the distillation target) stay put after a step."""
    m = make(tiny_tokenizer, finetune="full", n_lookahead=3, lora={"r": 4, "alpha": 8, "dropout": 0.0},
             attention_dropout=0.1)
    rows = [m.prompt_ids(b["instruction"], b["input"]) for b in BATCH]
    golds = [tiny_tokenizer(b["output"], add_special_tokens=False)["input_ids"] for b in BATCH]
    before = m.teacher(rows, golds)[0].hidden_states
    m.compute_loss(BATCH).backward()
    torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0).step()
    assert not torch.equal(m.model.get_input_embeddings().weight, m._teacher[0].get_input_embeddings().weight)
    after = m.teacher(rows, golds)[0].hidden_states
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("experiment", ["instemb_llama3_8b", "instemb_qwen25_7b"])
def test_paper_scale_checkpoints_activations(experiment):
    """Issue 40: three student graphs of 32 x 520 tokens per GPU need gradient checkpointing (the header's estimate)."""
    from benchmarks.tables import composed

    assert composed(experiment).backbone.gradient_checkpointing is True


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_gradient_checkpointing_keeps_the_gradients(tiny_tokenizer, finetune):
    """Checkpointed blocks give InstEmb the same gradients, including the LoRA views whose inputs need no grad."""
    grads = []
    for ckpt in (False, True):
        spec = {**SPEC, "gradient_checkpointing": ckpt}
        torch.manual_seed(0)
        m = InstEmbModule({**spec, "config": {**spec["config"], "vocab_size": len(tiny_tokenizer)}},
                          partial(torch.optim.AdamW, lr=1e-3), max_length=64, finetune=finetune, n_lookahead=3,
                          lora={"r": 4, "alpha": 8, "dropout": 0.0}, views=["s1", "teacher_input", "student_output"])
        m.tokenizer = tiny_tokenizer
        m.configure_model()
        with torch.no_grad():  # LoRA B = 0 would leave A without gradient
            for n, p in m.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        m.train()
        m.compute_loss(BATCH).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    trained = [n for n, g in grads[0].items() if g is not None]  # all but the LM head (MSE never reads it)
    assert [n for n, g in grads[1].items() if g is not None] == trained and len(trained) >= len(grads[0]) - 1
    for n in trained:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4), n


def test_inbedder_arm_trains_and_embeds_as_the_release(tiny_tokenizer):
    """Issue 40: the InBedder re-implementation: CE of output + EOS after the bare prompt; embedding = the last
    layer's state on the prompt's last token (the release's fst_gen_layer_<last>); no teacher copy."""
    m = make(tiny_tokenizer, objective="inbedder", finetune="full", n_lookahead=0, distill="none", lambda_con=0.0,
             pooling="last")
    assert m._teacher == [] and m.lookahead is None
    tok = tiny_tokenizer
    b = BATCH[0]
    text = m.template.format(instruction=b["instruction"], input=b["input"])
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    answer = tok(b["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    m.eval()
    with torch.no_grad():
        logits = m.model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        by_hand = F.cross_entropy(logits[len(prompt) - 1:-1], torch.tensor(answer))
        assert m.compute_loss([b]).item() == pytest.approx(by_hand.item(), rel=1e-5)
        h = m.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(m.encode([b["input"]], b["instruction"])[0], h.float(), atol=1e-5)
    # a batch of unequal lengths: left padding changes nothing
    two = m.compute_loss(BATCH[:2])
    one = [m.compute_loss([x]) for x in BATCH[:2]]
    n = [len(tok(x["output"], add_special_tokens=False)["input_ids"]) + 1 for x in BATCH[:2]]
    assert two.item() == pytest.approx(sum(l * k for l, k in zip(one, n)).item() / sum(n), rel=1e-5)
    with pytest.raises(ValueError, match="objective=inbedder"):
        make(tiny_tokenizer, objective="inbedder", n_lookahead=8)


@pytest.mark.parametrize("distill", ["mse", "kl"])
def test_distill_is_zero_when_student_is_teacher(tiny_tokenizer, distill):
    gold = tiny_tokenizer(" red", add_special_tokens=False)["input_ids"]
    m = make(tiny_tokenizer, distill=distill, n_lookahead=len(gold), lambda_con=0.0)
    m.train()
    tok = tiny_tokenizer
    rows = [m.prompt_ids(b["instruction"], b["input"]) for b in BATCH]
    golds = [tok(b["output"], add_special_tokens=False)["input_ids"] for b in BATCH]
    m.lookahead.data = m.model.get_input_embeddings().weight[torch.tensor(gold)].detach().clone()
    s_out, W = m.student(rows)
    t_out, Wt, gids, gmask = m.teacher(rows, golds)
    assert W == Wt and gmask.all()  # LoRA starts at B = 0: student = teacher
    assert m.distill_loss(s_out, t_out, W, gids, gmask).item() == 0.0
    m.align = "shifted"  # LA_t against the state one column earlier: not zero
    assert m.distill_loss(s_out, t_out, W, gids, gmask).item() > 1e-6


def test_short_gold_is_masked_and_ce_targets(tiny_tokenizer):
    m = make(tiny_tokenizer, distill="ce", n_lookahead=4, lambda_con=0.0)
    rows = [m.prompt_ids(b["instruction"], b["input"]) for b in BATCH[:1]]
    gold = [[11, 12]]  # two gold tokens; slots 3, 4 masked
    s_out, W = m.student(rows)
    t_out, _, gids, gmask = m.teacher(rows, gold)
    assert gmask.tolist() == [[1, 1, 0, 0]]
    # same_position: LA_1 predicts what the state on gold_1 predicts (gold_2); LA_2's target (gold_3) is missing
    logp = s_out.logits[0, W].float().log_softmax(-1)
    assert m.distill_loss(s_out, t_out, W, gids, gmask).item() == pytest.approx(-logp[12].item(), rel=1e-5)
    m.align = "shifted"  # LA_1 predicts gold_1, LA_2 gold_2
    l0 = s_out.logits[0, W:W + 2].float().log_softmax(-1)
    assert m.distill_loss(s_out, t_out, W, gids, gmask).item() == pytest.approx(-(l0[0, 11] + l0[1, 12]).item() / 2, rel=1e-5)


def test_two_student_views_differ_only_with_dropout(tiny_tokenizer):
    rows_of = lambda m: [m.prompt_ids(b["instruction"], b["input"]) for b in BATCH]  # noqa: E731
    for lora_dropout, attn, differ in [(0.3, 0.0, True), (0.0, 0.3, True), (0.0, 0.0, False)]:
        m = make(tiny_tokenizer, lora={"r": 4, "alpha": 8, "dropout": lora_dropout}, attention_dropout=attn)
        with torch.no_grad():  # LoRA B = 0 silences its dropout: give the adapters weight first
            for n, p in m.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        m.train()
        rows = rows_of(m)
        s1 = m.student(rows, lookahead=False)[0].hidden_states[-1][:, -1]
        s2 = m.student(rows, lookahead=False)[0].hidden_states[-1][:, -1]
        assert (not torch.allclose(s1, s2)) == differ, (lora_dropout, attn)


def test_encode_is_one_prefill_per_batch(tiny_tokenizer, monkeypatch):
    m = make(tiny_tokenizer, n_lookahead=3)
    calls = []
    m.model.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setattr(m.model, "generate", lambda *a, **k: pytest.fail("encode must not decode"), raising=False)
    texts = [b["input"] for b in BATCH]
    e = m.encode(texts, "What colour is the object?")
    assert e.shape == (3, 32) and len(calls) == 1 and m.model.training
    # left padding with positions from the mask: a text embeds the same alone or beside longer ones
    for how in ("daap", "last", "lookahead", "mean"):
        together = m.encode(texts + ["x"], "Where?", pooling=how)
        alone = m.encode(["x"], "Where?", pooling=how)
        assert torch.allclose(together[-1], alone[0], atol=1e-5), how
    m.eval_cfg["batch_size"] = 2
    calls.clear()
    m.encode(texts)
    assert len(calls) == 2


@pytest.mark.parametrize("kw,match", [
    ({"views": ["s1", "s2"], "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}, "s2"),
    ({"views": ["s1", "s2"], "finetune": "full"}, "s2"),
    ({"distill": "kl", "distill_layer": -2}, "distill_layer"),
    ({"pooling": "max"}, "model.pooling"), ({"align": "next"}, "model.align"), ({"distill": "l1"}, "model.distill"),
    ({"n_lookahead": 0}, "pooling=daap"), ({"n_lookahead": 0, "pooling": "lookahead", "distill": "none"}, "look-ahead"),
    ({"views": ["s1", "s3"]}, "model.views"),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        InstEmbModule(SPEC, **kw)


def test_data_splits_disjoint():
    from lightning_modules.instemb.data import InstEmbDataModule, warmup_pairs

    dm = InstEmbDataModule(n_train=300, n_val=40, n_test=40)
    dm.setup()
    train = {t["key"] for t in dm.train}
    warm = {p["key"] for p in warmup_pairs(300, 5, "train", 0.2, 0.2)}
    for s in ("val", "test"):
        keys = {o["key"] for o in dm.eval_items[s]}
        assert keys and not keys & train and not keys & warm
    assert not {o["key"] for o in dm.eval_items["val"]} & {o["key"] for o in dm.eval_items["test"]}
    assert all(t["output"].strip() in t["input"] for t in dm.train)


def test_instemb_tiny_smoke(tmp_path):
    from tests.helpers import SMOKE_WARMUP, run_experiment

    # debug=smoke caps steps and evaluation batches; these shrink what it does not: the training triples, the
    # held-out objects each evaluation embeds (under 3 instructions, k-means per instruction) and the cached
    # warm-up instemb_tiny starts from (SMOKE_WARMUP: 40 steps at batch 16, not 150 at 32)
    overrides = ["debug=smoke", "data.n_train=320", "data.n_val=32", "data.n_test=32", *SMOKE_WARMUP]
    value, metrics = run_experiment("instemb_tiny", tmp_path, overrides=overrides)
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    final = metrics["final"]
    for split in ("val", "test"):
        per = [final[f"{split}/ndcg@10_{a}"] for a in ("colour", "shape", "place")]
        assert final[f"{split}/ndcg@10"] == pytest.approx(sum(per) / 3, rel=1e-5)
        assert 0 <= final[f"{split}/v_measure"] <= 1
    assert value == final["val/ndcg@10"]
