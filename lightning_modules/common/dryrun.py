"""``debug=dryrun``: a paper-scale experiment's own task, end to end on CPU, with only its sizes changed.

    python run.py experiment=grpo_qwen25_7b debug=dryrun

``runner.run`` calls :func:`prepare` on the composed config before anything is built (``cfg.dryrun`` is set by
``conf/debug/dryrun.yaml``). It rewrites the config in place and prints one block saying what it changed:

- **model**: the backbone becomes its same-family shrunk twin (``lightning_modules/common/shrunk.py``: a random-init
  checkpoint of the real transformers class, GQA ratio, tying, MoE routing, vision tower, with the family's
  tokenizer and chat template); a from-scratch backbone keeps ``pretrained: null`` with the shrunk config. Every
  other ``pretrained`` hub id in the config (a tokenizer, a reference model), and any checkpoint dir it names under
  the data root (a local copy of OLMoE, an earlier run's export), becomes its stand-in too.
- **data**: ``local.data_root`` moves to ``<run dir>/dryrun_data`` and every path the config reads under it is
  written there in its dataset's layout (``datamodules/common/miniature.py``; a path no layout claims fails in
  one line). An input that is an earlier experiment's output (a checkpoint, a run's metrics.json) is made by that
  experiment's own dry run first. An lm-eval suite evaluates same-named local tasks (the harness reads the hub).
- **endpoints**: every ``local.endpoints.*`` entry, judge ``base_url`` and endpoint ``url`` points at a stand-in
  server on the loopback address (``lightning_modules/common/endpoint_standin.py``), with a dummy key in each
  key variable that is not set.
- **strategy**: the experiment's own on CPU: DDP and FSDP2 (``ModelParallelStrategy``) on ``dryrun.processes``
  processes (gloo), DeepSpeed through ``callbacks/deepspeed_cpu.py``, else one process; ``num_nodes`` 1; the
  precision kept where CPU has it (``16-mixed`` becomes ``bf16-mixed``).
- **sizes**: ``dryrun.steps`` optimizer steps, a validation (of one batch) after each, one test batch; sequence lengths, batch sizes, generation lengths and evaluation counts capped (``SIZE_CAPS``).
  An experiment whose method needs other small sizes lists them in a top-level ``dryrun_overrides:`` mapping
  (dotted key -> value), applied last.

Lightning's multi-process CPU launch runs the command line again in each process, which repeats this preparation
(the twin and the data are found already built); in-process callers use ``dryrun.processes=1``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

# key -> cap, applied wherever the key holds an int under data / model (their nested nodes too)
SIZE_CAPS = {
    "seq_len": 256, "eval_seq_len": 256, "max_seq_len": 256, "max_length": 256, "context_len": 256,
    "max_prompt_tokens": 128,
    "batch_size": 2, "eval_batch_size": 2, "micro_batch_size": 2, "calib_batch_size": 2, "train_batch_size": 2,
    "max_new_tokens": 16, "val_max_new_tokens": 16, "answer_tokens": 16,
    "min_interval": 4,  # Hista / SVEB: a state every 4 of the 16 generated tokens
    "n_calib": 4, "max_val_sequences": 4, "max_windows": 4, "max_documents": 8, "test_documents": 2,
    "samples_per_task": 2, "n_test": 8,  # at most 8 test items generated or read (one test batch runs)
    "num_workers": 0,
    # long-context evaluation (HiCI / LongLoRA): lists of lengths are capped element-wise
    "ppl_lengths": 256, "passkey_max_length": 512, "passkey_interval": 256, "passkey_samples": 2,
    "longbench_max_length": 512, "test_min_tokens": 256, "test_max_tokens": 256,
}
MIN_FRACTION = 0.2  # data.{val,test}_fraction below this hold no document of a miniature corpus
_SKIP = ("hydra", "paper", "backbone", "local", "dryrun", "dryrun_overrides", "paths")
_HUB_TOKENIZERS = ("load_tokenizer", "_tokenizer")  # _target_ endings that take a tokenizer id in `pretrained`


def is_rank_zero() -> bool:
    """The launching process (Lightning's CPU launch re-runs the command with LOCAL_RANK set in the others)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def prepare(cfg: DictConfig) -> dict:
    """Rewrite ``cfg`` for a dry run (see the module docstring); returns what changed, each line printed (rank 0)
    as soon as it is done, so a step that fails names itself after the ones that worked."""
    if is_rank_zero():  # the preflight (debug/dryrun.yaml: preflight=print) has run on the real sizes already
        print(f"[dryrun] {_experiment_name()}: the experiment's own task on CPU, sizes shrunk", flush=True)
    opts = cfg.dryrun
    notes: dict[str, str] = {}

    def note(what: str, text: str) -> None:
        notes[what] = text
        if text and is_rank_zero():
            print(f"[dryrun]   {what:<10} {text}", flush=True)

    with open_dict(cfg):
        default_root = Path(cfg.paths.output_dir) / "dryrun_data"
        root = Path(opts.get("data_root") or default_root).resolve()
        if is_rank_zero() and root == default_root.resolve():
            shutil.rmtree(root, ignore_errors=True)  # this run's own miniatures, written fresh each time
        cfg.local.data_root = str(root)
        text, original = _backbone(cfg, root)
        note("model", text)
        note("hub ids", _hub_ids(cfg, original, root))
        note("sizes", _sizes(cfg, int(opts.steps)))
        note("overrides", _overrides(cfg))
        note("lm-eval", _harness_tasks(cfg, root))
        note("data root", _data(cfg, root))
        note("endpoints", _endpoints(cfg, root))
        note("strategy", _strategy(cfg, int(opts.processes)))
    return notes


def _experiment_name() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices.get("experiment"))
    except Exception:  # noqa: BLE001 - no Hydra context (a hand-built config)
        return "experiment"


