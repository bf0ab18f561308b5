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

from datamodules.common.errors import full_error_asked, one_line, user_error  # noqa: E402  (no heavy imports)
from runner import register_resolvers, run  # noqa: E402

register_resolvers()

# Keys that became config-group choices or moved: the old form fails with one line naming the new one (before
# Hydra's multi-line "not in struct").
RENAMED = {
    "model.press.name": "model/press=<manifoldkv|windowed_manifoldkv|keydiff|knorm|snapkv|streaming|random>",
    "model.press.wrapper": "model/press_wrapper=<adakv|block|null>",
    "model.press.alpha_safeguard": "model.press_wrapper.alpha_safeguard (with model/press_wrapper=adakv)",
    "model.press.block_size": "model.press_wrapper.block_size (with model/press_wrapper=block)",
    "model.press.snap_window": "model.press.window_size (with model/press=snapkv)",
    "model.method": "model/quantizer=<rtn|gptq|huffman_gptq|watersic>",
}


def check_renamed(argv: list[str]) -> None:
    for arg in argv:
        key = arg.lstrip("+~").split("=", 1)[0]
        if key in RENAMED:
            sys.exit(f"error: {key} is gone — use {RENAMED[key]}")


@hydra.main(config_path="conf", config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        return run(cfg)
    except Exception as err:
        # an error the user can fix (datamodules.common.errors): one line naming the fix, not a traceback
        if (user := user_error(err)) is None or full_error_asked():
            raise
        print(f"error: {one_line(user)}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    check_renamed(sys.argv[1:])
    main()
