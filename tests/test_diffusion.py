"""common/diffusion.py: bidirectional attention, LLaDA's loss against a hand computation, the sampler's schedule and
order on hand-built logits, Gumbel sampling against softmax, and the LLaDA / Dream key maps on fake checkpoints."""
import json
import math

import pytest
import torch

from lightning_modules.common.diffusion import (MaskedDiffusionLM, add_gumbel_noise, build_diffusion_backbone,
                                                forward_process, llada_key_map, make_bidirectional,
                                                num_transfer_tokens, random_length, weighted_masked_ce)

MASK = 3


def tiny_llama(layers=2, vocab=40):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_a_later_token_changes_position_zero_only_when_bidirectional():
    x = torch.randint(4, 40, (2, 12))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1 - 4) % 36 + 4
    causal = tiny_llama()
    with torch.no_grad():
        assert torch.equal(causal(x).logits[:, 0], causal(y).logits[:, 0])  # the control: causal ignores the future
        mdlm = MaskedDiffusionLM(causal, MASK)
        assert (mdlm.logits(x)[:, 0] - mdlm.logits(y)[:, 0]).abs().min() > 1e-6


def test_bidirectional_core_equals_unmasked_attention():
    """The patched model equals the eager model run with an all-zero additive mask (no causal mask at all)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    x = torch.randint(4, 40, (2, 9))
    # reference: every layer's attention by hand, softmax(q k^T * scale) v with no mask, through the layer's own forward
    from lightning_modules.common import attention as A

    def full_core(attn, h, q, k, v, mask):
        k, v = A.repeat_kv(k, attn.num_key_value_groups), A.repeat_kv(v, attn.num_key_value_groups)
        w = torch.softmax(q @ k.transpose(-1, -2) * attn.scaling, dim=-1)
        return (w @ v).transpose(1, 2)

    with torch.no_grad():
        A.patch_attention(model, full_core)
        ref = model(x).logits
        A.unpatch_attention(model)
        got = make_bidirectional(model)(x).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_llada_loss_matches_a_hand_computation():
    torch.manual_seed(1)
    b, n, v = 2, 5, 7
    logits = torch.randn(b, n, v)
    targets = torch.randint(0, v, (b, n))
    masked = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    t = torch.tensor([0.3, 0.9])
    p = ((1 - 1e-3) * t + 1e-3)[:, None].expand(b, n)
    hand = 0.0
    for i in range(b):
        for j in range(n):
            if masked[i, j]:
                z = logits[i, j]
                hand += (math.log(sum(math.exp(float(u)) for u in z)) - float(z[targets[i, j]])) / float(p[i, j])
    assert weighted_masked_ce(logits, targets, masked, p).item() == pytest.approx(hand / (b * n), rel=1e-5)
    # SFT: each sequence divided by its answer length, then the mean over sequences
    prompt = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    hand_sft = 0.0
    for i in range(b):
        s = sum((math.log(sum(math.exp(float(u)) for u in logits[i, j])) - float(logits[i, j, targets[i, j]]))
                / float(p[i, j]) for j in range(n) if masked[i, j])
        hand_sft += s / int((~prompt[i]).sum())
    got = weighted_masked_ce(logits, targets, masked, p, prompt).item()
    assert got == pytest.approx(hand_sft / b, rel=1e-5)


def test_forward_process_masks_at_rate_p_and_never_the_prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 40, (4, 4000))
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    noisy, masked, p = forward_process(ids, MASK, t=t, generator=g)
    assert torch.equal(noisy == MASK, masked)
    torch.testing.assert_close(p[:, 0], (1 - 1e-3) * t + 1e-3)
    rates = masked.float().mean(1)
    assert torch.allclose(rates, p[:, 0], atol=0.03)
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    prompt[:, :100] = True
    _, masked, _ = forward_process(ids, MASK, t=torch.ones(4), prompt_mask=prompt, generator=g)
    assert not masked[:, :100].any() and masked[:, 100:].float().mean() > 0.99


def test_module_loss_is_the_forward_process_then_the_weighted_ce():
    mdlm = MaskedDiffusionLM(tiny_llama(), MASK)
    ids = torch.randint(4, 40, (3, 10))
    loss = mdlm.loss(ids, generator=torch.Generator().manual_seed(5))
    noisy, masked, p = forward_process(ids, MASK, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(loss, weighted_masked_ce(mdlm.logits(noisy), ids, masked, p))


class ShapeRecorder(MaskedDiffusionLM):
    """The toy model, remembering the length of every sequence it is shown."""

    def logits(self, input_ids=None, inputs_embeds=None):
        self.seen.append(input_ids.shape[1])
        return super().logits(input_ids, inputs_embeds)


def test_random_length_cuts_every_batch_at_prob_1_and_scores_only_the_kept_tokens():
    """LLaDA's pretraining cut at probability 1: the model sees [1, L] tokens, the loss is the forward process and the
    1/p-weighted CE over the kept tokens alone (divided by B·kept), and the cut tokens change nothing."""
    mdlm = ShapeRecorder(tiny_llama(), MASK)
    mdlm.seen = []
    ids, kept = torch.randint(4, 40, (3, 12)), []
    for seed in range(12):
        loss = mdlm.loss(ids, generator=torch.Generator().manual_seed(seed), random_length_prob=1.0)
        g = torch.Generator().manual_seed(seed)
        n = random_length(12, 1.0, g)
        assert 1 <= n <= 12 and mdlm.seen[-1] == n
        kept.append(n)
        noisy, masked, p = forward_process(ids[:, :n], MASK, generator=g)
        torch.testing.assert_close(loss, weighted_masked_ce(mdlm.logits(noisy), ids[:, :n], masked, p))
        if n < 12:  # what lies beyond the cut is neither seen nor scored
            other = ids.clone()
            other[:, n:] = (other[:, n:] - 4 + 7) % 36 + 4
            again = mdlm.loss(other, generator=torch.Generator().manual_seed(seed), random_length_prob=1.0)
            assert torch.equal(loss, again)
    assert min(kept) < 12  # the loop saw real cuts, not only full lengths
    # the SFT prompt mask is cut with the ids
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    prompt[:, :4] = True
    loss = mdlm.loss(ids, prompt, generator=torch.Generator().manual_seed(3), random_length_prob=1.0)
    g = torch.Generator().manual_seed(3)
    n = random_length(12, 1.0, g)
    noisy, masked, p = forward_process(ids[:, :n], MASK, prompt_mask=prompt[:, :n], generator=g)
    torch.testing.assert_close(loss, weighted_masked_ce(mdlm.logits(noisy), ids[:, :n], masked, p, prompt[:, :n]))


def test_random_length_is_uniform_on_1_to_L():
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([random_length(8, 1.0, g) for _ in range(8000)])
    counts = torch.bincount(draws, minlength=9)
    assert counts[0] == 0 and counts[1:].sum() == 8000
    assert (counts[1:] - 1000).abs().max() <= 150  # s.e. of a count 29.6: 5 s.e.


def test_random_length_prob_0_is_bit_identical_to_no_cut_and_draws_nothing():
    mdlm = MaskedDiffusionLM(tiny_llama(), MASK)
    ids = torch.randint(4, 40, (3, 10))
    torch.manual_seed(7)
    loss = mdlm.loss(ids, random_length_prob=0.0)
    after = torch.rand(1)
    torch.manual_seed(7)
    noisy, masked, p = forward_process(ids, MASK)
    assert torch.equal(loss, weighted_masked_ce(mdlm.logits(noisy), ids, masked, p))
    assert torch.equal(after, torch.rand(1))  # the global RNG stream is untouched by the switch at 0
    assert all(random_length(10, 0.0) == 10 for _ in range(100))


def test_random_length_cuts_about_1_percent_of_batches_at_llada_prob():
    """At LLaDA's 0.01 a batch of L = 1000 is cut below L with probability 0.01 · 999/1000; over 100,000 seeded draws
    the fraction lies within 0.0015 of it (s.e. 3.1e-4: about 5 s.e.)."""
    g = torch.Generator().manual_seed(0)
    cut = sum(random_length(1000, 0.01, g) < 1000 for _ in range(100_000)) / 100_000
    assert abs(cut - 0.01 * 0.999) < 0.0015, cut
    with pytest.raises(ValueError, match="random_length_prob"):
        random_length(10, 1.5)


class HandLogits(MaskedDiffusionLM):
    """A 'model' with fixed logits: position i prefers token ``tokens[i]`` with confidence rising in ``conf[i]``."""

    def __init__(self, tokens, conf, vocab=10, shift=0):
        torch.nn.Module.__init__(self)
        self.mask_token_id, self.logit_shift = MASK, shift
        table = torch.full((len(tokens), vocab), 0.0)
        table[torch.arange(len(tokens)), torch.tensor(tokens)] = torch.tensor(conf)
        self.table = table

    def logits(self, input_ids=None, inputs_embeds=None):
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)


def test_sampler_unmasks_one_token_per_step_most_confident_first():
    prompt = torch.tensor([[5, 6]])
    tokens = [0, 0, 7, 8, 9, 4, 5, 6]          # positions 2..7 are generated
    conf = [0, 0, 1.0, 6.0, 3.0, 5.0, 2.0, 4.0]
    order = []

    def callback(step, x, transferred):
        assert int(transferred.sum()) == 1
        order.append(int(transferred[0].nonzero()))

    out = HandLogits(tokens, conf).sample(prompt, gen_length=6, steps=6, block_length=6, callback=callback)
    assert order == [3, 5, 7, 4, 6, 2]  # by confidence, highest first
    assert out[0].tolist() == [5, 6, 7, 8, 9, 4, 5, 6]


def test_sampler_fills_every_mask_on_schedule_and_respects_blocks():
    assert num_transfer_tokens(torch.tensor([10, 3]), 4).tolist() == [[3, 3, 2, 2], [1, 1, 1, 0]]
    mdlm = MaskedDiffusionLM(tiny_llama(), MASK)
    prompt = torch.randint(4, 40, (2, 5))
    counts, seen = [], []

    def callback(step, x, transferred):
        counts.append(transferred.sum(1).tolist())
        seen.append(transferred[:, 5:].nonzero()[:, 1].tolist())

    for remasking in ("low_confidence", "random"):
        counts.clear()
        seen.clear()
        out = mdlm.sample(prompt, gen_length=12, steps=8, block_length=6, remasking=remasking, temperature=0.5,
                          callback=callback, generator=torch.Generator().manual_seed(0))
        assert not (out == MASK).any() and torch.equal(out[:, :5], prompt)
        assert counts == [[2, 2], [2, 2], [1, 1], [1, 1]] * 2  # 6 masks per block over 4 steps: 2, 2, 1, 1
        assert all(p < 6 for s in seen[:4] for p in s) and all(p >= 6 for s in seen[4:] for p in s)
    with pytest.raises(ValueError, match="multiple of block_length"):
        mdlm.sample(prompt, gen_length=10, steps=4, block_length=4)
    with pytest.raises(ValueError, match="number of blocks"):
        mdlm.sample(prompt, gen_length=12, steps=5, block_length=6)


def test_logit_shift_moves_predictions_one_position_right():
    model = tiny_llama()
    x = torch.randint(4, 40, (1, 8))
    with torch.no_grad():
        plain = MaskedDiffusionLM(model, MASK, 0).logits(x)
        dream = MaskedDiffusionLM(model, MASK, 1).logits(x)
    torch.testing.assert_close(dream[:, 1:], plain[:, :-1])
    torch.testing.assert_close(dream[:, 0], plain[:, 0])


def test_gumbel_sampling_follows_softmax_at_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0]).expand(40000, 3)
    g = torch.Generator().manual_seed(0)
    for temp in (0.5, 1.0):
        draws = add_gumbel_noise(logits, temp, g).argmax(-1)
        freq = torch.bincount(draws, minlength=3).double() / len(draws)
        torch.testing.assert_close(freq, torch.softmax(logits[0].double() / temp, 0), atol=0.01, rtol=0)
    assert torch.equal(add_gumbel_noise(logits, 0.0), logits)


def _save_sharded(tensors: dict, out, n_shards=2):
    from safetensors.torch import save_file

    keys = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[s::n_shards]}
        save_file(part, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


SPEC = {"family": "llama", "dtype": "float32", "weight_map": "llada", "diffusion": {"mask_token_id": MASK},
        "config": {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}}


def llada_checkpoint(tmp_path, drop=None, reshape=None):
    """Random tensors under LLaDA's own names and shapes (OLMo-style blocks: ff_proj gate, up_proj, ff_out down)."""
    torch.manual_seed(3)
    d, f, v = 32, 48, 40
    t = {"model.transformer.wte.weight": torch.randn(v, d), "model.transformer.ln_f.weight": torch.rand(d),
         "model.transformer.ff_out.weight": torch.randn(v, d)}
    for i in range(2):
        pre = f"model.transformer.blocks.{i}."
        t.update({pre + "q_proj.weight": torch.randn(d, d), pre + "k_proj.weight": torch.randn(d, d),
                  pre + "v_proj.weight": torch.randn(d, d), pre + "attn_out.weight": torch.randn(d, d),
                  pre + "ff_proj.weight": torch.randn(f, d), pre + "up_proj.weight": torch.randn(f, d),
                  pre + "ff_out.weight": torch.randn(d, f), pre + "attn_norm.weight": torch.rand(d),
                  pre + "ff_norm.weight": torch.rand(d)})
    if drop:
        t.pop(drop)
    if reshape:
        t[reshape] = t[reshape][:-1]
    _save_sharded(t, tmp_path)
    return t


