"""The recipes read through libyaml (`launcher_scripts.config.yaml_loader`) read exactly as
OmegaConf's own pure-Python loader reads them, with its rules and its errors."""

from __future__ import annotations

import io

import pytest
import yaml
from omegaconf import OmegaConf

from launcher_scripts.config import yaml_loader
from launcher_scripts.config.compose import conf_dir

OMEGACONF_LOADER = yaml_loader._OMEGACONF_LOADER
RECIPES = sorted(conf_dir().rglob("*.yaml"))


def read(text: str, loader: type) -> object:
    return yaml.load(io.StringIO(text), Loader=loader)


def test_omegaconf_reads_through_libyaml() -> None:
    """Hydra composes through OmegaConf.load, which asks the hook for its loader."""
    assert yaml.__with_libyaml__, "PyYAML without libyaml: recipes are read in pure Python"
    import omegaconf._utils

    assert omegaconf._utils.get_yaml_loader() is yaml_loader.loader()
    assert issubclass(yaml_loader.loader(), yaml._yaml.CParser)


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(conf_dir())) for p in RECIPES])
def test_every_shipped_recipe_reads_the_same(path) -> None:
    text = path.read_text(encoding="utf-8")
    assert OmegaConf.load(path) == OmegaConf.create(read(text, OMEGACONF_LOADER()))
    assert read(text, yaml_loader.loader()) == read(text, OMEGACONF_LOADER())


@pytest.mark.parametrize(
    "text",
    [
        "lr: 1e-4\nratio: .5\nnan: .nan\nbig: 1_000\n",  # OmegaConf's float rule, not YAML 1.1's
        "day: 2024-01-01\nstamp: 2024-01-01 10:00:00\n",  # no dates: strings
        "a: yes\nb: off\nc: null\nd: ~\ne: '1'\nf: ${x.y}\ng: [1, {h: 2}]\n",
        "key: |\n  two\n  lines\nfolded: >\n  one\n  line\n",
    ],
)
def test_values_read_as_omegaconf_reads_them(text: str) -> None:
    assert read(text, yaml_loader.loader()) == read(text, OMEGACONF_LOADER())


def test_a_duplicate_key_is_still_an_error() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="found duplicate key lr"):
        OmegaConf.load(io.StringIO("lr: 1\nlr: 2\n"))


def test_broken_yaml_is_still_a_yaml_error() -> None:
    with pytest.raises(yaml.YAMLError):
        OmegaConf.load(io.StringIO("a: [1\nb: 2\n"))