# --- model ------------------------------------------------------------------------------------------------------------
def _plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _count(spec: dict) -> int:
    from lightning_modules.common.backbone import build_backbone, count_parameters

    return count_parameters(build_backbone({**spec, "pretrained": None}, meta=True))


def _model_id(parent: DictConfig, key: str, root: Path) -> str | None:
    """What a ``pretrained`` value names when the dry run must stand in for it: a hub id as written, or a checkpoint
    dir under the data root, named by its place there (``olmoe/OLMoE-1B-7B-0924``); None otherwise."""
    raw = parent._get_node(key)._value()
    if _is_hub_id(raw):
        return raw
    if isinstance(raw, str) and "local.data_root" in raw:
        value = parent[key]
        if isinstance(value, str) and value.startswith(str(root)):
            return Path(value).relative_to(root).as_posix()
    return None


def _tokenizer_hub_id(cfg: DictConfig, root: Path) -> str | None:
    """The data's tokenizer id when it is not the backbone's own (a from-scratch model's tokenizer)."""
    tok = cfg.get("data", {}).get("tokenizer") if isinstance(cfg.get("data"), DictConfig) else None
    if not isinstance(tok, DictConfig) or "pretrained" not in tok:
        return None
    return _model_id(tok, "pretrained", root)


def _backbone(cfg: DictConfig, root: Path) -> tuple[str, str | None]:
    """The backbone -> its shrunk twin (pretrained) or its shrunk config (from scratch); (what changed, the
    original ``pretrained``)."""
    from datamodules.common.family_tokenizers import family_tokenizer_dir, flavour_of
    from lightning_modules.common.shrunk import shrunk_spec, spec_flavour, twin_dir, twin_spec

    if not isinstance(cfg.get("backbone"), DictConfig) or "family" not in cfg.backbone:
        return "", None
    spec = _plain(cfg.backbone)
    original = spec.get("pretrained")
    if original and str(original).startswith(str(root)):  # a checkpoint under the data root: named by its place there
        spec["pretrained"] = Path(original).relative_to(root).as_posix()
    before = _count(spec)
    if spec.get("pretrained"):
        small = twin_spec(spec)
        where = f"twin checkpoint {twin_dir(spec)}"
    else:  # from scratch: random init from the shrunk config; the tokenizer is the data's (a hub id) or the BPE
        hub = _tokenizer_hub_id(cfg, root)
        if hub is None:
            flavour = None
            keep_vocab = cfg.backbone.config._get_node("vocab_size")._value() if "vocab_size" in cfg.backbone.config else None
        else:
            flavour, keep_vocab = flavour_of(hub), None
        small = shrunk_spec(spec, flavour or spec_flavour(spec))
        if keep_vocab is not None:  # the corpus BPE's size, as the config says
            small["config"]["vocab_size"] = keep_vocab
        where = "random init (from scratch, as configured)"
        if hub is not None:
            cfg.data.tokenizer.pretrained = str(family_tokenizer_dir(*flavour))
            where += f"; data tokenizer {hub} -> {flavour[0]} stand-in"
    if str(small.get("attn_implementation")) == "flash_attention_2":
        small["attn_implementation"] = "sdpa"  # flash-attn has no CPU kernels
        where += "; flash_attention_2 -> sdpa"
    cfg.backbone = OmegaConf.create(small)
    after = _count({**small, "config": {k: v for k, v in small["config"].items() if not _unresolved(v)}}) \
        if not any(_unresolved(v) for v in small["config"].values()) else 0
    text = _shape(small)
    return (f"{spec.get('pretrained') or spec['family'] + ' from scratch'} ({before / 1e9:.2f}B params) -> "
            f"{after / 1e6:.2f}M params ({text}), {where}"), original


