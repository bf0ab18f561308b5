import time, torch, random, sys
from transformers import LlamaConfig, LlamaForCausalLM
from datamodules.rule_induction import RuleInductionDataModule, suite_tokenizer
from lightning_modules.common.diffusion import MaskedDiffusionLM
torch.manual_seed(0)
tok = suite_tokenizer()
ans = sys.argv[1]; lr = float(sys.argv[2]); bs = int(sys.argv[3])
dm = RuleInductionDataModule(tok, n_relevant=5, n_distractor=10, answer=ans, batch_size=bs, arithmetic_share=0.1)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
m = MaskedDiffusionLM(LlamaForCausalLM(cfg), tok.mask_token_id)
opt = torch.optim.AdamW(m.parameters(), lr, betas=(0.9, 0.95), weight_decay=0.0)
val = dm.queries("val", 4, None)
close = tok.encode("].", add_special_tokens=False)
def acc():
    m.eval(); c = 0
    with torch.no_grad():
        for q in val:
            x = torch.tensor([q["prompt_ids"] + [tok.mask_token_id] + close])
            c += int(m.logits(x)[0, len(q["prompt_ids"])].argmax() == q["answer_id"])
    m.train(); return c / len(val)
it = iter(dm.train_dataloader()); t0 = time.time()
for step in range(1, 2001):
    b = next(it)["input_ids"]
    loss = m.loss(b); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); opt.zero_grad()
    if step % 100 == 0:
        print(step, round(time.time() - t0), b.shape[1], round(loss.item(), 3), acc(), flush=True)
