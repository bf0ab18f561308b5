"""ManifoldKV (Datta et al., ICML 2026, arXiv 2602.08343): KV-cache eviction by Euclidean distance to the key
centroid, and WindowedManifoldKV. The scorers live in ``lightning_modules.common.kv_press`` (shared with RLKV);
this package holds the RULER-style evaluation module."""
from lightning_modules.common.kv_press import ManifoldKV  # noqa: F401
from lightning_modules.manifoldkv.module import KVPressEvalModule  # noqa: F401
