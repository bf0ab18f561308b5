"""Errors a user can fix, and how ``run.py`` tells them from bugs (issue 43).

A :class:`UserError` says in one line what is wrong and the fix (``<what> — <the fix>``): ``run.py`` prints it as
``error: <that line>`` on stderr and exits non-zero without a traceback (``HYDRA_FULL_ERROR=1`` shows the trace),
and a failed multirun job records it in its ``metrics.json``. A ``ValueError`` whose message opens with a config
assignment (``model.loss_type='x': choose …``, the project's way of naming a bad value; hundreds of constructors raise
them) is a user error too: it is told as that line plus the key to change. Any other exception is a bug and keeps
its traceback.

This is the lowest project layer above ``callbacks/kernels``: everything that raises may import it.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class UserError(Exception):
    """Bad input the person running paperlab can fix: config, paths, data, a missing build, an unreachable hub or
    endpoint, a missing optional dependency, hardware. Its message is one line naming the fix."""


class ConfigError(UserError, ValueError):
    """A config value or combination that cannot work."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or directory the config names is not there (data files, checkpoints, SAEs, reward models)."""


class PretrainedNotFoundError(MissingPathError):
    """A checkpoint (``backbone.pretrained`` or another key) that cannot be loaded: a tiny model not built yet, a local
    dir that is not there or holds no model, or a hub id where the hub cannot be reached."""


class MissingExtraError(UserError, ImportError):
    """An optional dependency that is not installed; the message names the ``pip install`` line."""


def one_line(text) -> str:
    """``text`` on one line (a wrapped library message joined with spaces)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


# "data.answer='x': choose …", "model.reward.compare=foo …": a dotted config key, '=', a value
_CONFIG_VALUE = re.compile(r"^\+?([a-z_][\w]*(?:\.[\w]+)+)=\S")


def config_value_error(err: BaseException) -> ConfigError | None:
    """A constructor's ``ValueError`` about one config value, as a :class:`ConfigError` naming the key to change."""
    if type(err) is not ValueError or not (m := _CONFIG_VALUE.match(str(err))):
        return None
    return ConfigError(f"{one_line(err)} — change {m.group(1)} (in the experiment's config or on the command line)")


def user_error(err: BaseException | None) -> UserError | None:
    """The user-fixable error behind ``err``: itself or what it was raised from (Hydra's ``InstantiationException``
    wraps an error raised in a constructor), or a missing module one of the project's dependency lists provides.
    None for a bug."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):
            return err
        if (value := config_value_error(err)) is not None:
            return value
        if isinstance(err, ModuleNotFoundError) and not _installed(err.name) and (extra := missing_extra(err)):
            return extra
        err = err.__cause__  # an explicit ``raise ... from``; one raised while handling another is a bug of its own
    return None


def _installed(name: str | None) -> bool:
    """The top-level package is there (a submodule it lacks is a version mismatch or a bug, not a missing install)."""
    import importlib.util

    top = (name or "").split(".")[0]
    try:
        return bool(top) and importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def full_error_asked() -> bool:
    """``HYDRA_FULL_ERROR=1``: show every error with its full traceback (Hydra's own switch)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


# --- missing optional dependencies -----------------------------------------------------------------------------------
def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("-", "_")


def missing_extra(err: ModuleNotFoundError) -> MissingExtraError | None:
    """A missing module that pyproject.toml lists (an extra, or the base dependencies of a broken install) as one line
    with its pip command; None for any other (a bug: a misspelt import or ``_target_``)."""
    import tomllib

    module = (err.name or "").split(".")[0].lower()
    try:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("project", {})
    except OSError:  # installed without the source tree
        return None
    groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    for extra, reqs in groups.items():
        if module and any(_requirement_name(r) == module for r in reqs):
            target = f"'.[{extra}]'" if extra else "."
            what = f"the {extra!r} extra" if extra else "a base dependency (a broken install?)"
            return MissingExtraError(f"missing module {module!r}, from {what} — "
                                     f"pip install -c constraints.txt -e {target}")
    return None


# --- checkpoints from the hub ----------------------------------------------------------------------------------------
OFFLINE_NOTE = "with HF_HUB_OFFLINE=1 only local dirs and the hub cache are read"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_hub_id(value) -> bool:
    """A hub repo id (``org/name``), not a path that exists here."""
    return (isinstance(value, str) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", value) is not None
            and not Path(value).exists())


def check_hub_cache(value: str, key: str = "backbone.pretrained", revision: str | None = None) -> None:
    """Before anything is built: with ``HF_HUB_OFFLINE=1`` a hub id that is not in the hub cache fails as one line.
    (Online, reachability is only known by asking: the loader's :func:`hub_loading` reports it.)"""
    if not is_hub_id(value) or not _offline():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(value, "config.json", revision=revision), str):
        raise PretrainedNotFoundError(
            f"{key}={value!r} is a hub id, HF_HUB_OFFLINE=1 is set and it is not in the hub cache — download it "
            f"where the hub is reachable (hf download {value} --local-dir <dir>) and pass {key}=<local dir>, "
            "or unset HF_HUB_OFFLINE where the hub is reachable")


# Files without which a local dir holds no loadable <what> (transformers then raises a ValueError, not an OSError).
LOADABLE = {"tokenizer": ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"),
            "processor": ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")}


@contextmanager
def hub_loading(value, key: str = "backbone.pretrained", what: str = "model", note: str = ""):
    """Around a ``from_pretrained`` of ``value`` (a hub id, a local dir or a tiny model name, configured by ``key``):
    transformers' ``OSError`` (no network, ``HF_HUB_OFFLINE=1`` without the files cached, a missing or gated repo)
    becomes one line naming ``key=<local dir>`` and ``HF_HUB_OFFLINE``, and a local dir without the files for
    ``what`` one line saying so; ``note`` is added to the fix (e.g. which key a value follows)."""
    try:
        yield
    except UserError:
        raise
    except (OSError, ValueError) as err:
        from datamodules.common.tiny_models import is_tiny_model, model_dir

        local = Path(model_dir(value)) if is_tiny_model(value) else Path(os.path.expanduser(str(value)))
        if isinstance(err, ValueError) and not (local.is_dir() and not _holds(local, what)):
            raise  # a ValueError from a dir that has the files: not a missing checkpoint
        cause = one_line(err)
        cause = f"{type(err).__name__}: {cause[:160]}{'…' if len(cause) > 160 else ''}"
        if local.is_dir():
            raise PretrainedNotFoundError(
                f"{key}={value!r} holds no loadable {what} ({cause}) — point {key} at a dir with the {what}'s files "
                f"(save_pretrained's output){note}") from err
        raise PretrainedNotFoundError(
            f"could not load the {what} of {key}={value!r} ({cause}) — no hub here? download it where the hub is "
            f"reachable and pass {key}=<local dir>{note}; {OFFLINE_NOTE}") from err


def _holds(directory: Path, what: str) -> bool:
    return any((directory / name).exists() for name in LOADABLE.get(what, ("config.json",)))