def test_llada_key_map_loads_a_fake_checkpoint_every_key_once(tmp_path):
    t = llada_checkpoint(tmp_path)
    assert set(llada_key_map(2)) == set(t)  # the map names exactly the checkpoint's keys
    mdlm = build_diffusion_backbone({**SPEC, "pretrained": str(tmp_path)})
    own = mdlm.model.state_dict()
    for src, dst in llada_key_map(2).items():
        assert torch.equal(own[dst], t[src]), dst
    # LLaDA's SwiGLU by hand: ff_out(silu(ff_proj x) * up_proj x) is the loaded LLaMA MLP
    x = torch.randn(3, 32)
    pre = "model.transformer.blocks.1."
    hand = (torch.nn.functional.silu(x @ t[pre + "ff_proj.weight"].T) * (x @ t[pre + "up_proj.weight"].T)) \
        @ t[pre + "ff_out.weight"].T
    torch.testing.assert_close(mdlm.model.model.layers[1].mlp(x), hand)
    assert mdlm.mask_token_id == MASK and mdlm.logit_shift == 0


def test_llada_key_map_refuses_missing_or_misshapen_keys(tmp_path):
    (tmp_path / "a").mkdir()
    llada_checkpoint(tmp_path / "a", drop="model.transformer.blocks.1.up_proj.weight")
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        build_diffusion_backbone({**SPEC, "pretrained": str(tmp_path / "a")})
    (tmp_path / "b").mkdir()
    llada_checkpoint(tmp_path / "b", reshape="model.transformer.blocks.0.ff_proj.weight")
    with pytest.raises(ValueError, match="shape"):
        build_diffusion_backbone({**SPEC, "pretrained": str(tmp_path / "b")})


