"""Hista and Numca: state values for LLM RL (Chen et al., ICML 2026), and the SVEB benchmark, on the RL core."""
from lightning_modules.hista.module import HistaModule

__all__ = ["HistaModule"]