def _shape(spec: dict) -> str:
    cfg = spec["config"]
    text = cfg.get("text_config") or cfg
    layers = text.get("num_hidden_layers") or text.get("n_layer")
    hidden = text.get("hidden_size") or text.get("n_embd")
    heads = text.get("num_attention_heads") or text.get("n_head")
    kv = text.get("num_key_value_heads") or heads
    return f"{layers} layers, width {hidden}, {heads}/{kv} heads"


def _unresolved(value) -> bool:
    return isinstance(value, str) and "${" in value


def _is_hub_id(value) -> bool:
    """``org/name`` (or a bare name) that is neither a local path, a tiny model nor an interpolation."""
    from datamodules.common.tiny_models import is_tiny_model

    return (isinstance(value, str) and "/" in value and not _unresolved(value) and not is_tiny_model(value)
            and not value.startswith(("/", "./", "../", "~")) and not Path(value).exists())


def _int_lists(node: DictConfig, path: str):
    """(dotted path, parent, key) of every list of plain ints under ``node`` (no interpolations)."""
    for key in node.keys():
        child = node._get_node(key)
        sub = f"{path}.{key}"
        if isinstance(child, DictConfig) and not child._is_interpolation() and not child._is_none():
            yield from _int_lists(child, sub)
        elif isinstance(child, ListConfig) and not child._is_interpolation() and not child._is_none() and \
                all(not child._get_node(i)._is_interpolation() and isinstance(child[i], int)
                    and not isinstance(child[i], bool) for i in range(len(child))):
            yield sub, node, key


