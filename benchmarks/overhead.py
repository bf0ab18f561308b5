"""Framework overhead: training steps/s through run.py's path against a plain PyTorch loop, side by side.

Same tiny LLaMA (``backbone=tiny_llama``: hidden 128, 4 layers, vocab 2048), same packed data (seq 256,
batch 8, the same ``StepStreamSampler`` order), same optimizer (AdamW, decay on matrices), warmup-cosine
schedule and gradient clipping, same number of steps. Three variants, measured in turns (``--rounds`` of
each, best kept) so that load from other processes hits them alike:

- ``plain``:    a hand-written loop (forward, backward, clip, step, scheduler) over the same DataLoader;
- ``bench``:    ``runner.run(cfg)`` with ``debug=bench`` (no logger, checkpointing, progress bar or validation);
- ``default``:  ``runner.run(cfg)`` with the default callbacks (rich progress bar, checkpointing, LR monitor,
                NaN guard, results writer) and the csv logger; validation off, as in the other two.

Each variant is timed from the end of step ``--warmup`` to the end of the last step (set-up excluded). It also
times ``python run.py --cfg job`` (config only; target < 2 s). Targets: bench/plain <= 1.05x.

    python -m benchmarks.overhead                 # ~2-4 min on 2 free cores
    python -m benchmarks.overhead --steps 200 --rounds 3
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # Hydra imports the timer target by name: let that name be this very module
    sys.modules.setdefault("benchmarks.overhead", sys.modules["__main__"])
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runner import compose  # noqa: E402  (after the path: this file also runs as a script)


def base_overrides(steps: int) -> list[str]:
    return ["experiment=lm_tiny", "backbone=tiny_llama", "data.seq_len=256", "data.batch_size=8",
            f"trainer.max_steps={steps}", "++trainer.limit_val_batches=0", "trainer.val_check_interval=null",
            "task=fit", "++callbacks.export=null"]


class StepTimer:
    """A Lightning callback: time from the end of step ``warmup`` to the end of step ``steps``."""

    def __init__(self, warmup: int, steps: int):
        import lightning as L

        class _Timer(L.Callback):
            def on_train_batch_end(cb, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == warmup:
                    self.t0 = time.perf_counter()
                if trainer.global_step == steps:
                    self.t1 = time.perf_counter()
                    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                    self.loss = float(loss.detach()) if hasattr(loss, "detach") else float(loss)

        self.callback = _Timer()
        self.t0 = self.t1 = self.loss = None


def run_framework(steps: int, warmup: int, defaults: bool) -> tuple[float, float]:
    """Seconds per step through runner.run (the path of run.py), and the last training loss."""
    from omegaconf import open_dict

    import runner

    timer = StepTimer(warmup, steps)
    with tempfile.TemporaryDirectory(prefix="paperlab-overhead-") as out:
        extra = ["logger=csv"] if defaults else ["debug=bench"]
        cfg = compose(None, base_overrides(steps) + extra, out)
        with open_dict(cfg):
            cfg.callbacks = cfg.get("callbacks") or {}
            cfg.callbacks["step_timer"] = {"_target_": "benchmarks.overhead._timer_callback"}
        _TIMERS.append(timer)
        try:
            runner.run(cfg)
        finally:
            _TIMERS.pop()
    return (timer.t1 - timer.t0) / (steps - warmup), timer.loss


_TIMERS: list[StepTimer] = []


def _timer_callback():
    """Hydra target for the timer of the run in progress (callbacks are instantiated from the config)."""
    return _TIMERS[-1].callback


def run_plain(steps: int, warmup: int) -> tuple[float, float]:
    """The same training as a hand-written PyTorch loop."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from datamodules.common.sampling import StepStreamSampler
    from lightning_modules.common.backbone import build_backbone
    from lightning_modules.common.lm import warmup_cosine

    with tempfile.TemporaryDirectory(prefix="paperlab-overhead-") as out:
        cfg = compose(None, base_overrides(steps) + ["debug=bench"], out)
        torch.manual_seed(cfg.seed)
        dm = instantiate(cfg.data, _convert_="all")
        dm.setup("fit")
        spec = OmegaConf.to_container(cfg.backbone, resolve=True)
        model = build_backbone(spec)
        model.train()
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        opt_cfg = cfg.model.optimizer
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.model.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=opt_cfg.lr, betas=tuple(opt_cfg.betas))
        sch = cfg.model.scheduler
        scheduler = warmup_cosine(opt, sch.warmup_steps, sch.total_steps, sch.min_ratio)
        sampler = StepStreamSampler(len(dm.train_set), steps * dm.batch_size, seed=cfg.data.seed)
        loader = torch.utils.data.DataLoader(dm.train_set, batch_size=dm.batch_size, sampler=sampler, drop_last=True)
        clip = cfg.trainer.gradient_clip_val
        t0 = None
        for step, batch in enumerate(loader, 1):
            out_ = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
            opt.zero_grad(set_to_none=True)
            out_.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            scheduler.step()
            if step == warmup:
                t0 = time.perf_counter()
            if step == steps:
                loss = out_.loss.item()
                break
        t1 = time.perf_counter()
    return (t1 - t0) / (steps - warmup), loss


def time_cfg_job(repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "run.py", "--cfg", "job"], cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-defaults", action="store_true", help="leave out the default-callbacks variant")
    args = ap.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        ap.error("need 0 < --warmup < --steps")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    import lightning  # noqa: F401  (import cost outside the timings)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    variants = ["plain", "bench"] + ([] if args.skip_defaults else ["default"])
    best: dict[str, float] = {v: math.inf for v in variants}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else reversed(variants):  # alternate the order between rounds
            if v == "plain":
                sec, loss = run_plain(args.steps, args.warmup)
            else:
                sec, loss = run_framework(args.steps, args.warmup, defaults=(v == "default"))
            best[v] = min(best[v], sec)
            losses[v] = loss
            print(f"round {r + 1} {v:8s} {1 / sec:6.2f} steps/s  ({sec * 1000:.1f} ms/step, last loss {loss:.4f})", flush=True)
    cfg_times = time_cfg_job()
    tokens = 256 * 8
    print("\n== framework overhead (tiny LLaMA h128 L4 V2048, seq 256, batch 8, "
          f"{args.steps - args.warmup} timed steps, best of {args.rounds}, {args.threads} threads) ==")
    for v in variants:
        print(f"{v:8s} {1 / best[v]:6.2f} steps/s  {tokens / best[v]:8.0f} tokens/s  last loss {losses[v]:.4f}")
    ratio_bench = best["bench"] / best["plain"]
    spread = max(losses.values()) - min(losses.values())
    print(f"same computation: last losses differ by at most {spread:.2e} (same init, data order, optimizer)")
    print(f"bench / plain    time ratio {ratio_bench:.3f}x  (target <= 1.05x)")
    result = {"steps_per_s": {v: 1 / best[v] for v in variants}, "ratio_bench": ratio_bench, "loss_spread": spread,
              "cfg_job_s": {"min": min(cfg_times), "median": statistics.median(cfg_times)}}
    if "default" in variants:
        result["ratio_default"] = best["default"] / best["plain"]
        print(f"default / plain  time ratio {result['ratio_default']:.3f}x")
    print(f"python run.py --cfg job: min {min(cfg_times):.2f} s, median {statistics.median(cfg_times):.2f} s "
          f"over {len(cfg_times)} runs (target < 2 s)")
    return result


if __name__ == "__main__":
    main()
