"""DLLMQuant on a masked diffusion LM (``common/diffusion.py``): TMAS calibration, CGQ weights on the shared driver,
IA-AQ values, W4A4 through fake quantization, and the diffusion-specific evaluation.

``quantize``: (1) IA-AQ's per-layer clip search for V on the calibration states (FP model); (2) the driver
(``common/quantize/driver.py``) quantizes every block's linear weights at ``rate`` bits with the chosen quantizer
(``model/quantizer=gptq|awq|rtn``: ``base``), reading ``batch["token_weight"]`` = CGQ's c_j when ``cgq.enabled``
(else 1 on real tokens); (3) with ``a_bits`` < 16 every linear's input is fake-quantized per token
(``fake_quant.quantize_model`` with w_bits 16, group −1; AWQ's scales are folded into the model by ``AWQ.prepare``
before (1), so that quantizer sees x/s; under ``search: layer`` s reaches it as ``input_scale``);
(4) with ``v_bits`` < 16 V is quantized per token and head, at the searched α (IA-AQ) or α = 1 (plain absmax).

Calibration (``calib``): ``text`` = generic text, as the text baselines' releases calibrate (GPTQ: random
``calib_seq_len``-token windows of WikiText-2 or C4; AWQ: of the Pile): ``n_calib`` windows of ``calib_text_files``
(local .txt / .jsonl / .parquet, field ``calib_text_field``; the documents joined by blank lines, windows at seeded
random offsets, as GPTQ's ``get_wikitext2``), never the evaluation problems (issue 40). Without ``calib_text_files``
(tiny-mdlm, whose closed word vocabulary reads no WikiText) the stand-in is the clean question + solution
sequences of calibration problems drawn apart from the test ones. ``uniform`` = FP-sampler trajectory states on
calibration prompts drawn uniformly; ``tmas`` = the same states drawn by stage (``tmas.proportions``,
``tmas.stage_by``). ``n_calib`` sequences in all, from ``n_prompts`` problems: ``calib_files`` (GSM8K's train split
at paper scale) or, without it, a disjoint half of ``task_files`` (then only the other half is tested).

Calibration batches never pad: the bidirectional core takes no attention mask (LLaDA attends to its EOS padding in
training), so an EOS-padded row's real tokens would attend to its pads and shift its statistics. Sequences are
batched by length instead (issue 40), so every row's statistics are those of the row alone.

The task: arithmetic problems of the RL core (``datamodules.verifiable.arithmetic_problem``; calibration and test
problems from disjoint seeds), rendered as the tiny-mdlm pretraining saw them (``question\\n`` then the solution),
or GSM8K-style records from ``task_files``: ``n_test`` of them (null = every record: GSM8K's 1,319 at paper scale,
whose claim is a > 10-point margin; 200 problems would leave a 3.5-point standard error).
Test (all in ``on_test_epoch_end``; the datamodule's own test queries are ignored): ``test/accuracy`` (the sampled
answer's number after "####" equals the reference's, quantized model) and ``test/accuracy_fp``; ``test/kl_bits/r<ratio>`` = KL(FP ‖ Q) in bits
per masked position when a random share ``ratio`` of the answer is masked; ``test/kl_step/<i>`` along the FP
sampler's trajectory, with ``test/kl_growth`` (least-squares slope, bits per step) and ``test/kl_traj`` (mean);
``quant/packed_bytes`` (codes + row scales at the nominal rate; speed only by ``benchmarks/kernels.py`` on a GPU)
and ``quant/time_s``. With ``export_packed`` (W4A16 only: a_bits = v_bits = 16) the weights are really packed to 4
bits (``common/quantize/export.py``), the evaluation runs the packed model and ``quant/bytes_memory``,
``quant/bytes_disk`` report it.
"""
from __future__ import annotations

import copy
import random
import re
import time
from typing import Any, Mapping, Sequence

import torch

from lightning_modules.common.diffusion import MaskedDiffusionLM, build_diffusion_backbone
from lightning_modules.common.evaluation import LN2
from lightning_modules.common.quantize.driver import quantize_model
from lightning_modules.common.quantize.module import QuantizeLMModule
from lightning_modules.dllmquant import cgq as _cgq, iaaq as _iaaq, tmas as _tmas

CALIB = ("text", "uniform", "tmas")