# --- other hub ids ----------------------------------------------------------------------------------------------------
def _walk(node, path: str = ""):
    """(dotted path, parent node, key) of every leaf of ``node``, interpolations left as they are."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = node._get_node(key)
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation() and not child._is_none():
                yield from _walk(child, sub)
            else:
                yield sub, node, key
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            child = node._get_node(i)
            sub = f"{path}[{i}]"
            if isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation() and not child._is_none():
                yield from _walk(child, sub)
            else:
                yield sub, node, i


def _top_level(cfg: DictConfig):
    """Every leaf of the run's own config (a top-level value too: RLKV evaluation's ``rlkv_gates``), not Hydra's,
    the header's or the machine's."""
    for key in cfg.keys():
        if key in _SKIP:
            continue
        node = cfg._get_node(key)
        if isinstance(node, (DictConfig, ListConfig)):
            yield from _walk(node, str(key))
        else:
            yield str(key), cfg, key


def _hub_ids(cfg: DictConfig, original: str | None, root: Path) -> str:
    """Every other ``pretrained: <hub id>`` -> the backbone's twin (the same id), a family tokenizer stand-in (a
    tokenizer's), or the twin of the ``conf/backbone`` spec naming that id (a second model)."""
    from datamodules.common.family_tokenizers import family_tokenizer_dir, flavour_of
    from lightning_modules.common.shrunk import twin_dir

    changed = []
    for path, parent, key in list(_top_level(cfg)):
        if path == "model.tokenizer" and _is_hub_id(parent._get_node(key)._value()):
            raw = parent[key]  # a zero-shot suite's tokenizer id: the twin's own (its vocabulary), else the family's
            twin = cfg.backbone.get("pretrained") if isinstance(cfg.get("backbone"), DictConfig) else None
            parent[key] = twin if twin and Path(str(twin)).is_dir() else str(family_tokenizer_dir(*flavour_of(raw)))
            changed.append(f"{path} {raw}")
            continue
        if key != "pretrained":
            continue
        raw = _model_id(parent, key, root)
        if raw is None:
            continue
        target = str(parent.get("_target_", ""))
        if raw == original or parent[key] == original:
            parent[key] = cfg.backbone.pretrained
        elif target.endswith(_HUB_TOKENIZERS):
            parent[key] = str(family_tokenizer_dir(*flavour_of(raw)))
        else:
            spec = _backbone_spec_named(raw)
            if spec is None:
                raise FileNotFoundError(f"dry run: {path}={raw!r} is a hub model no conf/backbone/*.yaml describes: "
                                        "add its spec there so the dry run can build its shrunk twin")
            parent[key] = str(twin_dir(spec))
        changed.append(f"{path} {raw}")
    return ", ".join(changed) + " -> stand-ins" if changed else ""


