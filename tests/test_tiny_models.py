"""The cached tiny models are keyed on everything that trains them, and are built only when asked."""
from __future__ import annotations

import shutil

import pytest

from datamodules.common import tiny_models
from datamodules.common.tiny_models import ROOT, code_files, key


@pytest.fixture
def checkout(tmp_path):
    """A copy of the files tiny-lm's key reads, plus one the experiment never runs."""
    entry = tiny_models.TINY_MODELS["tiny-lm"]
    for rel in [*entry.configs, *code_files("tiny-lm"), "lightning_modules/hici/module.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_key_covers_configs_code_and_libraries(checkout, monkeypatch):
    files = code_files("tiny-lm")
    for needed in ("runner.py", "lightning_modules/common/lm.py", "lightning_modules/common/backbone.py",
                   "datamodules/text.py", "datamodules/common/tokenizer.py", "datamodules/common/sampling.py",
                   "callbacks/export.py"):
        assert needed in files
    assert not any(f.startswith("lightning_modules/hici") for f in files)

    before = key("tiny-lm", checkout)
    assert before == key("tiny-lm")  # the copy is the checkout
    (checkout / "lightning_modules/hici/module.py").write_text("# not run by lm_tiny\n")
    assert key("tiny-lm", checkout) == before
    for rel in ("lightning_modules/common/lm.py", "datamodules/common/sampling.py", "conf/model/lm.yaml"):
        original = (checkout / rel).read_text()
        (checkout / rel).write_text(original + "\n# changed\n")
        assert key("tiny-lm", checkout) != before, rel
        (checkout / rel).write_text(original)
    assert key("tiny-lm", checkout) == before

    real = tiny_models.version
    monkeypatch.setattr(tiny_models, "version", lambda lib: real(lib) + ("+other" if lib == "transformers" else ""))
    assert key("tiny-lm", checkout) != before


def test_not_built_is_one_line_naming_the_build_step(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path))
    monkeypatch.delenv(tiny_models.BUILD_ON_DEMAND, raising=False)  # as a user's shell has it
    with pytest.raises(tiny_models.PretrainedNotFoundError,
                       match=r"not built for this checkout — run `python -m datamodules.common.tiny_models build tiny-lm`"):
        tiny_models.resolve_pretrained("tiny-lm")
    with pytest.raises(ValueError, match="no tiny model 'tiny-xl': choose one of tiny-lm"):
        tiny_models.build("tiny-xl")


def test_the_suite_builds_a_missing_model_when_first_resolved(tmp_path, monkeypatch):
    """With ``PAPERLAB_BUILD_TINY_MODELS=1`` (the test suite's setting) a missing tiny model is built on first use,
    once, and only that one."""
    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path))
    monkeypatch.setenv(tiny_models.BUILD_ON_DEMAND, "1")
    built = []

    def fake_build(name):
        built.append(name)
        target = tiny_models.model_dir(name)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        return target

    monkeypatch.setattr(tiny_models, "build", fake_build)
    assert tiny_models.resolve_pretrained("tiny-lm") == str(tiny_models.model_dir("tiny-lm"))
    assert tiny_models.resolve_pretrained("tiny-lm") == str(tiny_models.model_dir("tiny-lm"))
    assert built == ["tiny-lm"]


def test_only_the_experiment_as_configured_is_published(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    assert tiny_models.publish("tiny-lm", export, "lm_tiny", ["trainer.max_steps=5"]) is None
    assert tiny_models.publish("tiny-lm", export, "hici_tiny", []) is None
    target = tiny_models.publish("tiny-lm", export, "lm_tiny", ["experiment=lm_tiny", "paths.log_dir=/x", "logger=csv"])
    assert target == tiny_models.model_dir("tiny-lm") and (target / "config.json").exists()
    assert tiny_models.resolve_pretrained("tiny-lm") == str(target)
