"""common.lora: the trainable set is exactly the adapters plus what the recipe asks for, and merging reproduces the
adapted model's logits."""
import copy

import pytest
import torch

from lightning_modules.common.lora import apply_lora, merge_lora


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg).double().eval()


def test_trainable_parameters_are_the_adapters_and_what_is_asked():
    model = apply_lora(tiny_llama(), r=4, alpha=8, targets=["q_proj", "v_proj"], trainable=["embed_tokens"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n, _ in model.named_parameters() if "lora_A" in n or "lora_B" in n}
    embed = {n for n, _ in model.named_parameters() if "embed_tokens" in n}
    assert trainable == lora | embed and embed and len(lora) == 2 * 2 * 2  # A and B, 2 targets, 2 layers
    assert all(".q_proj." in n or ".v_proj." in n for n in lora)
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert a.shape == (4, 32)


def test_merge_reproduces_the_adapted_logits():
    model = apply_lora(tiny_llama(), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at zero: move it, or merging would be trivially exact
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    base = tiny_llama()(input_ids=x).logits
    with torch.no_grad():
        adapted = model(input_ids=x).logits
        merged = merge_lora(copy.deepcopy(model))
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, atol=1e-10, rtol=1e-10)
    assert (adapted - base).abs().max() > 1e-3  # the adapters changed the model


def test_bad_lora_settings_name_the_fix():
    with pytest.raises(ValueError, match="lora.targets"):
        apply_lora(tiny_llama(), targets=["query"])
    with pytest.raises(ValueError, match="lora.r"):
        apply_lora(tiny_llama(), r=0)
