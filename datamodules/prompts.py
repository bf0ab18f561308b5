"""Prompts without reference answers, for RLHF with a reward model (``model/reward=reward_model``).

Local jsonl/parquet files with one prompt per record (field ``data.question_field``, default ``prompt``), e.g.
the prompts of HH-RLHF or UltraFeedback. Everything else is the verifiable datamodule's: the three disjoint splits
(``val_files`` / ``test_files``, else hashed out of ``files`` by prompt), batches of prompt text and policy token
ids (the answer is empty), prompts reading ``"Question: ...\\nAnswer:"`` or, with ``chat_template``, the policy's chat
template; so the RL core runs unchanged.
"""
from __future__ import annotations

from datamodules.verifiable import VerifiableDataModule


class PromptDataModule(VerifiableDataModule):
    def __init__(self, tokenizer, files=None, question_field: str = "prompt", **kwargs):
        if not files:
            raise ValueError("data=prompts: set data.files=<path or glob of your prompt .jsonl/.parquet files>")
        # a file task of the parent (its splits and loaders); only how a file's records are read differs
        super().__init__(tokenizer, task="gsm8k", files=files, question_field=question_field, **kwargs)

    def load(self, files) -> list[dict]:
        from datamodules.common.loaders import load_local

        prompts = load_local(files, field=self.question_field)[self.question_field]
        return [{"question": q, "answer": "", "solution": ""} for q in prompts if q and q.strip()]