def _backbone_spec_named(hub_id: str) -> dict | None:
    import yaml

    for path in sorted((Path(__file__).resolve().parents[2] / "conf" / "backbone").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if spec.get("pretrained") == hub_id:
            return spec
    return None


# --- sizes ------------------------------------------------------------------------------------------------------------
def _sizes(cfg: DictConfig, steps: int) -> str:
    """``SIZE_CAPS`` under data / model, held-out fractions a miniature corpus can fill, and the trainer's loop:
    ``steps`` optimizer steps, one batch per validation and test, accumulation kept but at most 2."""
    changed = []
    for top in ("data", "model"):
        node = cfg.get(top)
        if not isinstance(node, DictConfig):
            continue
        for path, parent, key in list(_walk(node, top)):
            value = parent._get_node(key)._value()
            cap = SIZE_CAPS.get(key)
            if cap is not None and isinstance(value, int) and not isinstance(value, bool) and value > cap:
                parent[key] = cap
                changed.append(f"{path} {value}->{cap}")

            elif top == "data" and key in ("val_fraction", "test_fraction") and isinstance(value, float) \
                    and 0 < value < MIN_FRACTION:
                parent[key] = MIN_FRACTION
                changed.append(f"{path} {value}->{MIN_FRACTION}")
        for path, parent, key in list(_int_lists(node, top)):  # lists of sizes (lengths to evaluate at): each capped
            value, cap = list(parent[key]), SIZE_CAPS.get(key)
            if cap is not None and value and max(value) > cap:
                parent[key] = sorted({min(v, cap) for v in value})
                changed.append(f"{path} {value}->{list(parent[key])}")
    tr = cfg.trainer
    fit = "fit" in str(cfg.task)
    plan = {"limit_val_batches": 1, "limit_test_batches": 1, "num_sanity_val_steps": 0, "log_every_n_steps": 1}
    if fit:  # a validation after each optimizer step (manual optimisation: after each batch, however many steps)
        accumulate = min(int(tr.get("accumulate_grad_batches") or 1), 2)
        plan.update(max_steps=steps, max_epochs=-1, val_check_interval=accumulate, check_val_every_n_epoch=None,
                    accumulate_grad_batches=accumulate)
    for key, value in plan.items():
        old = tr.get(key)
        if old != value or type(old) is not type(value):  # limit_val_batches 1.0 is all batches, 1 is one
            tr[key] = value
            if key in ("max_steps", "accumulate_grad_batches", "limit_val_batches", "limit_test_batches"):
                changed.append(f"trainer.{key} {old}->{value}")
    return ", ".join(changed)


def _overrides(cfg: DictConfig) -> str:
    """The experiment's own dry-run sizes (``dryrun_overrides: {dotted.key: value}``), applied last."""
    extra = cfg.get("dryrun_overrides")
    if not extra:
        return ""
    for key, value in extra.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return "the experiment's dryrun_overrides: " + ", ".join(f"{k}={v}" for k, v in extra.items())


# --- data -------------------------------------------------------------------------------------------------------------
def _harness_tasks(cfg: DictConfig, root: Path) -> str:
    """An lm-eval suite (``ZeroShotEvalModule``) reads its tasks' datasets from the hub through the harness's own task
    definitions: a dry run evaluates same-named multiple-choice tasks over miniature local files instead
    (``datamodules/common/miniature.write_harness_tasks``), the harness's registry off."""
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not str(model.get("_target_", "")).endswith("ZeroShotEvalModule"):
        return ""
    model.include_path, model.include_defaults, model.datasets_cache = str(root / "lm_eval_tasks"), False, None
    return f"{', '.join(model.tasks)} -> same-named local multiple-choice stand-ins under {root / 'lm_eval_tasks'}"


def _data(cfg: DictConfig, root: Path) -> str:
    """Every path under ``local.data_root`` the config reads -> its miniature; ``???`` file keys -> one line."""
    from datamodules.common.miniature import write_miniature

    _register_model_layouts()
    data = cfg.get("data")
    if isinstance(data, DictConfig):
        for key in ("files", "val_files", "test_files"):
            if key in data and data._get_node(key)._is_missing():
                raise ValueError(f"data.{key} is ??? in this experiment: the dry run writes miniatures where the "
                                 f"config points; set data.{key}=${{local.data_root}}/<dataset>/... in the experiment")
    paths = {}
    for path, parent, key in list(_top_level(cfg)):
        node = parent._get_node(key)
        raw = node._value()
        if not (isinstance(raw, str) and ("local.data_root" in raw or raw.startswith(str(root)))):
            continue  # a path the config reads under the data root (or one this preparation put there)
        value = parent[key]
        if isinstance(value, str) and value.startswith(str(root)):
            paths.setdefault(value, path)
    if not paths:
        return f"{root} (the config reads nothing under local.data_root)"
    written = [f"{Path(p).relative_to(root)} ({write_miniature(p, root, cfg)})" if is_rank_zero()
               else str(Path(p).relative_to(root)) for p in sorted(paths)]
    return f"{root}: " + ", ".join(written)


# Model directories a config reads under the data root are written by the dry run itself (they need the twins).
REWARD_MODEL_SPEC = "meta-llama/Llama-3.1-8B-Instruct"  # a typical base of released reward models (Skywork-Reward)


def _write_reward_model(target: Path, cfg) -> None:
    """A sequence-classification reward model dir (one logit, as ``common/rl/scorers.RewardModel`` loads it): the
    shrunk twin of a Llama-3.1-8B-Instruct spec with a score head, and its chat tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lightning_modules.common.backbone import build_config
    from lightning_modules.common.shrunk import twin_dir, twin_spec

    spec = _backbone_spec_named(REWARD_MODEL_SPEC)
    config = build_config(twin_spec(spec))
    config.num_labels = 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(twin_dir(spec))).save_pretrained(str(target))


# An input that is an earlier experiment's output (HiCI's SFT stage starts from the 16K run's checkpoint, RLKV's
# evaluation reads the probe run's gates) is made the way a user makes it: by running that experiment first, here its
# own dry run (same twin, so the shapes agree), in a subprocess under ``<data root>/upstream/<experiment>``.
def _dry_run_upstream(experiment: str, run_dir: Path, cfg) -> Path:
    import subprocess
    import sys

    from datamodules.common.errors import ConfigError

    root_dir = Path(__file__).resolve().parents[2]
    if not (root_dir / "conf" / "experiment" / f"{experiment}.yaml").is_file():
        raise ConfigError(f"dry run: {run_dir.name} names no experiment (conf/experiment/{experiment}.yaml): the "
                          "earlier run whose output this experiment reads must be named by it")
    processes = int(cfg.dryrun.processes) if cfg is not None and "dryrun" in cfg else 1
    print(f"[dryrun]   upstream   {experiment}: its own dry run first -> {run_dir}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "dryrun.log", "w") as log:
        proc = subprocess.run([sys.executable, str(root_dir / "run.py"), f"experiment={experiment}", "debug=dryrun",
                               f"dryrun.processes={processes}", f"hydra.run.dir={run_dir}",
                               "callbacks.progress_bar=null"], cwd=root_dir, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"dry run: the upstream dry run of {experiment} failed (rc {proc.returncode}): see "
                           f"{run_dir / 'dryrun.log'}")
    return run_dir


def _write_upstream_checkpoint(target: Path, cfg) -> None:
    """``checkpoints/<experiment>.ckpt``: that experiment's best checkpoint as one file (a DeepSpeed checkpoint dir
    converted with Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``, as the experiments' headers say)."""
    run_dir = _dry_run_upstream(target.stem, target.parent.parent / "upstream" / target.stem, cfg)
    saved = sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not saved:
        raise FileNotFoundError(f"dry run: the upstream dry run of {target.stem} saved no checkpoint under {run_dir}")
    best = next((p for p in reversed(saved) if p.name.startswith("best")), saved[-1])
    target.parent.mkdir(parents=True, exist_ok=True)
    if best.is_dir():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(best), str(target))
    else:
        shutil.copyfile(best, target)


