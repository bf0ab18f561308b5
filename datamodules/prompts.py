"""Prompts without reference answers, for RLHF with a reward model (``model/reward=reward_model``).

Local jsonl/parquet files with one prompt per record (field ``data.question_field``, default ``prompt``), e.g.
the prompts of HH-RLHF or UltraFeedback. Batches are shaped as the verifiable datamodule's (prompt text, policy
token ids, empty answer), so the RL core runs unchanged; the prompt reads ``"Question: ...\\nAnswer:"`` too.
"""
from __future__ import annotations

from datamodules.verifiable import VerifiableDataModule


class PromptDataModule(VerifiableDataModule):
    def __init__(self, tokenizer, files=None, val_files=None, question_field: str = "prompt", **kwargs):
        if not files:
            raise ValueError("data=prompts: set data.files=<path or glob of your prompt .jsonl/.parquet files>")
        super().__init__(tokenizer, task="gsm8k", files=files, val_files=val_files, question_field=question_field,
                         **kwargs)

    def problems(self, split: str) -> list[dict]:
        from datamodules.common.loaders import load_local

        files = self.files if split == "train" else (self.val_files or self.files)
        prompts = load_local(files, field=self.question_field)[self.question_field]
        probs = [{"question": q, "answer": "", "solution": ""} for q in prompts if q and q.strip()]
        if split == "train" or self.val_files:
            return probs
        return probs[: self.n_val]
