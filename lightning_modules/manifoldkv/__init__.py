"""ManifoldKV (Datta et al., ICML 2026, arXiv 2602.08343): KV-cache eviction by Euclidean distance to the key
centroid, and WindowedManifoldKV (``press.py``, on the shared press interface ``lightning_modules.common.kv_press``),
and the RULER-style evaluation module (``module.py``)."""
from lightning_modules.manifoldkv.module import KVPressEvalModule  # noqa: F401
from lightning_modules.manifoldkv.press import ManifoldKV, WindowedManifoldKV  # noqa: F401
