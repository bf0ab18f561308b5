"""Rollout generation and per-token log-probs for critic-free RL on a transformers causal LM.

Layout of a rollout batch (``Rollouts``): N = (#prompts · G) rows, group-major (rows g·G..g·G+G-1 share prompt g).
Prompts are **left**-padded to a common length P and responses **right**-padded to T, so response token t
(1-based) of every row sits at column P + t - 1 and a prefix "prompt + first C response tokens" is the column
slice ``[:, :P + C]``. Position ids come from the attention mask (``cumsum - 1``), exactly as ``generate`` uses
them, so log-probs recomputed in the update pass equal those of the sampling pass and a truncated forward gives
the same log-probs as the full forward for every kept position (causal attention; tested).

``packed_logprobs`` feeds the same prefixes without padding: each row's real prompt tokens and first C_i response
tokens, concatenated into one row with per-sequence ``position_ids`` (restarting at 0) and no attention mask.
transformers then keeps the sequences apart: on CPU / SDPA / eager it builds a block-diagonal causal mask from the
position ids (``masking_utils.find_packed_sequence_indices``), with ``attn_implementation=flash_attention_2`` it
takes the varlen kernel (cu_seqlens from the position ids). Activations follow Σ_i (p_i + C_i), not
rows · (P + max C).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollouts:
    input_ids: torch.Tensor        # (N, P+T) left-padded prompt + right-padded response
    attention_mask: torch.Tensor   # (N, P+T)
    prompt_len: int                # P (padded prompt width)
    response_mask: torch.Tensor    # (N, T) 1 on response tokens (up to and including EOS)
    group_size: int
    completions: list[str] = field(default_factory=list)
    rewards: torch.Tensor | None = None      # (N,)
    advantages: torch.Tensor | None = None   # (N,)
    problem_ids: list[str] | None = None     # (N,) the problem each row answers (per-problem state tables)

    def select_groups(self, groups: torch.Tensor) -> "Rollouts":
        """The rollouts of the given prompt groups only (dynamic sampling), in that order."""
        G = self.group_size
        rows = (groups.view(-1, 1).cpu() * G + torch.arange(G)).view(-1)
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return Rollouts(self.input_ids[rows.to(self.input_ids.device)], pick(self.attention_mask), self.prompt_len,
                        pick(self.response_mask), G, [self.completions[i] for i in rows.tolist()] if self.completions else [],
                        pick(self.rewards), pick(self.advantages),
                        [self.problem_ids[i] for i in rows.tolist()] if self.problem_ids else None)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.attention_mask[:, :self.prompt_len].sum(-1).long()

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("an empty prompt: every prompt needs at least one token")
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def response_mask_from(responses: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """1 on generated tokens up to and including the first EOS (everything after it is padding)."""
    if eos_id is None:
        return torch.ones_like(responses, dtype=torch.float32)
    is_eos = responses == eos_id
    before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()  # number of EOS strictly before t
    return (before == 0).float()


@torch.no_grad()
def generate_rollouts(model, prompts: list[list[int]], group_size: int, max_new_tokens: int, eos_id: int | None,
                      pad_id: int, temperature: float = 1.0, top_p: float = 1.0, tokenizer=None,
                      top_k: int = 0, chunk: int = 0) -> Rollouts:
    """G samples per prompt from ``model`` (the frozen old policy: no gradient, eval mode), padding handled.
    ``top_k`` 0: no top-k cut (transformers' own default would be 50). ``chunk`` > 0: ``generate`` is called on
    max(1, chunk // G) prompts at a time (the KV cache holds about ``chunk`` sequences, not prompts · G); 0: all at
    once."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    was_training = model.training
    model.eval()
    import torch.distributed as dist

    synced = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    greedy = temperature == 0
    kwargs = (dict(do_sample=False) if greedy
              else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=int(top_k)))
    step = max(1, chunk // group_size) if chunk else len(prompts)
    parts = [model.generate(input_ids=ids[i:i + step], attention_mask=mask[i:i + step], max_new_tokens=max_new_tokens,
                            num_return_sequences=1 if greedy else group_size, pad_token_id=pad_id,
                            eos_token_id=eos_id, synced_gpus=synced, **kwargs) for i in range(0, len(prompts), step)]
    width = max(o.shape[1] for o in parts)  # chunks may stop at different lengths: right-pad to the longest
    out = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad_id) for o in parts])
    if greedy and group_size > 1:
        out = out.repeat_interleave(group_size, dim=0)
    model.train(was_training)
    P = ids.shape[1]
    resp = out[:, P:]
    rmask = response_mask_from(resp, eos_id)
    resp = torch.where(rmask.bool(), resp, torch.full_like(resp, pad_id))
    full_mask = torch.cat([mask.repeat_interleave(group_size, dim=0), rmask.long()], dim=1)
    completions = []
    if tokenizer is not None:
        completions = tokenizer.batch_decode([r[m.bool()] for r, m in zip(resp, rmask)], skip_special_tokens=True)
    return Rollouts(torch.cat([out[:, :P], resp], dim=1), full_mask, P, rmask, group_size, completions)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      n_response: int, temperature: float = 1.0, return_hidden: bool = False):
    """log π(y_t | x, y_<t) for response tokens t = 1..n_response, from a forward over ``[:, :P + n_response]``.

    Only the kept prefix is fed to the model, so compute and activation memory scale with P + n_response.
    ``return_hidden``: also the last layer's states over those columns, (rows, P + n_response, H).
    """
    end = prompt_len + n_response
    ids, mask = input_ids[:, :end], attention_mask[:, :end]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                logits_to_keep=n_response + 1, output_hidden_states=return_hidden)
    logits = out.logits[:, :-1].float()  # positions P-1 .. end-2 predict tokens P .. end-1
    if temperature and temperature != 1.0:
        logits = logits / temperature
    targets = ids[:, prompt_len:end]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logp, out.hidden_states[-1]) if return_hidden else logp


