"""error_law (Raju & Netrapalli, ICML 2026, arXiv 2601.14175): accuracy against complexity on repetitive
deterministic tasks and the two-parameter law Acc(n) = P(q/2, 1/(r n)). The evaluation module (``module.py``); the
laws and their binomial fit live in ``sweeps/laws.py`` / ``sweeps/fit.py``, the tasks in ``lightning_modules/error_law/data.py``."""
from lightning_modules.error_law.module import ErrorLawModule  # noqa: F401