def _write_upstream_run(target: Path, cfg) -> None:
    """``runs/<experiment>/<file>``: a file that experiment's run writes into its run dir (RLKV's gates in its
    metrics.json): the dry run of that experiment, in that dir."""
    rel = target.relative_to(Path(cfg.local.data_root)).parts
    _dry_run_upstream(rel[1], Path(cfg.local.data_root) / "runs" / rel[1], cfg)
    if not target.exists():
        raise FileNotFoundError(f"dry run: the upstream dry run of {rel[1]} wrote no {'/'.join(rel[2:])}")


def _register_model_layouts() -> None:
    from datamodules.common.miniature import LAYOUTS, register_layout

    for layout, writer in (("models/reward_model", _write_reward_model),
                           ("checkpoints/*.ckpt", _write_upstream_checkpoint),
                           ("runs/*/*", _write_upstream_run)):
        if layout not in LAYOUTS:
            register_layout(layout)(writer)


# --- endpoints --------------------------------------------------------------------------------------------------------
_STANDIN = {}


def _endpoints(cfg: DictConfig, root: Path) -> str:
    """The endpoints the config uses (``local.endpoints.<name>`` it refers to, endpoint ``url``s, ChatJudge's
    ``base_url``) -> the loopback stand-in; a dummy key in each key variable they name that is not set."""
    import re

    used, urls, judges, keys = set(), [], [], set()
    for path, parent, key in list(_top_level(cfg)):
        node = parent._get_node(key)
        raw = node._value()
        if isinstance(raw, str):
            used |= set(re.findall(r"local\.endpoints\.(\w+)", raw))
        if key in ("url", "base_url") and isinstance(raw, str) and raw.startswith("http"):
            urls.append((path, parent, key))
        if key == "_target_" and str(raw).endswith("ChatJudge"):
            judges.append((path.rsplit(".", 1)[0], parent))
            keys.add("OPENAI_API_KEY")  # the openai client's own variable
        if key == "api_key_env" and not node._is_missing():
            keys.add(str(parent[key]))
        if key == "cache_dir" and "url" in parent:  # the stand-in's replies are not worth keeping
            parent[key] = str(root / "endpoint_cache")
    endpoints = cfg.get("local", {}).get("endpoints") or {}
    for name in sorted(used & set(endpoints.keys())):
        urls.append((f"local.endpoints.{name}.url", endpoints[name], "url"))
        keys.add(str(endpoints[name].get("api_key_env")))
    if not urls and not judges:
        return ""
    if "server" not in _STANDIN:
        from lightning_modules.common.endpoint_standin import StandInEndpoint

        server = StandInEndpoint()
        _STANDIN["server"], _STANDIN["url"] = server, server.start()
    url = _STANDIN["url"]
    for _, parent, key in urls:
        parent[key] = url
    for _, parent in judges:
        parent["base_url"] = url
    dummies = sorted(k for k in keys if k and k != "None" and not os.environ.get(k))
    for k in dummies:
        os.environ[k] = "dryrun-dummy-key"
    where = [p for p, _, _ in urls] + [f"{p}.base_url" for p, _ in judges]
    return f"{', '.join(where)} -> stand-in {url}" + (f"; dummy keys in {', '.join(dummies)}" if dummies else "")


