"""WaterSIC (Lifar, Savkin, Ordentlich, Polyanskiy, ICML 2026): see ``module.py``."""
from lightning_modules.watersic.module import WaterSICModule

__all__ = ["WaterSICModule"]
