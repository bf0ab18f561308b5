"""Experiments inherit (one base per family): every experiment resolves to exactly the config it had before.

``python tests/test_experiments_inherit.py`` wrote the before-snapshot; deleted with this test once equal."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import compose, experiments

SNAPSHOT = Path(__file__).with_name("experiments_before.yaml")


def resolved(name: str) -> dict:
    cfg = compose(name, [], output_dir="/OUTPUT")
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra")  # Hydra's runtime record (choices, overrides), not the job's config
    return plain


@pytest.mark.parametrize("name", experiments())
def test_resolved_config_unchanged(name):
    assert resolved(name) == yaml.safe_load(SNAPSHOT.read_text())[name]


if __name__ == "__main__":
    SNAPSHOT.write_text(yaml.safe_dump({n: resolved(n) for n in experiments()}, sort_keys=True))
