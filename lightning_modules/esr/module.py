"""ESR (issue 21): do models recover from SAE-latent boosts mid-answer? The study runs as the test loop
(``task: fit_test``: the self-correction SFT first; ``sft.enabled: false`` or ``trainer.max_steps=0`` for the base).

Test loop, one pass (``lightning_modules/esr/{sae,steer,threshold,metrics}.py``):

1. The SAE at ``sae.layer``: ``sae.format: train`` fits a ReLU SAE on the (warmed-up, pre-SFT) model's cached
   activations (saved in SAELens layout under the cache, read back through the SAELens loader), else a release file.
2. The latent pool: latents zero on every prompt (read as the release does: the bare prompt as a chat-templated user
   turn, :meth:`relevance_text`) and outside each prompt's top-k (``steer.exclude_topk``),
   concreteness ≥ ``steer.concreteness_min`` (null: skipped); ``steer.n_latents`` drawn from it.
3. Thresholds: probabilistic bisection per latent (``threshold.*``: each model's search range and prior are the
   release's and live in its experiment; the model config keeps the release's dataclass defaults [0, 5], 1.0 ±
   0.34, which every released model config overrides), each trial the mean first-attempt score of
   ``threshold.samples`` steered responses to distinct random prompts, ``threshold.max_new_tokens`` long (null:
   half of ``gen.max_new_tokens``, as released); the estimate rounded to 0.01, as released.
4. ``gen.trials`` steered responses per latent at its threshold; the judge splits attempts; ``test/steered/*``:
   multi-attempt, ESR, improvement, mean Δ and SEs. ``test/unsteered/*``: the same prompts without steering.
5. Off-topic detectors (``otd.enabled``): unsteered responses paired with their prompt vs a derangement, SAE
   activations max-pooled over the whole conversation (``otd.pool: sequence``, the release's) or over the response
   (``response``); ``test/otd_ablation/*``: the steered trials again with the detectors clamped to 0 in the same
   hook as the boost, at ``steer.layer`` (the release's fork clamps where it steers: 70B layer 33); ``test/random_ablation/*``: the mean over ``otd.random_sets`` equal-size sets.

Steering (``steer.mode``): ``add`` h ← h + value·d at ``steer.layer`` on every position, d the raw decoder row
W_dec[i] (``steer.normalize: false``, the release's fork: its boost values are in those units) or the unit row
W_dec[i]/‖W_dec[i]‖ (``true``, ours: a boost means the same residual shift for every latent), or
``clamp`` (the latent's activation set to ``value``: h ← h + (value − f_i)·W_dec[i]). ``sae.layer`` and
``steer.layer`` are separate (the 70B release: SAE trained at 50, steering and clamping at 33). ``meta_prompt``:
none | 1..4, the release's sentence appended to every prompt (2 names the steered latent's label).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from datamodules.common.errors import ConfigError, MissingPathError
from lightning_modules.common.activations import capture, decoder_layers, intervene
from lightning_modules.common.lm import CausalLMModule, _plain
from lightning_modules.esr import steer as S
from lightning_modules.esr.metrics import derangement, esr_metrics, find_detectors, random_sets
from lightning_modules.esr.sae import FORMATS, SAE, fit_stats, load_sae, save_saelens, train_sae
from lightning_modules.esr.threshold import bisect

SAE_DEFAULTS = {"format": "train", "path": None, "layer": 2, "d_sae": 1024, "l1": 0.18, "steps": 800,
                "batch_size": 256, "lr": 1e-3, "n_texts": 1024, "seed": 0}
STEER_DEFAULTS = {"layer": 2, "mode": "add", "normalize": False, "exclude_topk": 100, "concreteness_min": None,
                  "concreteness_file": None, "labels_file": None, "n_latents": 80, "seed": 0}
THRESHOLD_DEFAULTS = {"lo": 0.0, "hi": 5.0, "grid": 10_000, "prior_mu": 1.0, "prior_sd": 0.34, "trials": 20,
                      "target": 0.3, "scale": 1.0, "query_weight": "geometric", "samples": 1, "max_new_tokens": None}
GEN_DEFAULTS = {"max_new_tokens": 512, "temperature": 0.6, "repetition_penalty": 1.2, "trials": 10, "batch_size": 64,
                "unsteered_trials": 1}
OTD_DEFAULTS = {"enabled": True, "freq": 0.8, "random_sets": 3, "pool": "sequence"}
SFT_DEFAULTS = {"enabled": True, "max_length": 4096, "adamw_8bit": False}
META = ("none", "1", "2", "3", "4")


class ESRModule(CausalLMModule):
    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None, scheduler: Callable | None = None,
                 weight_decay: float = 0.0, warmup: Mapping | None = None, lora: Mapping | None = None,
                 sae: Mapping | None = None, steer: Mapping | None = None, threshold: Mapping | None = None,
                 gen: Mapping | None = None, otd: Mapping | None = None, sft: Mapping | None = None, judge=None,
                 meta_prompt: str | int = "none", device_map: str | None = None, seed: int = 0):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.sae_cfg = {**SAE_DEFAULTS, **_plain(sae or {})}
        self.steer = {**STEER_DEFAULTS, **_plain(steer or {})}
        self.thr = {**THRESHOLD_DEFAULTS, **_plain(threshold or {})}
        self.gen = {**GEN_DEFAULTS, **_plain(gen or {})}
        self.otd = {**OTD_DEFAULTS, **_plain(otd or {})}
        self.sft = {**SFT_DEFAULTS, **_plain(sft or {})}
        self.meta_prompt = str(meta_prompt)
        self.device_map = device_map
        if self.steer["mode"] not in S.MODES:
            raise ValueError(f"model.steer.mode={self.steer['mode']!r}: choose one of {', '.join(S.MODES)}")
        if self.sae_cfg["format"] not in ("train", *FORMATS):
            raise ValueError(f"model.sae.format={self.sae_cfg['format']!r}: choose train or one of {', '.join(FORMATS)}")
        if self.sae_cfg["format"] != "train" and not self.sae_cfg["path"]:
            raise ConfigError(f"model.sae.format={self.sae_cfg['format']} needs model.sae.path — set it to the "
                              "release file")
        if not float(self.thr["lo"]) < float(self.thr["hi"]):
            raise ValueError(f"model.threshold.lo={self.thr['lo']} must be below model.threshold.hi={self.thr['hi']}")
        if self.otd["pool"] not in ("sequence", "response"):
            raise ValueError(f"model.otd.pool={self.otd['pool']!r}: choose sequence or response")
        if self.meta_prompt not in META:
            raise ValueError(f"model.meta_prompt={meta_prompt!r}: choose one of {', '.join(META)}")
        for layer_key, cfg in (("steer.layer", self.steer), ("sae.layer", self.sae_cfg)):
            n = int(_plain(backbone).get("config", {}).get("num_hidden_layers", 10 ** 9))
            if not 0 <= int(cfg["layer"]) < n:
                raise ValueError(f"model.{layer_key}={cfg['layer']} is beyond the model's {n} layers: choose 0..{n - 1}")
        self.warmup, self.lora, self.seed = _plain(warmup) if warmup else None, _plain(lora) if lora else None, seed
        if judge is None:
            from lightning_modules.common.judge import AttemptRuleJudge

            judge = AttemptRuleJudge()
        self.judge = judge
        self.hparams["judge"] = repr(judge)
        self._sae: SAE | None = None
        self._labels: dict[int, str] | None = None
        self.sae_stats: dict[str, float] = {}
        self._base_dir = None
        self.results: dict[str, Any] = {}

    # --- model ---------------------------------------------------------------------------------------------------
    def base_spec(self) -> dict:
        spec = dict(self.backbone_spec)
        if self.warmup:  # the instruct stand-in: tiny-lm warmed up (cached) on the task's answers
            from lightning_modules.common.rl.warmup import warmup_dir

            spec["pretrained"] = str(warmup_dir(spec, {"val_fraction": 0.0, "test_fraction": 0.0, **self.warmup}))
        return spec

    def build_model(self):
        from lightning_modules.common.backbone import build_backbone

        spec = self.base_spec()
        self._base_spec = spec
        if self.device_map:  # one process, the model split over every visible GPU by accelerate (70B in bf16)
            from transformers import AutoModelForCausalLM

            from datamodules.common.errors import hub_loading
            from lightning_modules.common.backbone import _dtype, resolve_pretrained

            location = resolve_pretrained(spec["pretrained"])
            with hub_loading(spec["pretrained"]):
                model = AutoModelForCausalLM.from_pretrained(location, dtype=_dtype(spec.get("dtype")),
                                                             device_map=self.device_map)
        else:
            model = build_backbone(spec)
        n = len(decoder_layers(model))
        for key, cfg in (("steer.layer", self.steer), ("sae.layer", self.sae_cfg)):
            if not 0 <= int(cfg["layer"]) < n:
                raise ValueError(f"model.{key}={cfg['layer']} is beyond the model's {n} layers: choose 0..{n - 1}")
        if self.lora and self.sft["enabled"]:
            from lightning_modules.common.lora import apply_lora

            model = apply_lora(model, **self.lora)
        return model

    def configure_model(self) -> None:
        if self.device_map and self.model is None:
            # not registered as a submodule, so Lightning's move to one device leaves accelerate's split alone
            object.__setattr__(self, "model", self.build_model().eval())
            self._modules.pop("model", None)
            return
        super().configure_model()

    @property
    def device(self):
        return self.model.device if self.device_map and self.model is not None else super().device

    def tokenizer(self):
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "tokenizer"):
            raise ValueError("ESR needs a datamodule with .tokenizer and .prompts (data=esr)")
        return dm.tokenizer

    # --- self-correction SFT -------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        from lightning_modules.esr.data import masked_batch

        b = masked_batch(self.tokenizer(), batch, self.device, self.sft["max_length"])
        loss = self.model(**b, use_cache=False).loss
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    def setup(self, stage: str) -> None:
        """Before any weight is loaded: a judge that cannot work (e.g. an endpoint without url) or a release SAE that
        is not there (it loads when fit or test starts) fails here."""
        if hasattr(self.judge, "check"):
            self.judge.check()
        if self.sae_cfg["format"] != "train" and not Path(self.sae_cfg["path"]).expanduser().exists():
            raise MissingPathError(f"model.sae.path={self.sae_cfg['path']} does not exist — point it at the "
                                   f"{self.sae_cfg['format']} SAE release file or dir")

    def configure_optimizers(self):
        if self.sft.get("adamw_8bit"):  # the release's 8-bit AdamW (bitsandbytes, CUDA), with the configured kwargs
            try:
                from bitsandbytes.optim import AdamW8bit
            except ImportError as err:
                from datamodules.common.errors import MissingExtraError

                raise MissingExtraError("model.sft.adamw_8bit=true needs bitsandbytes, which is not installed — "
                                        "pip install -c constraints.txt -e '.[gpu]' (CUDA), or set "
                                        "model.sft.adamw_8bit=false") from err
            import functools

            self.optimizer_factory = functools.partial(AdamW8bit, **getattr(self.optimizer_factory, "keywords", {}))
        return super().configure_optimizers()

    def on_fit_start(self):
        self.sae()  # trained on the base model's activations, before the fine-tune changes them

    # --- the SAE ---------------------------------------------------------------------------------------------------
    def sae(self) -> SAE:
        if self._sae is None:
            c = self.sae_cfg
            sae = load_sae(c["format"], c["path"]) if c["format"] != "train" else self._cached_sae()
            sae.check_input(int(self.model.config.hidden_size))
            self._sae = sae.to(self.device)
        return self._sae

    def _cached_sae(self) -> SAE:
        from datamodules.common.cache import cache_root, stable_hash
        from lightning_modules.esr.sae import load_saelens

        c = self.sae_cfg
        keys = ("layer", "d_sae", "l1", "steps", "batch_size", "lr", "n_texts", "seed")
        target = cache_root() / "esr_sae" / stable_hash(self._base_spec.get("pretrained"), {k: c[k] for k in keys})
        if not (target / "cfg.json").exists():
            acts = self.activations(self.sae_texts(int(c["n_texts"])), int(c["layer"]))
            sae = train_sae(acts, int(c["d_sae"]), float(c["l1"]), int(c["steps"]), int(c["batch_size"]),
                            float(c["lr"]), int(c["seed"]))
            held_out = self.activations(self.sae_texts(max(16, int(c["n_texts"]) // 8), held_out=True), int(c["layer"]))
            stats = fit_stats(sae, held_out)
            save_saelens(sae, target.with_name(target.name + ".tmp"), hook_layer=int(c["layer"]), **stats)
            target.with_name(target.name + ".tmp").replace(target)
        cfg = json.loads((target / "cfg.json").read_text())
        self.sae_stats = {k: cfg[k] for k in ("variance_explained", "l0", "dead_fraction")}
        return load_saelens(target)

    def sae_texts(self, n: int, held_out: bool = False) -> list[str]:
        """Texts the tiny SAE is trained on (``held_out``: fresh ones): answers, self-corrections, off-topic text."""
        from lightning_modules.esr.data import self_corrections

        return [e["prompt"] + e["distractor"] + e["response"]
                for e in self_corrections(n, 0.5, seed=int(self.sae_cfg["seed"]) + (2 if held_out else 1))]

    @torch.no_grad()
    def activations(self, texts: list[str], layer: int, batch_size: int = 32) -> torch.Tensor:
        """Residual activations (block output) at ``layer`` on every non-pad token of ``texts``: (N_tokens, D)."""
        out = []
        for i in range(0, len(texts), batch_size):
            ids, mask = self._encode(texts[i:i + batch_size], "right")
            with capture(self.model, ("block_out",), [layer]) as store:
                self.model(input_ids=ids, attention_mask=mask, use_cache=False)
            out.append(store["block_out"][layer][mask.bool()].float().cpu())
        return torch.cat(out)

    def _encode(self, texts, side: str):
        """Token ids of texts as written: a chat-templated text carries its own BOS, so none is added."""
        tok = self.tokenizer()
        tok.padding_side = side
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    @torch.no_grad()
    def pooled(self, items: list[dict], responses: list[str]) -> torch.Tensor:
        """SAE latents max-pooled per (prompt, response) pair: (N, d_sae). ``otd.pool``: ``sequence`` (the release's
        detector search: every position of the conversation, the user turn included; with the chat template, the
        two-turn conversation as the template writes it) | ``response`` (ours: the response's tokens only, read after
        the prompt the model saw)."""
        tok, sae, layer = self.tokenizer(), self.sae(), int(self.sae_cfg["layer"])
        whole = self.otd["pool"] == "sequence"
        rows = []
        for it, r in zip(items, responses):
            if whole and getattr(self.trainer.datamodule, "chat_template", False):
                text = tok.apply_chat_template([{"role": "user", "content": it["prompt"]},
                                                {"role": "assistant", "content": r}], tokenize=False)
                head, ids = [], tok(text, add_special_tokens=False)["input_ids"]
            else:
                head = tok(self.prompt_text(it), add_special_tokens=False)["input_ids"]
                ids = head + tok(r, add_special_tokens=False)["input_ids"]
            with capture(self.model, ("block_out",), [layer]) as store:
                self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
            f = sae.encode(store["block_out"][layer][0, 0 if whole else len(head):].float())
            rows.append(f.amax(0) if len(f) else torch.zeros(sae.d_sae, device=self.device))
        return torch.stack(rows).cpu()

    def relevance_text(self, item: dict) -> str:
        """The text the latent pool's relevance filter reads: the bare prompt as a user turn of the chat template,
        without the assistant header (the release's ``apply_chat_template(..., add_generation_prompt=False)``), or the
        raw template around it."""
        from datamodules.instruct import apply_template

        dm = self.trainer.datamodule
        if getattr(dm, "chat_template", False):
            return self.tokenizer().apply_chat_template([{"role": "user", "content": item["prompt"]}], tokenize=False,
                                                        add_generation_prompt=False)
        return apply_template(dm.template, item["prompt"])

    # --- generation ------------------------------------------------------------------------------------------------
    def prompt_text(self, item: dict, latent: int | None = None) -> str:
        """What the model reads before it answers: the prompt (and meta-prompt) as one user turn of the model's chat
        template with its BOS and the assistant header (``data.chat_template``, the release's), or ``data.template``
        around it as raw text (the tiny model, which has no chat template)."""
        from lightning_modules.esr.data import META_PROMPTS
        from datamodules.instruct import apply_template

        text = item["prompt"]
        if self.meta_prompt != "none":
            text += " " + META_PROMPTS[self.meta_prompt].format(latent_label=self.label(latent) or "an unrelated topic")
        dm = self.trainer.datamodule
        if getattr(dm, "chat_template", False):
            return self.tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)
        return apply_template(dm.template, text)

    @torch.no_grad()
    def generate(self, prompts: list[str], fn=None, max_new_tokens: int | None = None) -> list[str]:
        g, tok, out = self.gen, self.tokenizer(), []
        bs = int(g["batch_size"])
        for i in range(0, len(prompts), bs):
            ids, mask = self._encode(prompts[i:i + bs], "left")
            kw = dict(max_new_tokens=int(max_new_tokens or g["max_new_tokens"]),
                      repetition_penalty=float(g["repetition_penalty"]),
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            kw.update(do_sample=True, temperature=float(g["temperature"])) if g["temperature"] else kw.update(do_sample=False)
            if fn is None:
                seqs = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
            else:
                with intervene(self.model, int(self.steer["layer"]), fn(slice(i, i + len(ids)))):
                    seqs = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
            out += tok.batch_decode(seqs[:, ids.shape[1]:], skip_special_tokens=True)
        return out

    def steering(self, latents: list[int], values, ablate: list[int] = ()):
        """fn(rows) -> an ``intervene`` fn steering row r by latents[r] at values[r] (then clamping ``ablate``)."""
        sae = self.sae()
        values = torch.as_tensor(np.asarray(values, dtype=np.float32), device=self.device)
        mode = self.steer["mode"]
        dirs = S.directions(sae, latents, bool(self.steer["normalize"]) and mode == "add")
        clamp = S.clamp_zero(sae, ablate) if len(ablate) else None

        def for_rows(rows: slice):
            d, v = dirs[rows], values[rows]
            if mode == "add":
                step = S.boost(d, v)
            else:  # clamp latent i to value: h + (value − f_i)·W_dec[i]
                idx = torch.as_tensor(latents[rows], device=self.device)

                def step(h, positions):
                    f = (sae.encode(h.float()) * torch.nn.functional.one_hot(idx, sae.d_sae)[:, None]).sum(-1)
                    return h + ((v[:, None] - f)[..., None] * d[:, None, :]).to(h.dtype)
            return S.compose(step, clamp)
        return for_rows

    def label(self, latent: int | None) -> str | None:
        """The latent's label (``steer.labels_file``), else the release's placeholder ``feature_<i>``."""
        if latent is None:
            return None
        if self._labels is None:
            path = self.steer.get("labels_file")
            self._labels = S.load_labels(path) if path else {}
        return self._labels.get(int(latent), f"feature_{int(latent)}")

    def judged(self, items: list[dict], responses: list[str], latents=None) -> list[dict]:
        """Grades of responses to ``items``; the judge is shown the steered latent's label (the release's rubric asks
        that the unrelated feature be resisted)."""
        latents = latents if latents is not None else [None] * len(items)
        return [self.judge.grade(it["prompt"], r, keywords=it.get("keywords"), label=self.label(lat))
                for it, r, lat in zip(items, responses, latents)]

    # --- the study -----------------------------------------------------------------------------------------------
    def on_test_epoch_start(self):  # no held-out loss: the study logs its own metrics
        pass

    def on_test_epoch_end(self):
        pass

    def test_step(self, batch, batch_idx):
        items = self.trainer.datamodule.prompts
        self.model.eval()
        rng = random.Random(self.seed)
        torch.manual_seed(self.seed)
        sae = self.sae()
        for key, v in self.sae_stats.items():  # a trained SAE's held-out quality (measured on the base model)
            self._log(f"test/sae/{key}", v)

        # latent pool and draw
        prompt_acts = [sae.encode(a.to(self.device)) for a in
                       (self.activations([self.relevance_text(it)], int(self.sae_cfg["layer"])) for it in items)]
        conc = None
        if self.steer["concreteness_file"]:
            from pathlib import Path

            conc = {int(k): float(v) for k, v in json.loads(Path(self.steer["concreteness_file"]).read_text()).items()}
        pool = S.latent_pool([a.cpu() for a in prompt_acts], int(self.steer["exclude_topk"]), conc,
                             self.steer["concreteness_min"]).tolist()
        if not pool:
            raise ValueError("no latent is zero on every prompt: lower model.steer.exclude_topk or use more latents")
        latents = sorted(rng.sample(pool, min(int(self.steer["n_latents"]), len(pool))))
        L = len(latents)

        # thresholds by probabilistic bisection: per latent and trial, the mean first-attempt score of
        # ``threshold.samples`` judged responses to distinct random prompts (the release's
        # threshold_samples_per_trial), each ``threshold.max_new_tokens`` long (null: half of gen.max_new_tokens,
        # as released)
        t = self.thr
        n_s = min(int(t["samples"]), len(items))
        calib_tokens = int(t["max_new_tokens"] or int(self.gen["max_new_tokens"]) // 2)

        def trial(boosts: np.ndarray) -> np.ndarray:
            picks = [it for _ in latents for it in rng.sample(items, n_s)]
            lats = [lat for lat in latents for _ in range(n_s)]
            texts = self.generate([self.prompt_text(it, lat) for it, lat in zip(picks, lats)],
                                  self.steering(lats, np.repeat(boosts, n_s) * float(t["scale"])), calib_tokens)
            scores = np.array([(g["score"] or 0.0) / 100 for g in self.judged(picks, texts, lats)])
            return scores.reshape(len(latents), n_s).mean(1)

        thresholds = bisect(trial, L, float(t["lo"]), float(t["hi"]), int(t["grid"]), float(t["prior_mu"]),
                            float(t["prior_sd"]), int(t["trials"]), float(t["target"]), str(t["query_weight"]))
        thresholds = np.round(thresholds, 2)  # as released
        values = thresholds * float(t["scale"])

        # steered trials at the thresholds
        k = int(self.gen["trials"])
        rows = [(lat, v, items[rng.randrange(len(items))]) for lat, v in zip(latents, values) for _ in range(k)]
        row_latents, row_values, row_items = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
        prompts = [self.prompt_text(it, lat) for it, lat in zip(row_items, row_latents)]

        def run(name: str, ablate=()):
            texts = self.generate(prompts, self.steering(row_latents, row_values, list(ablate)))
            grades = self.judged(row_items, texts, row_latents)
            self.record(name, grades)
            return texts, grades

        texts, _ = run("steered")
        # unsteered control
        plain_items = [it for it in items for _ in range(int(self.gen["unsteered_trials"]))]
        plain = self.generate([self.prompt_text(it) for it in plain_items])
        self.record("unsteered", self.judged(plain_items, plain))
        self.results.update(latents=latents, thresholds=thresholds.tolist(), examples=texts[:8], unsteered_examples=plain[:4])

        if self.otd["enabled"]:
            own = plain[::int(self.gen["unsteered_trials"])]  # each prompt's first unsteered answer
            perm = derangement(len(items), self.seed)
            on = self.pooled(items, own)
            off = self.pooled(items, [own[j] for j in perm])
            detectors = find_detectors(on, off, float(self.otd["freq"])).tolist()
            self.results["detectors"] = detectors
            self._log("test/otd/count", len(detectors))
            if detectors:
                run("otd_ablation", detectors)
                sets = random_sets(sae.d_sae, len(detectors), int(self.otd["random_sets"]), detectors, self.seed)
                per = [self.record(f"random_ablation_{j}", run_grades) for j, run_grades in
                       enumerate(self.judged(row_items, self.generate(prompts, self.steering(row_latents, row_values, s)),
                                             row_latents) for s in sets)]
                for key in ("multi_attempt", "esr"):
                    self._log(f"test/random_ablation/{key}", np.mean([m[key] for m in per]))
        self._log("test/threshold_mean", values.mean())
        self._log("test/n_latents", L)

    def _log(self, name: str, value) -> None:
        self.log(name, float(value), batch_size=1)

    def record(self, name: str, grades: list[dict]) -> dict:
        scores = [[a["score"] for a in g.get("attempts") or []] for g in grades if not g.get("failed")]
        m = esr_metrics(scores)
        m["failed"] = sum(bool(g.get("failed")) for g in grades)
        self.results[name] = m
        if not name.startswith("random_ablation_"):
            for key, v in m.items():
                self._log(f"test/{name}/{key}", v)
        return m
