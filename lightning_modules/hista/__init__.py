"""Hista and Numca: state values for LLM RL (Chen et al., ICML 2026), and the SVEB benchmark, on the RL core
(``module.HistaModule``, ``sveb.SVEBModule``)."""
