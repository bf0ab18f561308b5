"""RLKV (arXiv 2510.08525): which KV heads matter for reasoning, found by RL on per-head attention gates.

- ``mixed_attention.py``: the gated full / sink+recent attention core (prefill and cached decoding);
- ``module.py``: ``RLKVModule``, the GRPO probe on the RL core with the reward-gated L1 (``regularizer`` hook);
- ``penalty.py``: the reward-gated L1 and the release's per-micro-batch weighting (AReaL's token packing);
- ``duo.py``: ``DuoAttentionModule``, DuoAttention's retrieval-distillation probe on the same gates (baseline);
- ``press.py``: ``allocate`` and ``HeadMixedPress``, the head-wise full / constant KV cache at inference;
- ``evaluation.py``: greedy decoding under a press, ``RLKVEvalModule`` for the sparsity sweep.
"""
