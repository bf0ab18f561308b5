"""InstEmb (issue 20): instruction-following embeddings from a causal LM by look-ahead distillation, multi-view
contrast and DAAP pooling (../shared/papers/instemb.md).

One ``training_step`` on a batch of (instruction, input, gold output) triples:

- **Student** input ``[prompt, EOS, LA_1..LA_T]``: the prompt is ``template`` (InBedder's), the T = ``n_lookahead``
  look-ahead vectors are a learned (T, d) parameter fed through ``inputs_embeds`` (``lookahead_init``: the EOS
  embedding | random). Rows are left-padded, so EOS and the look-ahead slots sit at the same columns in every row.
- **Teacher**: the frozen start weights on ``[prompt, EOS, gold output cut to T tokens]`` (right-padded after EOS).
  ``finetune: lora``: the same model with its adapters disabled (no copy); ``full``: a frozen copy kept outside the
  module tree (so it is neither optimised nor checkpointed), which also embeds the teacher's tokens: under full
  fine-tuning the student's embedding table trains, and embedding with it would move the distillation target
  (issue 40).
- **Distillation** at ``distill_layer``: ``mse`` on hidden states | ``kl`` (teacher ‖ student LM-head
  distributions; last layer only) | ``ce`` (the gold token the aligned teacher state predicts) | ``none``.
  ``align``: ``same_position`` (LA_t ↔ the teacher's state on gold token t) | ``shifted`` (LA_t ↔ the state that
  predicts gold token t). Slots past a short gold output are masked.
- **Contrast**: SupCon (multi-positive InfoNCE, temperature τ) over the last-input-token (EOS) states of ``views``:
  ``s1`` (the student pass above), ``s2`` (a second student pass: another dropout mask), ``teacher_input``,
  ``student_output`` (the student on the gold output alone + EOS); other examples are negatives.
- Loss = L_distill + ``lambda_con`` · L_con.

``objective: inbedder`` is the main table's baseline (the paper's "InBedder re-implementation", 59.90 against
InstEmb's 67.08), written from InBedder's release (zhang-yu-wei/InBedder: Alpaca-style SFT on its abstractive-QA
set, embeddings from ``CausalLMEncoder``): the prompt is the template alone (no EOS: the model answers after
"### Response:"), the loss is the cross-entropy of the gold output + EOS given it (prompt tokens unscored), and the
embedding is the last layer's state on the prompt's last token (``pooling: last``; the release's recommended
``fst_gen_layer_<last>``: the state that generates the first answer token, so one prefill, no decoding). No
teacher, look-ahead or contrast: it needs ``n_lookahead: 0``, ``distill: none``, ``lambda_con: 0``
(``conf/model/instemb_inbedder.yaml`` sets them; the release fine-tunes in full, ``finetune: full``, and then no
teacher copy is kept).

Embedding (``encode(texts, instructions)``: one prefill per batch, no decoding) by ``pooling``: ``daap``
(:func:`lightning_modules.common.embedding.daap` of the EOS state and the mean look-ahead state) | ``last`` (EOS
state) | ``lookahead`` (mean look-ahead state) | ``mean`` (all kept positions). Validation / test embed each
held-out object under every instruction: retrieval nDCG@k (relevant = objects sharing the asked value) and
k-means V-measure against the asked attribute, per instruction and averaged.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from lightning_modules.common.embedding import cosine_scores, daap, kmeans_v_measure, ndcg_at_k, pool
from lightning_modules.common.lm import CausalLMModule, _plain

DISTILLS = ("mse", "kl", "ce", "none")
ALIGNS = ("same_position", "shifted")
POOLINGS = ("daap", "last", "lookahead", "mean")
VIEWS = ("s1", "s2", "teacher_input", "student_output")
FINETUNES = ("lora", "full")
OBJECTIVES = ("instemb", "inbedder")
INITS = ("eos", "random")
LORA_DEFAULTS = {"r": 16, "alpha": 32, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
EVAL_DEFAULTS = {"k": 10, "batch_size": 64, "seed": 0}


def supcon(z: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised-contrastive (multi-positive InfoNCE) loss: (M, d) embeddings, (M,) example ids; every other
    row with the same id is a positive, the rest negatives; −1/|P(i)| Σ_p log softmax_{a≠i}(z_i·z_a/τ)_p averaged
    over anchors with a positive."""
    z = F.normalize(z.float(), dim=-1)
    sim = z @ z.T / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logp = sim.masked_fill(eye, float("-inf")).log_softmax(1)
    pos = (labels[:, None] == labels[None]) & ~eye
    n_pos = pos.sum(1)
    per = -logp.masked_fill(~pos, 0).sum(1) / n_pos.clamp_min(1)
    return per[n_pos > 0].mean()