@torch.no_grad()
def batched_logprobs(model, ro: Rollouts, need: torch.Tensor, micro_batch_size: int, temperature: float = 1.0,
                     return_hidden: bool = False):
    """No-grad log-probs (N, T) of each row's first ``need[i]`` response tokens (zeros beyond), micro-batched
    with rows sorted by need so each forward is trimmed to its own longest prefix. ``return_hidden``: also the
    last layer's states (N, P+T, H) in the model's dtype, over the same columns (zeros beyond)."""
    N, T = ro.response_mask.shape
    # explicit dtype: Lightning's bf16-true sets the default dtype to bf16 around each step
    out = torch.zeros((N, T), dtype=torch.float32, device=ro.input_ids.device)
    hidden = None
    order = torch.argsort(need, stable=True)
    for chunk in torch.split(order, micro_batch_size):
        n = int(need[chunk].max())
        if n == 0:
            continue
        res = response_logprobs(model, ro.input_ids[chunk], ro.attention_mask[chunk], ro.prompt_len, n, temperature,
                                return_hidden)
        if return_hidden:
            res, h = res
            if hidden is None:
                hidden = h.new_zeros((N, ro.input_ids.shape[1], h.shape[-1]))
            hidden[chunk, :h.shape[1]] = h
        out[chunk, :n] = res.float()
    return (out, hidden) if return_hidden else out


def packed_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    kept: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`response_logprobs` for rows with their own kept lengths ``kept`` (R,), from ONE packed row.

    Returns log-probs (R, max kept), zero beyond each row's kept length, and that validity mask."""
    kept = kept.long()
    n = int(kept.max())
    ids, pos, keep_at, rows, cols = [], [], [], [], []
    offset = 0
    for i in range(input_ids.shape[0]):
        c = int(kept[i])
        if c == 0:
            continue
        seq = torch.cat([input_ids[i, :prompt_len][attention_mask[i, :prompt_len].bool()],
                         input_ids[i, prompt_len:prompt_len + c]])
        p = seq.numel() - c
        ids.append(seq)
        pos.append(torch.arange(seq.numel(), device=seq.device))
        keep_at.append(offset + p - 1 + torch.arange(c, device=seq.device))  # logits predicting response tokens
        rows.append(torch.full((c,), i, device=seq.device))
        cols.append(torch.arange(c, device=seq.device))
        offset += seq.numel()
    ids, keep_at = torch.cat(ids).unsqueeze(0), torch.cat(keep_at)
    out = model(input_ids=ids, position_ids=torch.cat(pos).unsqueeze(0), attention_mask=None, use_cache=False,
                logits_to_keep=keep_at)
    logits = out.logits[0].float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    flat = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, keep_at + 1].unsqueeze(-1)).squeeze(-1)
    rows, cols = torch.cat(rows), torch.cat(cols)
    logp = torch.zeros((input_ids.shape[0], n), device=flat.device, dtype=flat.dtype).index_put((rows, cols), flat)
    valid = torch.zeros_like(logp, dtype=torch.bool).index_put((rows, cols), torch.ones_like(flat, dtype=torch.bool))
    return logp, valid
