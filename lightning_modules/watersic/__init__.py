"""WaterSIC (Lifar, Savkin, Ordentlich, Polyanskiy, ICML 2026): see ``module.py``."""
from lightning_modules.watersic.module import WaterSICModule
from lightning_modules.watersic.quantizer import WaterSIC

__all__ = ["WaterSIC", "WaterSICModule"]
