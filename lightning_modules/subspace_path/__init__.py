"""SubspacePath Pruner (Gong et al., ICML 2026): domain probes, axis-aligned head importance, per-scenario head
pruning (``module.py``; the pure pieces in ``method.py``)."""
from lightning_modules.subspace_path.module import SubspacePathModule  # noqa: F401