def instruction_metrics(encoder, items: Sequence[dict], attributes: Mapping[str, str], k: int = 10,
                        seed: int = 0) -> dict[str, float]:
    """Embed every item's ``input`` under each attribute's instruction: nDCG@k of ranking the other items
    (relevant = same value of that attribute) and k-means V-measure against it, per attribute and averaged."""
    out = {}
    texts = [it["input"] for it in items]
    for a, question in attributes.items():
        e = encoder.encode(texts, question)
        values = [it[a] for it in items]
        rel = torch.tensor([[float(u == v) for v in values] for u in values])
        scores = cosine_scores(e, e)
        eye = torch.eye(len(items), dtype=torch.bool)
        scores, rel = scores.masked_fill(eye, float("-inf")), rel.masked_fill(eye, 0.0)
        out[f"ndcg@{k}_{a}"] = float(ndcg_at_k(scores, rel, k).mean())
        out[f"v_measure_{a}"] = kmeans_v_measure(e, values, seed=seed)
    for m in (f"ndcg@{k}", "v_measure"):
        out[m] = sum(out[f"{m}_{a}"] for a in attributes) / len(attributes)
    return out


class InstEmbModule(CausalLMModule):
    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None, scheduler: Callable | None = None,
                 weight_decay: float = 0.0, n_lookahead: int = 8, lookahead_init: str = "eos", finetune: str = "lora",
                 lora: Mapping | None = None, attention_dropout: float = 0.0, distill: str = "mse",
                 distill_layer: int = -1, align: str = "same_position", views: Sequence[str] = VIEWS,
                 lambda_con: float = 1.0, temperature: float = 0.05, pooling: str = "daap",
                 daap_normalize: str = "each", template: str | None = None, max_length: int = 512,
                 warmup: Mapping | None = None, eval: Mapping | None = None, objective: str = "instemb"):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        from lightning_modules.instemb.data import INBEDDER
        from lightning_modules.common.embedding import DAAP_NORMALIZE

        views = list(views)
        for name, value, allowed in [("model.distill", distill, DISTILLS), ("model.align", align, ALIGNS),
                                     ("model.pooling", pooling, POOLINGS), ("model.finetune", finetune, FINETUNES),
                                     ("model.lookahead_init", lookahead_init, INITS),
                                     ("model.objective", objective, OBJECTIVES),
                                     ("model.daap_normalize", daap_normalize, DAAP_NORMALIZE)]:
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")
        for v in views:
            if v not in VIEWS:
                raise ValueError(f"model.views has {v!r}: choose from {', '.join(VIEWS)}")
        if objective == "inbedder" and (n_lookahead or distill != "none" or lambda_con):
            raise ValueError("model.objective=inbedder trains the answer cross-entropy alone: set model.n_lookahead=0, "
                             "model.distill=none, model.lambda_con=0 (model=instemb_inbedder does)")
        self.objective = objective
        self.lora = {**LORA_DEFAULTS, **_plain(lora or {})} if finetune == "lora" else None
        lora_dropout = float(self.lora["dropout"]) if self.lora else 0.0
        if lambda_con and "s2" in views and lora_dropout == 0 and attention_dropout == 0:
            raise ValueError("model.views has s2 but nothing drops out (LLaMA's only dropout is attention_dropout, 0 "
                             "here): set model.lora.dropout or model.attention_dropout > 0, or drop s2 from views")
        if distill == "kl" and distill_layer != -1:
            raise ValueError(f"model.distill=kl compares LM-head distributions: distill_layer must be -1, not {distill_layer}")
        if n_lookahead < 0:
            raise ValueError(f"model.n_lookahead={n_lookahead} must be >= 0")
        if n_lookahead == 0 and pooling in ("daap", "lookahead"):
            raise ValueError(f"model.pooling={pooling} needs look-ahead tokens: set n_lookahead > 0 or pooling=last")
        if n_lookahead == 0 and distill != "none":
            raise ValueError("model.n_lookahead=0 leaves nothing to distil into: set model.distill=none")
        if temperature <= 0:
            raise ValueError(f"model.temperature={temperature} must be > 0")
        self.T, self.lookahead_init, self.finetune, self.attention_dropout = n_lookahead, lookahead_init, finetune, attention_dropout
        self.distill, self.distill_layer, self.align, self.views = distill, distill_layer, align, views
        self.lambda_con, self.temperature, self.pooling, self.daap_normalize = lambda_con, temperature, pooling, daap_normalize
        self.template, self.max_length = template or INBEDDER, max_length
        self.warmup = _plain(warmup) if warmup else None
        self.eval_cfg = {**EVAL_DEFAULTS, **_plain(eval or {})}
        self.hparams["lora"], self.hparams["warmup"] = self.lora, self.warmup
        self.lookahead: torch.nn.Parameter | None = None
        self._teacher: list = []  # full fine-tuning's frozen copy, in a list so it is no submodule
        self.tokenizer = None
        self.results: dict[str, Any] = {}

    # --- model -----------------------------------------------------------------------------------
    def held_out_fractions(self) -> dict[str, float]:
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return {k: float(getattr(dm, k)) for k in ("val_fraction", "test_fraction") if hasattr(dm, k)}

    def get_tokenizer(self):
        if self.tokenizer is None:
            from datamodules.common.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(pretrained=self.backbone_spec.get("pretrained"))
        return self.tokenizer

    def build_model(self):
        from lightning_modules.common.backbone import build_backbone

        spec = dict(self.backbone_spec)
        if self.warmup:  # the instruction follower InstEmb starts from: a cached warm-up on the train objects only
            import lightning_modules.instemb.data  # noqa: F401  (registers the warm-up task)
            from lightning_modules.common.rl.warmup import warmup_dir

            eos = self.get_tokenizer().eos_token
            spec["pretrained"] = str(warmup_dir(spec, {**self.warmup, "eos_text": eos, **self.held_out_fractions()}))
        model = build_backbone(spec)
        if self.attention_dropout:  # the attention modules read it at construction: set it on each
            model.config.attention_dropout = self.attention_dropout
            for m in model.modules():
                if hasattr(m, "attention_dropout") and isinstance(getattr(m, "attention_dropout"), float):
                    m.attention_dropout = self.attention_dropout
        if self.finetune == "full":
            if self.objective == "instemb":  # InBedder has no teacher
                self._teacher = [copy.deepcopy(model).eval().requires_grad_(False)]
        else:
            from lightning_modules.common.lora import apply_lora

            model = apply_lora(model, **self.lora)
        return model

    def configure_model(self) -> None:
        super().configure_model()
        if self.lookahead is None and self.T > 0:
            emb = self.model.get_input_embeddings().weight
            if self.lookahead_init == "eos":
                init = emb[self.get_tokenizer().eos_token_id].detach().float().repeat(self.T, 1)
            else:
                init = torch.randn(self.T, emb.shape[1]) * emb.detach().float().std()
            self.lookahead = torch.nn.Parameter(init.to(emb.device, emb.dtype))

    def teacher_forward(self, **kw):
        """The frozen start weights: adapters disabled (lora) or the frozen copy (full); eval mode, no grad."""
        with torch.no_grad():
            if self.finetune == "full":
                t = self._teacher[0].to(self.device)
                return t(**kw)
            was = self.model.training
            self.model.eval()
            try:
                with self.model.disable_adapter():
                    return self.model(**kw)
            finally:
                self.model.train(was)

    # --- inputs ----------------------------------------------------------------------------------
    def prompt_ids(self, instruction: str, text: str) -> list[int]:
        """The templated prompt's tokens + EOS (InBedder: no EOS), cut from the left to fit ``max_length``."""
        from lightning_modules.instemb.data import prompt_text

        tok = self.get_tokenizer()
        ids = tok(prompt_text(instruction, text, self.template), add_special_tokens=False)["input_ids"]
        if self.objective == "inbedder":
            return ids[-self.max_length:]
        return ids[-(self.max_length - 1):] + [tok.eos_token_id]

    def _left(self, rows: list[list[int]]):
        w = max(map(len, rows))
        pad = self.get_tokenizer().pad_token_id
        ids = torch.tensor([[pad] * (w - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (w - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return ids, mask

    def teacher_embeddings(self) -> torch.nn.Module:
        """The teacher's (frozen) token embeddings: the copy's under full fine-tuning, else the base model's."""
        return (self._teacher[0].to(self.device) if self.finetune == "full" else self.model).get_input_embeddings()

    def _run(self, ids, mask, tail=None, tail_mask=None, teacher: bool = False):
        """Forward on embedded ``ids`` (+ ``tail`` (N, T, d) vectors) with positions from the mask; the teacher
        embeds with its own frozen table."""
        with torch.no_grad() if teacher else contextlib.nullcontext():
            emb = (self.teacher_embeddings() if teacher else self.model.get_input_embeddings())(ids)
        if tail is not None:
            emb = torch.cat([emb, tail.to(emb.dtype)], 1)
            mask = torch.cat([mask, tail_mask], 1)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        kw = dict(inputs_embeds=emb, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False)
        return self.teacher_forward(**kw) if teacher else self.model(**kw), mask

    def student(self, rows: list[list[int]], lookahead: bool = True):
        ids, mask = self._left(rows)
        if not lookahead or self.T == 0:
            return self._run(ids, mask)[0], ids.shape[1]
        n = ids.shape[0]
        tail = self.lookahead.unsqueeze(0).expand(n, -1, -1)
        out, _ = self._run(ids, mask, tail, torch.ones(n, self.T, dtype=mask.dtype, device=mask.device))
        return out, ids.shape[1]

    def teacher(self, rows: list[list[int]], gold: list[list[int]]):
        """Teacher pass on [prompt, EOS, gold[:T]]; returns (output, W, (N, T+?) gold ids, gold mask)."""
        ids, mask = self._left(rows)
        pad = self.get_tokenizer().pad_token_id
        g = [r[:self.T] for r in gold]
        gids = torch.tensor([r + [pad] * (self.T - len(r)) for r in g], device=self.device)
        gmask = torch.tensor([[1] * len(r) + [0] * (self.T - len(r)) for r in g], device=self.device)
        with torch.no_grad():
            tail = self.teacher_embeddings()(gids)
        out, _ = self._run(ids, mask, tail, gmask, teacher=True)
        return out, ids.shape[1], gids, gmask

    # --- losses ----------------------------------------------------------------------------------
    def distill_loss(self, s_out, t_out, W: int, gids, gmask) -> torch.Tensor:
        """Student LA_t (column W + t) against the teacher's column W + t (same_position) or W + t − 1 (shifted)."""
        T = self.T
        cols = torch.arange(T, device=gids.device) + W - int(self.align == "shifted")
        valid = gmask.bool()  # gold token t exists (shifted: the state predicting it exists too)
        if self.distill == "mse":
            hs = s_out.hidden_states[self.distill_layer][:, W:W + T].float()
            ht = t_out.hidden_states[self.distill_layer][:, cols].float()
            per = ((hs - ht) ** 2).mean(-1)
        elif self.distill == "kl":
            ls = s_out.logits[:, W:W + T].float().log_softmax(-1)
            lt = t_out.logits[:, cols].float().log_softmax(-1)
            per = (lt.exp() * (lt - ls)).sum(-1)
        else:  # ce: the token the aligned teacher state predicts (the next teacher column's token)
            full = torch.cat([torch.zeros_like(gids[:, :1]), gids], 1)  # column W - 1 + j holds full[:, j]
            fmask = torch.cat([torch.ones_like(gmask[:, :1]), gmask], 1)
            nxt = cols - (W - 1) + 1
            ok = nxt < full.shape[1]
            tgt = full[:, nxt.clamp_max(full.shape[1] - 1)]
            valid = valid & ok & fmask[:, nxt.clamp_max(full.shape[1] - 1)].bool()
            per = F.cross_entropy(s_out.logits[:, W:W + T].float().flatten(0, 1), tgt.flatten(), reduction="none").view_as(tgt)
        return (per * valid).sum() / valid.sum().clamp_min(1)

    def contrast_loss(self, rows, gold, s_out, t_out, W: int) -> torch.Tensor:
        tok = self.get_tokenizer()
        z = []
        for v in self.views:
            if v == "s1":
                z.append(s_out.hidden_states[-1][:, W - 1])
            elif v == "s2":
                z.append(self.student(rows, lookahead=False)[0].hidden_states[-1][:, -1])
            elif v == "teacher_input":
                z.append(t_out.hidden_states[-1][:, W - 1])
            else:
                out_rows = [g[:self.max_length - 1] + [tok.eos_token_id] for g in gold]
                z.append(self.student(out_rows, lookahead=False)[0].hidden_states[-1][:, -1])
        n = len(rows)
        labels = torch.arange(n, device=self.device).repeat(len(z))
        return supcon(torch.cat(z), labels, self.temperature)

    def answer_loss(self, rows: list[list[int]], gold: list[list[int]]) -> torch.Tensor:
        """InBedder's SFT loss: mean cross-entropy over the gold output + EOS tokens given the prompt (left-padded
        rows [prompt, output, EOS]; the prompt is cut from the left so the whole row fits ``max_length``)."""
        eos = self.get_tokenizer().eos_token_id
        answers = [g[:self.max_length - 1] + [eos] for g in gold]
        full = [r[max(0, len(r) - (self.max_length - len(a))):] + a for r, a in zip(rows, answers)]
        ids, mask = self._left(full)
        out, _ = self._run(ids, mask)
        target = torch.full_like(ids, -100)
        for i, a in enumerate(answers):
            target[i, ids.shape[1] - len(a):] = ids[i, ids.shape[1] - len(a):]
        return F.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), target[:, 1:].flatten())

    def compute_loss(self, batch: list[dict]) -> torch.Tensor:
        tok = self.get_tokenizer()
        if self.objective == "inbedder":
            rows = [self.prompt_ids(b["instruction"], b["input"]) for b in batch]
            loss = self.answer_loss(rows, [tok(b["output"], add_special_tokens=False)["input_ids"] for b in batch])
            if self._trainer is not None:
                self.log("train/answer_ce", float(loss.detach()), on_step=True, on_epoch=False, batch_size=len(batch))
            return loss
        rows = [self.prompt_ids(b["instruction"], b["input"]) for b in batch]
        gold = [tok(b["output"], add_special_tokens=False)["input_ids"] for b in batch]
        s_out, W = self.student(rows)
        need_teacher = self.distill != "none" or (self.lambda_con and "teacher_input" in self.views)
        t_out = self.teacher(rows, gold) if need_teacher else None
        loss = torch.zeros((), device=self.device)
        logs = {}
        if self.distill != "none":
            out, Wt, gids, gmask = t_out
            assert Wt == W
            ld = self.distill_loss(s_out, out, W, gids, gmask)
            loss, logs["train/distill"] = loss + ld, float(ld.detach())
        if self.lambda_con:
            lc = self.contrast_loss(rows, gold, s_out, t_out[0] if t_out else None, W)
            loss, logs["train/contrast"] = loss + self.lambda_con * lc, float(lc.detach())
        if self._trainer is not None:
            self.log_dict(logs, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    # --- embedding -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, texts: Sequence[str], instructions: Sequence[str] | str | None = None,
               pooling: str | None = None) -> torch.Tensor:
        """(N, d) float32 on CPU: one prefill per batch of ``eval.batch_size`` texts, pooled by ``pooling``."""
        how = pooling or self.pooling
        if how not in POOLINGS:
            raise ValueError(f"pooling={how!r}: choose one of {', '.join(POOLINGS)}")
        if how in ("daap", "lookahead") and self.T == 0:
            raise ValueError(f"pooling={how} needs look-ahead tokens (n_lookahead > 0)")
        if isinstance(instructions, str) or instructions is None:
            instructions = [instructions or ""] * len(texts)
        if len(instructions) != len(texts):
            raise ValueError(f"encode: {len(instructions)} instructions for {len(texts)} texts")
        was = self.model.training
        self.model.eval()
        out, bs = [], int(self.eval_cfg["batch_size"])
        try:
            for i in range(0, len(texts), bs):
                rows = [self.prompt_ids(q, t) for q, t in zip(instructions[i:i + bs], texts[i:i + bs])]
                res, W = self.student(rows, lookahead=self.T > 0)
                h = res.hidden_states[-1].float()
                last, la = h[:, W - 1], h[:, W:]
                if how == "daap":
                    e = daap(last, la, self.daap_normalize)
                elif how == "last":
                    e = last
                elif how == "lookahead":
                    e = la.mean(1)
                else:
                    ids, mask = self._left(rows)
                    full = torch.cat([mask, torch.ones(len(rows), h.shape[1] - W, dtype=mask.dtype, device=mask.device)], 1)
                    e = pool(h, full, "mean")
                out.append(e.cpu())
        finally:
            self.model.train(was)
        return torch.cat(out)

    # --- evaluation ------------------------------------------------------------------------------
    def _evaluate(self, items: list[dict], prefix: str):
        from lightning_modules.instemb.data import ATTRIBUTES

        m = instruction_metrics(self, items, ATTRIBUTES, int(self.eval_cfg["k"]), int(self.eval_cfg["seed"]))
        for k, v in m.items():
            self.log(f"{prefix}/{k}", v, prog_bar=k in (f"ndcg@{self.eval_cfg['k']}", "v_measure"), sync_dist=False,
                     batch_size=1)
        self.results[prefix] = m

    def on_validation_epoch_start(self):
        pass

    def validation_step(self, batch: list[dict], batch_idx):
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self):
        pass

    def on_test_epoch_start(self):
        pass

    def test_step(self, batch: list[dict], batch_idx):
        self._evaluate(batch, "test")

    def on_test_epoch_end(self):
        pass
