"""paperlab entry point: ``python run.py experiment=<name> [overrides]``.

It only composes and instantiates (datamodule, module, callbacks, loggers, trainer), runs the config's
``task``, and writes ``metrics.json``. Lightning and transformers are imported only when something is
instantiated, so ``python run.py --cfg job`` stays fast.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("PAPERLAB_ROOT", str(ROOT))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runner import ConfigError, register_resolvers, run  # noqa: E402  (no heavy imports)

register_resolvers()


@hydra.main(config_path="conf", config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        return run(cfg)
    except ConfigError as err:  # a config that cannot work: its one line, not a traceback
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
