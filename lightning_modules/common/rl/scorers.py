"""Reward functions of the RL core, chosen by ``_target_`` (config group ``model/reward``).

A scorer is called with one entry per rollout, ``scorer(prompts, completions, answers, device) -> (N,) float tensor``
(``device``: where a model-based scorer runs), and
names the evaluation metric its mean reward is logged as (``val/<metric>``):

- :class:`ExactMatch` (``model/reward=exact_match``, default): the verifiable reward, 1 when the completion's
  final answer equals the gold one; metric ``accuracy``. ``compare``: ``exact`` (default; normalised strings,
  ``rewards.exact_match_reward``: GSM8K and the generated tiny tasks, whose answers are integers), ``math``
  (symbolic equivalence by math-verify, ``rewards.math_equivalence_reward``: what experiments with LaTeX answers,
  MATH / MATH-500 / DeepScaleR, set as ``model.reward.compare: math``) or ``math_boxed`` (``model/reward=math_verify``:
  the Hista release's accuracy reward, ``rewards.boxed_math_reward``: the answer must be boxed or announced).
- :class:`RewardModel` (``model/reward=reward_model``): RLHF, a sequence-classification reward model (one logit)
  from a local directory scores prompt + completion; gold answers are ignored; metric ``reward``. It is loaded on
  first use, per rank, frozen and outside the policy's module tree (not trained, not checkpointed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_modules.common.rl.rewards import boxed_math_reward, exact_match_reward, math_equivalence_reward

COMPARE = {"exact": exact_match_reward, "math": math_equivalence_reward, "math_boxed": boxed_math_reward}


@dataclass
class ExactMatch:
    metric: str = "accuracy"
    compare: str = "exact"

    def __post_init__(self):
        if self.compare not in COMPARE:
            raise ValueError(f"model.reward.compare={self.compare!r}: choose exact (integer answers), math "
                             "(LaTeX answers, symbolic equivalence) or math_boxed (the same, boxed answers only)")
        if self.compare != "exact":
            import importlib.util

            if importlib.util.find_spec("math_verify") is None:
                raise ModuleNotFoundError(f"model.reward.compare={self.compare} needs math-verify: pip install math-verify")

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str], device=None) -> torch.Tensor:
        score = COMPARE[self.compare]
        return torch.tensor([score(c, a) for c, a in zip(completions, answers)], dtype=torch.float32)


@dataclass
class RewardModel:
    """``path``: a transformers ``AutoModelForSequenceClassification`` directory with its tokenizer. ``prompts`` are
    the bare questions (the data's ``question``). ``chat_template``: score ``[user: question, assistant: completion]``
    through the reward model's chat template (what chat reward models are trained on); else the plain text
    ``question + completion``."""

    path: str
    batch_size: int = 8
    max_length: int = 2048
    dtype: str = "bfloat16"
    chat_template: bool = True
    metric: str = "reward"
    _model: Any = field(default=None, init=False, repr=False, compare=False)
    _tok: Any = field(default=None, init=False, repr=False, compare=False)

    def check(self) -> None:
        from pathlib import Path

        from datamodules.common.errors import MissingPathError

        if not Path(self.path).expanduser().is_dir():
            raise MissingPathError(f"model.reward.path={self.path} is not a directory — point it at a local reward "
                                   "model")

    def load(self, device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from callbacks.deepspeed_hf import unpartitioned
        from datamodules.common.errors import hub_loading

        self.check()
        # frozen and outside the engine: whole on every rank, even under ZeRO-3
        with hub_loading(self.path, "model.reward.path", "reward model"), unpartitioned():
            tok = AutoTokenizer.from_pretrained(self.path)
            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        if model.config.num_labels != 1:
            raise ValueError(f"{self.path}: a reward model has one output (num_labels=1), this one {model.config.num_labels}")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        model.config.pad_token_id = tok.pad_token_id  # the head pools the last non-pad token
        self._tok, self._model = tok, model.eval().requires_grad_(False).to(device)

    def texts(self, prompts: list[str], completions: list[str]) -> tuple[list[str], bool]:
        """The reward model's inputs, and whether they already hold its special tokens (a chat template)."""
        if self.chat_template and getattr(self._tok, "chat_template", None):
            return [self._tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                                  tokenize=False) for p, c in zip(prompts, completions)], True
        return [p + c for p, c in zip(prompts, completions)], False

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str] | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
        if self._model is None:
            self.load(device)
        (texts, templated), out = self.texts(prompts, completions), []
        for i in range(0, len(texts), self.batch_size):
            enc = self._tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=self.max_length, add_special_tokens=not templated).to(self._model.device)
            out.append(self._model(**enc).logits[:, 0].float().cpu())
        return torch.cat(out)
