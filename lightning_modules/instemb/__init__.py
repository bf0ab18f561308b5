from lightning_modules.instemb.module import InstEmbModule, instruction_metrics, supcon  # noqa: F401