# --- strategy ---------------------------------------------------------------------------------------------------------
def _strategy(cfg: DictConfig, processes: int) -> str:
    tr = cfg.trainer
    strategy = tr.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy or "")
    devices = tr.get("devices", 1)
    n = devices if isinstance(devices, int) else (len(devices) if isinstance(devices, (list, ListConfig)) else 1)
    world = max(n, 1) * int(tr.get("num_nodes") or 1)
    before = f"{target.rsplit('.', 1)[-1] or 'single device'} on {n} {tr.get('accelerator')} x {tr.get('num_nodes') or 1} node(s)"
    tr.accelerator, tr.num_nodes = "cpu", 1
    if "deepspeed" in target.lower():
        strategy._target_ = "callbacks.deepspeed_cpu.CPUDeepSpeedStrategy"
        cfg.allow_deepspeed_cpu = True
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        tr.devices = processes
        after = f"CPUDeepSpeedStrategy (stage {strategy.get('stage')}) on {processes} CPU process(es), gloo"
    elif "ModelParallelStrategy" in target and processes >= 2:
        tr.devices = processes
        after = f"ModelParallelStrategy (FSDP2) on {processes} CPU processes, gloo"
    elif ("ModelParallelStrategy" in target or world > 1 or "DDP" in target) and processes >= 2:
        tr.strategy = {"_target_": "lightning.pytorch.strategies.DDPStrategy", "process_group_backend": "gloo",
                       "find_unused_parameters": bool(strategy.get("find_unused_parameters", False))
                       if isinstance(strategy, DictConfig) else False}
        tr.devices = processes
        after = f"DDPStrategy on {processes} CPU processes, gloo"
    else:
        if world > 1 or target:
            tr.strategy = "auto"
        tr.devices = 1
        after = "one CPU process" + (" (dryrun.processes=1)" if world > 1 else "")
    precision = str(tr.get("precision"))
    if precision in ("16-mixed", "16"):
        tr.precision = "bf16-mixed"  # CPU autocast is bf16 only
        precision += " -> bf16-mixed (CPU autocast has no fp16)"
    return f"{before} -> {after}; precision {precision}"