class DLLMQuantModule(QuantizeLMModule):
    """Args (beyond ``QuantizeLMModule``'s; ``rate`` = weight bits):
        a_bits: activation bits of every linear input (16 = weight-only, W4A16).
        v_bits: bits of V (null = a_bits).
        calib: text | uniform | tmas.
        n_prompts: calibration problems whose FP trajectories are recorded.
        tmas: {proportions: [0.3, 0.2, 0.2, 0.3], stage_by: mask_ratio | step}.
        cgq: {enabled, w_mask: 1.0, w_unmask: 0.7, score_fn: none | confidence}.
        iaaq: {enabled, grid: 40, min_ratio: 0.05, objective: v | output}.
        sampler: LLaDA's {gen_length, steps, block_length} for trajectories and answers.
        n_test: test problems; n_traj: the first n_traj of them give the per-step KL (null = all);
            kl_ratios: mask ratios of the KL evaluation; seed: problems and masks.
        task_files / question_field / answer_field: local GSM8K-style records (jsonl/parquet; the answer ends in
            "#### <number>") instead of the generated arithmetic; ``n_test`` null = all of them.
        calib_files: GSM8K-style records whose questions prompt the trajectory calibration (null: half of
            task_files, disjoint from the tested half).
        calib_text_files / calib_text_field / calib_seq_len: generic text for ``calib: text`` (WikiText-2 / C4).
    """

    def __init__(self, backbone: Mapping[str, Any], quantizer=None, rate: float = 4.0, a_bits: int = 4,
                 v_bits: int | None = None, calib: str = "tmas", n_calib: int = 32, n_prompts: int = 8,
                 calib_batch_size: int = 8, calib_seed: int = 0, tmas: Mapping[str, Any] | None = None,
                 cgq: Mapping[str, Any] | None = None, iaaq: Mapping[str, Any] | None = None,
                 sampler: Mapping[str, Any] | None = None, n_test: int = 16,
                 kl_ratios: Sequence[float] = (0.9, 0.5, 0.1), seed: int = 0, stats_device: str | None = None,
                 n_traj: int | None = None, task_files: str | None = None, question_field: str = "question", answer_field: str = "answer",
                 calib_files: str | None = None, calib_text_files: str | None = None, calib_text_field: str = "text",
                 calib_seq_len: int = 2048, **kw):
        if not ((backbone.get("diffusion") or {}).get("mask_token_id") is not None):
            raise ValueError("dllmquant needs a masked-diffusion backbone: backbone.pretrained=tiny-mdlm or "
                             "backbone=llada_8b")
        if calib not in CALIB:
            raise ValueError(f"model.calib={calib!r}: choose one of {', '.join(CALIB)}")
        self.tmas_cfg = {"proportions": list(_tmas.PROPORTIONS), "stage_by": "mask_ratio", **dict(tmas or {})}
        _tmas.check_proportions(self.tmas_cfg["proportions"])
        if self.tmas_cfg["stage_by"] not in _tmas.STAGE_BY:
            raise ValueError(f"model.tmas.stage_by={self.tmas_cfg['stage_by']!r}: choose mask_ratio or step")
        self.cgq_cfg = {"enabled": True, "w_mask": 1.0, "w_unmask": 0.7, "score_fn": "none", **dict(cgq or {})}
        _cgq.check_score_fn(self.cgq_cfg["score_fn"])
        self.iaaq_cfg = {"enabled": True, "grid": 40, "min_ratio": 0.05, "objective": "v", **dict(iaaq or {})}
        _iaaq.check_objective(self.iaaq_cfg["objective"])
        self.sampler_cfg = {"gen_length": 16, "steps": 16, "block_length": None, **dict(sampler or {})}
        super().__init__(backbone, quantizer=quantizer, rate=rate, n_calib=n_calib, calib_batch_size=calib_batch_size,
                         calib_seed=calib_seed, stats_device=stats_device, **kw)
        self.a_bits, self.v_bits = int(a_bits), int(a_bits if v_bits is None else v_bits)
        if self.export_packed and min(self.a_bits, self.v_bits) < 16:
            raise ValueError("model.export_packed packs the weights (W4A16): activations and V are only fake-quantized "
                             "here, so set model.a_bits=16 and model.v_bits=16 to export")
        self.calib, self.n_prompts, self.n_test = calib, n_prompts, n_test
        self.kl_ratios, self.seed = [float(r) for r in kl_ratios], seed
        self.clip_ratios: dict[int, float] = {}
        self.n_traj = n_traj
        self.task_files, self.question_field, self.answer_field = task_files, question_field, answer_field
        self.calib_files, self.calib_text_files = calib_files, calib_text_files
        self.calib_text_field, self.calib_seq_len = calib_text_field, int(calib_seq_len)
        if n_test is None and not task_files:
            raise ValueError("model.n_test=null means every record of model.task_files: set task_files or a count")

    def build_model(self):
        return build_diffusion_backbone(self.backbone_spec)

    def parameter_counts(self) -> dict[str, int]:
        from lightning_modules.common.backbone import count_parameters

        return {} if self.model is None else {"params/total": count_parameters(self.model.model)}

    # --- the task ------------------------------------------------------------------------------------------------
    def _tokenizer(self):
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or getattr(dm, "tokenizer", None) is None:
            raise ValueError("dllmquant needs a datamodule with the backbone's tokenizer (data=rule_induction)")
        return dm.tokenizer

    def _calib_from_task(self) -> bool:
        """Whether calibration draws on ``task_files`` (then calibration and test take disjoint halves)."""
        return self.calib_files is None and not (self.calib == "text" and self.calib_text_files)

    def problems(self, split: str, n: int | None) -> list[dict]:
        """``n`` problems (None: all) with prompt / solution ids (``split``: calib | test; disjoint seeds, files or
        halves)."""
        from datamodules.verifiable import arithmetic_problem

        tok, rng = self._tokenizer(), random.Random(f"dllmquant/{self.seed}/{split}")
        enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        if split == "calib" and self.calib_files:
            records = self._records(self.calib_files, n)
        elif self.task_files:
            records = self._records(self.task_files, n, half=split if self._calib_from_task() else None)
        else:
            records = [arithmetic_problem(rng, 2, ("+", "-")) for _ in range(n)]
        out = []
        for p in records:
            sol = enc(p["solution"])
            if split == "test" and len(sol) > self.sampler_cfg["gen_length"]:  # calibration reads prompts alone
                raise ValueError(f"model.sampler.gen_length={self.sampler_cfg['gen_length']} is shorter than a "
                                 f"solution ({len(sol)} tokens)")
            out.append({"prompt": enc(p["question"] + "\n"), "solution": sol})
        return out

    def _records(self, files: str, n: int | None, half: str | None = None) -> list[dict]:
        """``n`` records (None: all) of ``files`` in a seeded order; ``half`` = calib | test keeps one half."""
        from datamodules.common.loaders import load_local

        ds = load_local(files, field=None)
        order = list(range(len(ds)))
        random.Random(f"dllmquant/{self.seed}").shuffle(order)
        if half is not None:
            order = order[len(order) // 2:] if half == "calib" else order[:len(order) // 2]
        return [{"question": ds[i][self.question_field], "solution": ds[i][self.answer_field]} for i in order[:n]]

    def text_windows(self, n: int) -> list[torch.Tensor]:
        """``n`` windows of ``calib_seq_len`` tokens at seeded random offsets of the joined ``calib_text_files``."""
        from datamodules.common.loaders import local_documents

        ids = self._tokenizer()("\n\n".join(local_documents(self.calib_text_files, self.calib_text_field)),
                                add_special_tokens=False)["input_ids"]
        if len(ids) <= self.calib_seq_len:
            raise ValueError(f"model.calib_text_files holds {len(ids)} tokens, fewer than model.calib_seq_len="
                             f"{self.calib_seq_len}: give more text or a shorter window")
        rng = random.Random(f"dllmquant/{self.calib_seed}/text")
        starts = [rng.randint(0, len(ids) - self.calib_seq_len - 1) for _ in range(n)]
        return [torch.tensor(ids[i:i + self.calib_seq_len]) for i in starts]

    def _answer_region(self, prob: dict) -> torch.Tensor:
        """prompt + solution + EOS up to gen_length: the clean sequence the sampler should produce."""
        eos = self._tokenizer().eos_token_id
        sol = prob["solution"] + [eos] * (self.sampler_cfg["gen_length"] - len(prob["solution"]))
        return torch.tensor(prob["prompt"] + sol)

    @torch.no_grad()
    def calibration_batches(self) -> list[dict]:
        dlm: MaskedDiffusionLM = self.model
        dlm.eval()
        if self.calib == "text" and self.calib_text_files:
            seqs = self.text_windows(self.n_calib)
        elif self.calib == "text":  # tiny-mdlm's stand-in: clean calibration problems (disjoint from the test ones)
            seqs = [self._answer_region(p) for p in self.problems("calib", self.n_calib)]
        else:
            probs = self.problems("calib", self.n_prompts)
            states = _tmas.record_trajectory(dlm, [p["prompt"] for p in probs], self.sampler_cfg["gen_length"],
                                            self.sampler_cfg["steps"], self.sampler_cfg["block_length"])
            if self.calib == "tmas":
                states = _tmas.draw(states, self.n_calib, self.tmas_cfg["proportions"], self.tmas_cfg["stage_by"],
                                   self.sampler_cfg["steps"], self.calib_seed)
            else:
                states = _tmas.uniform(states, self.n_calib, self.calib_seed)
            seqs = [s["ids"] for s in states]
        weights = []
        for s in seqs:
            if self.cgq_cfg["enabled"]:
                logits = dlm.logits(s[None].to(self.device)) if self.cgq_cfg["score_fn"] == "confidence" else None
                weights.append(_cgq.token_weights(s[None], dlm.mask_token_id, self.cgq_cfg["w_mask"],
                                                 self.cgq_cfg["w_unmask"], self.cgq_cfg["score_fn"],
                                                 None if logits is None else logits.cpu())[0])
            else:
                weights.append(torch.ones(len(s), dtype=torch.float64))
        return length_batches(seqs, weights, self.calib_batch_size)

    # --- quantization --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def quantize(self, batches: list[dict]) -> dict:
        from lightning_modules.common import fake_quant

        t0 = time.time()
        dlm: MaskedDiffusionLM = self.model
        self._reference = [copy.deepcopy(dlm).eval().requires_grad_(False)]
        on_device = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
        # AWQ's release scales (and clips) the model first: IA-AQ and the statistics then see the folded model
        prepared = self.quantizer.prepare(dlm.model, on_device, self.rate) if hasattr(self.quantizer, "prepare") else {}
        if self.v_bits < 16:
            self.clip_ratios = {}
            if self.iaaq_cfg["enabled"]:
                rec = _iaaq.ValueRecorder(_iaaq.clip_grid(self.iaaq_cfg["grid"], self.iaaq_cfg["min_ratio"]),
                                         self.v_bits, self.iaaq_cfg["objective"])
                _iaaq.install(dlm.model, rec)
                try:
                    for b in batches:
                        dlm.logits(b["input_ids"].to(self.device))
                finally:
                    _iaaq.install(dlm.model, None)
                self.clip_ratios = rec.ratios()
        report = quantize_model(dlm.model, self.quantizer, on_device,
                                self.rate, mode=self.mode, rate_control=self.rate_control, with_limit=self.with_limit,
                                stats_device=self.stats_device, **self.extras)
        if self.a_bits < 16:
            layers = fake_quant.quantize_model(dlm.model, {"w_bits": 16, "a_bits": self.a_bits, "group_size": -1,
                                                           "impl": "torch"})
            fake_quant.set_input_scales(layers, report["input_scales"])
        if self.v_bits < 16:
            _iaaq.install(dlm.model, _iaaq.ValueQuantizer(self.clip_ratios, self.v_bits))
        summary = report["summary"]
        self.quantized = True
        self.results = {"quantization": {"method": self.method, "calib": self.calib, "cgq": self.cgq_cfg["enabled"],
                                         "iaaq": self.iaaq_cfg["enabled"], "w_bits": self.rate, "a_bits": self.a_bits,
                                         "v_bits": self.v_bits, "clip_ratios": self.clip_ratios, **summary,
                                         "awq": prepared,
                                         "packed_bytes": summary["bits"] * summary["n_weights"] / 8,
                                         "quant_time_s": time.time() - t0},
                        "layers": report["layers"]}
        return report

    def quantized_backbone(self):
        """The transformers model inside the diffusion wrapper: the driver's layer names are its own."""
        return self.model.model

    # --- evaluation ----------------------------------------------------------------------------------------------
    def on_test_epoch_start(self):
        self.model.eval()

    def test_step(self, batch, batch_idx):
        """Nothing per batch: the evaluation runs on the arithmetic problems at epoch end."""

    @staticmethod
    def kl_bits(logits_p: torch.Tensor, logits_q: torch.Tensor, where: torch.Tensor) -> tuple[float, int]:
        """Σ KL(P ‖ Q) in bits over the positions ``where``, and their count."""
        lp, lq = torch.log_softmax(logits_p.double(), -1), torch.log_softmax(logits_q.double(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        return float(kl[where].sum() / LN2), int(where.sum())

    @torch.no_grad()
    def on_test_epoch_end(self):
        dlm, ref = self.model, self.reference
        probs = self.problems("test", self.n_test)
        s = self.sampler_cfg
        metrics, correct_q, correct_fp = {}, 0, 0
        g = torch.Generator().manual_seed(self.seed)
        kl_r = {r: [0.0, 0] for r in self.kl_ratios}
        for p in probs:
            prompt = torch.tensor([p["prompt"]], device=self.device)
            n = len(p["prompt"])
            want = final_answer(self._tokenizer().decode(p["solution"]))
            for model, hit in ((dlm, "q"), (ref, "fp")):
                out = model.sample(prompt, s["gen_length"], s["steps"], s["block_length"])[0, n:].cpu()
                ok = want is not None and final_answer(self._tokenizer().decode(out.tolist())) == want
                correct_q, correct_fp = correct_q + (ok and hit == "q"), correct_fp + (ok and hit == "fp")
            clean = self._answer_region(p)[None]
            for r in self.kl_ratios:
                k = max(1, round(r * s["gen_length"]))
                pos = n + torch.randperm(s["gen_length"], generator=g)[:k]
                x = clean.clone()
                x[0, pos] = dlm.mask_token_id
                x = x.to(self.device)
                val, cnt = self.kl_bits(ref.logits(x).cpu(), dlm.logits(x).cpu(), (x == dlm.mask_token_id).cpu())
                kl_r[r][0] += val
                kl_r[r][1] += cnt
        traj = _tmas.record_trajectory(ref, [p["prompt"] for p in probs[: self.n_traj]], s["gen_length"], s["steps"], s["block_length"])
        per_step: dict[int, list[float]] = {}
        for st in traj:
            x = st["ids"][None].to(self.device)
            where = (x == dlm.mask_token_id).cpu()
            if where.any():  # the state the model reads before step st["step"] + 1
                val, cnt = self.kl_bits(ref.logits(x).cpu(), dlm.logits(x).cpu(), where)
                per_step.setdefault(st["step"] + 1, []).append(val / cnt)
        steps = sorted(per_step)
        curve = [sum(per_step[i]) / len(per_step[i]) for i in steps]
        metrics["test/accuracy"] = 100 * correct_q / len(probs)
        metrics["test/accuracy_fp"] = 100 * correct_fp / len(probs)
        for r, (v, c) in kl_r.items():
            metrics[f"test/kl_bits/r{r:g}"] = v / max(c, 1)
        for i, v in zip(steps, curve):
            metrics[f"test/kl_step/{i}"] = v
        metrics["test/kl_traj"] = sum(curve) / len(curve)
        metrics["test/kl_growth"] = slope([float(i) for i in steps], curve)
        q = self.results.get("quantization", {})
        for key in ("bits", "packed_bytes", "quant_time_s", "rel_mse"):
            if q.get(key) is not None:
                metrics[f"quant/{key if key != 'quant_time_s' else 'time_s'}"] = float(q[key])
        for key, val in self.results.get("packed", {}).items():  # the exported 4-bit model (export_packed)
            if key.startswith("bytes_"):
                metrics[f"quant/{key}"] = float(val)
        for k, v in metrics.items():
            self.log(k, v)
        self.results["kl_per_step"] = dict(zip(steps, curve))
        self.results["metrics"] = metrics
        from lightning_modules.common.dashboard import curve as plot

        plot("dllmquant/kl_per_step", {self.method: ([float(i) for i in steps], curve)}, self.loggers,
             xlabel="denoising step", ylabel="KL(FP ‖ Q), bits per masked token")


def length_batches(seqs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], batch_size: int) -> list[dict]:
    """Batches of at most ``batch_size`` sequences of one length each ({input_ids, token_weight}): no padding, so no
    real token attends to a pad under the mask-free bidirectional attention."""
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    out = []
    for n in sorted(by_len):
        idx = by_len[n]
        for j in range(0, len(idx), batch_size):
            part = idx[j:j + batch_size]
            out.append({"input_ids": torch.stack([seqs[i] for i in part]).long(),
                        "token_weight": torch.stack([weights[i] for i in part]).double()})
    return out


def final_answer(text: str) -> str | None:
    """The number after the last "####" (GSM8K's answer mark; a word-level tokenizer decodes it as "# # # #")."""
    found = re.findall(r"#\s*#\s*#\s*#\s*(-?[\d,]+(?:\.\d+)?)", text)
    return found[-1].replace(",", "") if found else None


def slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of y on x (0 for fewer than two points)."""
    if len(x) < 2:
        return 0.0
    mx, my = sum(x) / len(x), sum(y) / len(y)
    den = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / den if den else 0.0
