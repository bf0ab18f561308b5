"""Masked diffusion LMs on the rule-induction studies of "Masks Can Be Distracting" (arXiv 2511.21338).

- ``MDLMModule``: a ``MaskedDiffusionLM`` (``common/diffusion.py``) trained with LLaDA's loss (``mdlm_tiny`` pretrains
  tiny-mdlm on the suite) and evaluated by the studies; a backbone without ``diffusion`` is a causal control, scored
  on the next token after ``Answer:[``.
- ``MaskAgnosticModule`` (``finetune.py``): the paper's fine-tune with the mask-agnostic loss (``loss.py``), LoRA
  and the max_masks curriculum; ``beta: 0`` is the CE-only ablation. (Kept apart: this file is in tiny-mdlm's
  cache key, the fine-tune is not.)

The studies (validation: ``val/accuracy`` at k = 0; test: the grid; accuracies in percent). Each query reads ``... Answer:[<mask>].`` plus
``k`` appended masks (``filler: period``: " ." k times instead); the first mask is read greedily after
``eval_steps`` denoising steps (1: one forward pass; 40: LLaDA's low-confidence unmasking of every mask). Logged:
``test/acc/d<distance>/k<k>`` (``drand``: random placement), ``test/acc/k<k>`` (over distances), ``test/accuracy``
(k = ks[0]), ``test/mask_tax`` (accuracy at ks[0] minus at ks[-1]) and with ``grad_share``
``test/mask_grad_share/k<k>``: the appended masks' share of the input-embedding gradient norm of the answer's
log-probability (the paper's attribution study). ``results`` holds the grid.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch

from lightning_modules.common.backbone import build_backbone, count_parameters
from lightning_modules.common.diffusion import RANDOM_LENGTH_PROB, MaskedDiffusionLM, build_diffusion_backbone
from lightning_modules.common.lm import CausalLMModule

FILLERS = ("mask", "period")


class MDLMModule(CausalLMModule):
    """LLaDA-loss training and the mask-distraction / locality studies.

    Args:
        backbone: a spec with ``diffusion: {mask_token_id, logit_shift}`` (tiny_mdlm, llada_8b, dream_7b); without
            it the backbone is a causal control (next-token scoring; no training here).
        ks: numbers of appended masks the test grid runs (paper 0..128; tiny 0, 8, 32, 64).
        filler: ``mask`` or ``period`` (" ." instead of each appended mask).
        eval_steps: denoising steps before reading the answer (1 or 40).
        grad_share: also measure the masks' input-gradient share at each k.
        eps: LLaDA's minimum masking probability.
        random_length_prob: the share of training batches cut to a random length in [1, L] before the loss
            (``common/diffusion.random_length``): LLaDA's pretraining 0.01, the default here (training with LLaDA's
            loss is pretraining); 0 turns it off (``mdlm_tiny``; LLaDA's SFT). Evaluation never cuts.
    """

    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0, ks: Sequence[int] = (0,),
                 filler: str = "mask", eval_steps: int = 1, grad_share: bool = False, eps: float = 1e-3,
                 random_length_prob: float = RANDOM_LENGTH_PROB):
        super().__init__(backbone=backbone, optimizer=optimizer, scheduler=scheduler, weight_decay=weight_decay)
        if filler not in FILLERS:
            raise ValueError(f"model.filler={filler!r}: choose mask or period")
        if eval_steps < 1:
            raise ValueError(f"model.eval_steps={eval_steps}: at least 1 (the paper reads after 1 or 40 steps)")
        if not 0 <= random_length_prob <= 1:
            raise ValueError(f"model.random_length_prob={random_length_prob}: a probability in [0, 1] (LLaDA's "
                             "pretraining 0.01; 0 = off)")
        self.ks, self.filler, self.eval_steps, self.grad_share, self.eps = list(ks), filler, eval_steps, grad_share, eps
        self.random_length_prob = random_length_prob
        self.causal = not (self.backbone_spec.get("diffusion") or {}).get("mask_token_id") is not None
        self.rows: list[dict] = []
        self.results: dict = {}

    # --- model ---------------------------------------------------------------------------------------------------
    def build_model(self):
        return build_backbone(self.backbone_spec) if self.causal else build_diffusion_backbone(self.backbone_spec)

    def export_model(self):
        """The plain transformers model (adapters merged) that ``ExportPretrained`` saves."""
        from lightning_modules.common.lora import merge_lora

        inner = self.model.model if isinstance(self.model, MaskedDiffusionLM) else self.model
        return merge_lora(inner)

    def parameter_counts(self) -> dict[str, int]:
        if self.model is None:
            return {}
        inner = self.model.model if isinstance(self.model, MaskedDiffusionLM) else self.model
        return {"params/total": count_parameters(inner),
                "params/trainable": sum(p.numel() for p in inner.parameters() if p.requires_grad)}

    def _tokenizer(self):
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or getattr(dm, "tokenizer", None) is None:
            raise ValueError(f"{type(self).__name__} needs a datamodule with a tokenizer (data=rule_induction)")
        return dm.tokenizer

    def setup(self, stage: str) -> None:
        if self.causal:
            if stage == "fit":
                raise ValueError("a causal backbone cannot be trained as a masked diffusion LM: choose a backbone with "
                                 "diffusion: {mask_token_id} (tiny_mdlm, llada_8b, dream_7b), or task=test for the "
                                 "causal control")
            return
        tok = self._tokenizer()
        want = self.backbone_spec["diffusion"]["mask_token_id"]
        if getattr(tok, "mask_token_id", None) != want:
            raise ValueError(f"the tokenizer's mask token id {getattr(tok, 'mask_token_id', None)} is not "
                             f"backbone.diffusion.mask_token_id={want}: use the backbone's own tokenizer")

    # --- training ------------------------------------------------------------------------------------------------
    def compute_loss(self, batch) -> torch.Tensor:
        return self.model.loss(batch["input_ids"], batch.get("prompt_mask"), eps=self.eps,
                               random_length_prob=self.random_length_prob)

    # --- the studies ---------------------------------------------------------------------------------------------
    def study_input(self, prompt_ids: list[int], k: int) -> tuple[list[int], int, list[int]]:
        """(ids, answer position, positions of the k appended fillers): ``prompt [MASK] ] . filler*k``."""
        tok = self._tokenizer()
        close = tok("].", add_special_tokens=False)["input_ids"]
        filler = [tok.mask_token_id] if self.filler == "mask" else tok(" .", add_special_tokens=False)["input_ids"]
        ids = list(prompt_ids) + [tok.mask_token_id] + close
        start = len(ids)
        ids += filler * k
        return ids, len(prompt_ids), list(range(start, len(ids)))

    @torch.no_grad()
    def answer_of(self, ids: list[int], pos: int) -> int:
        """The greedy answer at ``pos`` after ``eval_steps`` denoising steps (or the causal next token)."""
        x = torch.tensor([ids], device=self.device)
        if self.causal:
            return int(self.model(input_ids=x[:, :pos], use_cache=False).logits[0, -1].argmax())
        if self.eval_steps > 1:
            n_masks = int((x == self.model.mask_token_id).sum())
            x = self.model.denoise(x, min(self.eval_steps, n_masks))
            return int(x[0, pos])
        return int(self.model.logits(x)[0, pos].argmax())

    def mask_gradient_share(self, ids: list[int], pos: int, fillers: list[int]) -> float:
        """Share of the input-embedding gradient norm (of the greedy answer's log-prob at ``pos``) on the fillers."""
        if not fillers:
            return 0.0
        with torch.inference_mode(False), torch.enable_grad():
            inner = self.model.model
            x = torch.tensor([ids], device=self.device)
            emb = inner.get_input_embeddings()(x).detach().clone().requires_grad_(True)
            logp = torch.log_softmax(self.model.logits(inputs_embeds=emb)[0, pos].float(), -1)
            logp.max().backward()
            norms = emb.grad[0].norm(dim=-1)
        inner.zero_grad(set_to_none=True)
        return float(norms[fillers].sum() / norms.sum().clamp_min(1e-30))

    def on_validation_epoch_start(self):
        self.rows = []
        self.model.eval()

    def validation_step(self, q, batch_idx):
        ids, pos, _ = self.study_input(q["prompt_ids"], 0)
        self.rows.append({"correct": float(self.answer_of(ids, pos) == q["answer_id"])})

    def on_validation_epoch_end(self):
        if self.rows:
            self.log("val/accuracy", 100 * sum(r["correct"] for r in self.rows) / len(self.rows), prog_bar=True)
        self.model.train(self.training)

    def on_test_epoch_start(self):
        self.rows = []
        self.model.eval()

    def test_step(self, q, batch_idx):
        for k in self.ks:
            ids, pos, fillers = self.study_input(q["prompt_ids"], k)
            row = {"query": batch_idx, "task": q["task"], "distance": int(q["distance"]), "k": k,
                   "correct": float(self.answer_of(ids, pos) == q["answer_id"])}
            if self.grad_share and not self.causal:
                row["grad_share"] = self.mask_gradient_share(ids, pos, fillers)
            self.rows.append(row)

    def on_test_epoch_end(self):
        if not self.rows:
            return
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        dname = lambda d: "rand" if d < 0 else str(d)  # noqa: E731
        grid, per_k, share = defaultdict(list), defaultdict(list), defaultdict(list)
        for r in self.rows:
            grid[(dname(r["distance"]), r["k"])].append(r["correct"])
            per_k[r["k"]].append(r["correct"])
            if "grad_share" in r:
                share[r["k"]].append(r["grad_share"])
        acc_grid = {f"d{d}/k{k}": 100 * mean(v) for (d, k), v in sorted(grid.items())}
        acc_k = {k: 100 * mean(v) for k, v in sorted(per_k.items())}
        for name, v in acc_grid.items():
            self.log(f"test/acc/{name}", v)
        for k, v in acc_k.items():
            self.log(f"test/acc/k{k}", v)
        self.log("test/accuracy", acc_k[self.ks[0]])
        self.log("test/mask_tax", acc_k[self.ks[0]] - acc_k[self.ks[-1]])
        for k, v in share.items():
            self.log(f"test/mask_grad_share/k{k}", mean(v))
        per_task = defaultdict(list)
        for r in self.rows:
            if r["k"] == self.ks[0]:
                per_task[r["task"]].append(r["correct"])
        self.results = {"accuracy_grid": acc_grid, "accuracy_per_k": {str(k): v for k, v in acc_k.items()},
                        "mask_grad_share": {str(k): mean(v) for k, v in share.items()},
                        "accuracy_per_task": {t: 100 * mean(v) for t, v in sorted(per_task.items())},
                        "filler": self.filler, "eval_steps": self.eval_steps, "n_queries": len(per_task) and
                        sum(len(v) for v in per_task.values()),
                        # per query and k, for paired comparisons across k and across arms (same test queries)
                        "rows": [{k: r[k] for k in ("query", "distance", "k", "correct")} for r in self.rows]}
        from lightning_modules.common.dashboard import log_table

        log_table("mdlm/accuracy", [{"distance": c.split("/")[0][1:], "k": int(c.split("/")[1][1:]), "accuracy": a}
                                    for c, a in acc_grid.items()], self.loggers)