def test_dream_key_map_is_qwen2s_names_checked(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {"family": "qwen2", "dtype": "float32", "weight_map": "dream",
            "diffusion": {"mask_token_id": MASK, "logit_shift": 1},
            "config": {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}}
    torch.manual_seed(4)
    src = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **spec["config"]))
    _save_sharded({k: v.clone() for k, v in src.state_dict().items()}, tmp_path)
    mdlm = build_diffusion_backbone({**spec, "pretrained": str(tmp_path)})
    assert mdlm.logit_shift == 1
    for k, v in src.state_dict().items():
        assert torch.equal(mdlm.model.state_dict()[k], v), k


def test_a_causal_backbone_or_no_mask_id_is_refused():
    with pytest.raises(ValueError, match="causal backbone"):
        build_diffusion_backbone({"family": "llama", "config": SPEC["config"]})
    with pytest.raises(ValueError, match="mask_token_id"):
        MaskedDiffusionLM(tiny_llama(), None)
    with pytest.raises(ValueError, match="weight_map"):
        build_diffusion_backbone({**SPEC, "weight_map": "gpt9"})


class ScriptedLogits(MaskedDiffusionLM):
    """A 'model' whose logits follow a script, one (L, V) table per call: a sampled [MASK] can be planted."""

    def __init__(self, tables):
        torch.nn.Module.__init__(self)
        self.mask_token_id, self.logit_shift = MASK, 0
        self.tables, self.calls = tables, 0

    def logits(self, input_ids=None, inputs_embeds=None):
        t = self.tables[self.calls]
        self.calls += 1
        return t[None].expand(input_ids.shape[0], -1, -1)


def _llada_generate(model, prompt, gen_length, steps, block_length):
    """LLaDA's generate (greedy, low-confidence), written from its description: each step offers every masked
    position up to the current block's end (-inf after it), transfers the block's scheduled count."""
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], 1)
    per_block, p = steps // (gen_length // block_length), prompt.shape[1]
    for nb in range(gen_length // block_length):
        sched = num_transfer_tokens((x[:, p + nb * block_length:p + (nb + 1) * block_length] == MASK).sum(1), per_block)
        for i in range(per_block):
            mask_index = x == MASK
            logits = model.logits(x)
            x0 = logits.argmax(-1)
            x0_p = torch.softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1)
            x0_p[:, p + (nb + 1) * block_length:] = -math.inf
            conf = torch.where(mask_index, x0_p, torch.tensor(-math.inf))
            sel = conf[0].topk(int(sched[0, i])).indices
            x[0, sel] = x0[0, sel]
    return x


def test_sampler_offers_an_earlier_blocks_sampled_mask_again_as_llada():
    """Block 0's first position samples [MASK] (stays masked); LLaDA offers it again in block 1, where it now wins
    (old: never re-offered, so it stayed [MASK] in the output)."""
    vocab, n = 10, 6  # prompt 2, then blocks [2, 4) and [4, 6), one transfer a step
    script = [(2, MASK, 9.0), (3, 7, 1.0)], [(2, 5, 0.5), (3, 7, 6.0)], [(2, 5, 9.0), (4, 8, 2.0), (5, 8, 1.0)], \
        [(4, 8, 6.0), (5, 6, 2.0)], [(4, 8, 6.0), (5, 6, 2.0)]
    tables = []
    for rows in script:
        t = torch.zeros(n, vocab)
        for pos, tok, c in rows:
            t[pos, tok] = c
        tables.append(t)
    prompt = torch.tensor([[5, 6]])
    out = ScriptedLogits(tables).sample(prompt, gen_length=4, steps=4, block_length=2)
    want = _llada_generate(ScriptedLogits(tables), prompt, 4, 4, 2)
    assert out.tolist() == want.tolist()
    assert out[0, 2] == 5 and (out == MASK).sum() == 1  # re-offered and filled; block 1 keeps one mask, as LLaDA
