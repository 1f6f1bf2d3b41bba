"""Every key of every shipped recipe is read by a program or fixed, with what runs instead.

A key no program reads would be accepted and ignored: a user who sets it is told nothing. So
each key of conf/ (recipes, cluster files, config.yaml) must be
- read by name: its name is an identifier or a string of the launcher's code (launcher_scripts/),
- read through an interpolation: another value of the recipes is built from it (`${.name}`),
- a key of a free-form map a stage declares (the languages of mC4's file counts), or
- fixed (launcher_scripts/config/fixed_keys.py): only the values saying what runs here are
  accepted, any other is refused in one line with what runs instead.
"Read by name" is a name check, not a proof that each reader reads that very key: it catches
keys nothing mentions, which is how a key comes to be ignored.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from launcher_scripts import pipeline
from launcher_scripts.config.compose import conf_dir
from launcher_scripts.config.fixed_keys import FIXED, fixed_paths
from launcher_scripts.config.schema import ROOT_FREE_FORM
from launcher_scripts.errors import ConfigError
from tests.support import REPO

CONF = conf_dir()


@functools.cache
def code_names() -> frozenset[str]:
    """The names the code reads a config by: an attribute (`cfg.model.seed`) or a string
    (`.get("seed")`, `("seed", ...)`); a variable or parameter of the same name is not one."""
    text = "\n".join(p.read_text() for p in (REPO / "launcher_scripts").rglob("*.py"))
    attributes = re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)", text)
    strings = re.findall(r"[\"']([A-Za-z_][A-Za-z0-9_.]*)[\"']", text)
    return frozenset(attributes) | {part for name in strings for part in name.split(".")}


@functools.cache
def interpolated_names() -> frozenset[str]:
    """The last names of every `${...}` reference in conf/."""
    text = "\n".join(p.read_text() for p in CONF.rglob("*.yaml"))
    return frozenset(re.findall(r"(?:\$\{|\.)([A-Za-z_][A-Za-z0-9_]*)\}", text))


# Names a program composes rather than spells, and where.
COMPOSED = {
    # stages/sft_dataset.py: f"{split}_{kind}" for the splits train/dev and its OUTPUTS
    f"{split}_{kind}"
    for split in ("train", "dev")
    for kind in ("output", "src_output", "tgt_output")
}


def free_form(group: str) -> set[str]:
    if not group:  # conf/config.yaml
        return set(ROOT_FREE_FORM)
    declared = pipeline.declared_keys().get(group, ())
    return {path for entry in declared for path in entry.free_form}


def keys(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict):
        for name, value in node.items():
            yield (*path, str(name))
            yield from keys(value, (*path, str(name)))


def matches(pattern: str, path: tuple[str, ...]) -> bool:
    parts = pattern.split(".")
    return len(parts) == len(path) and all(
        p in ("*", name) for p, name in zip(parts, path, strict=True)
    )


def unread(recipe: Path) -> list[str]:
    group = recipe.relative_to(CONF).parts[0] if recipe.parent != CONF else ""
    fixed, maps = fixed_paths(group), free_form(group)
    found = []
    for path in keys(yaml.safe_load(recipe.read_text()) or {}):
        if path[0] == "defaults" or path[-1] in code_names() | interpolated_names() | COMPOSED:
            continue
        if any(".".join(path[:n]) in maps for n in range(1, len(path))):
            continue
        if not any(matches(pattern, path) for pattern in fixed):
            found.append(".".join(path))
    return found


RECIPES = sorted(CONF.rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_key_is_read_or_fixed(recipe: Path) -> None:
    assert not unread(recipe), (
        f"{recipe.relative_to(CONF)}: no program reads {unread(recipe)}; read it, fix it in "
        "launcher_scripts/config/fixed_keys.py with what runs instead, or remove it"
    )


def test_the_audit_finds_a_key_nothing_reads(tmp_path: Path) -> None:
    recipe = tmp_path / "training" / "made_up.yaml"
    recipe.parent.mkdir()
    recipe.write_text("trainer:\n  devices: 1\n  zz_never_read_knob: 3\n")
    global CONF
    kept, CONF = CONF, tmp_path
    try:
        assert unread(recipe) == ["trainer.zz_never_read_knob"]
    finally:
        CONF = kept


def test_every_fixed_key_is_in_a_shipped_recipe() -> None:
    """A fixed entry that no recipe holds is dead: the key went, or was renamed."""
    held = {
        (path.relative_to(CONF).parts[0], key)
        for path in RECIPES
        if path.parent != CONF
        for key in keys(yaml.safe_load(path.read_text()) or {})
    }
    for fixed in FIXED:
        groups = fixed.groups or {group for group, _ in held}
        assert any(group in groups and matches(fixed.path, key) for group, key in held), fixed.path


def test_the_shipped_recipes_hold_values_that_run() -> None:
    """Each fixed key's shipped value is one it accepts (else every run would be refused)."""
    for path in RECIPES:
        if path.parent == CONF:
            continue
        group = path.relative_to(CONF).parts[0]
        data = OmegaConf.create(yaml.safe_load(path.read_text()) or {})
        for fixed in FIXED:
            if fixed.groups and group not in fixed.groups:
                continue
            for key in keys(OmegaConf.to_container(data)):
                if matches(fixed.path, key):
                    value = OmegaConf.select(data, ".".join(key), throw_on_resolution_failure=False)
                    if isinstance(value, str) and "${" in value:
                        continue  # an interpolation: checked where it resolves
                    assert fixed.allows(
                        OmegaConf.to_container(OmegaConf.create({"v": value}))["v"]
                    ), f"{path.relative_to(CONF)}: {'.'.join(key)}={value!r}"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("training.trainer.accumulate_grad_batches=4", "global_batch_size"),
        ("training.model.megatron_amp_O2=false", "fp32 main weights"),
        ("training.model.data.num_workers=4", "no loader workers"),
        ("training.exp_manager.exp_dir=/tmp/x", "explicit_log_dir"),
        ("training.trainer.limit_test_batches=50", "evaluation stage"),
        ("training.trainer.use_distributed_sampler=true", "Megatron's sampler"),
    ],
)
def test_a_value_that_would_be_ignored_is_refused_in_one_line(
    override: str, says: str, tmp_path: Path
) -> None:
    args = [f"base_results_dir={tmp_path}/r", "stages=[training]", override, "dry_run=true"]
    with pytest.raises(ConfigError) as error:
        pipeline.plan(pipeline.compose(args))
    key = override.partition("=")[0]
    assert error.value.key == key and says in str(error.value), error.value
    assert "Set it to" in str(error.value)


def test_nemos_own_values_for_them_run(tmp_path: Path) -> None:
    """The reference's tuning commands set num_workers=0 and create_checkpoint_callback=True."""
    args = [
        f"base_results_dir={tmp_path}/r",
        "stages=[training]",
        "training.model.data.num_workers=0",
        "training.exp_manager.create_checkpoint_callback=True",
        "training.trainer.accumulate_grad_batches=1",
        "dry_run=true",
    ]
    pipeline.plan(pipeline.compose(args))


def test_the_keys_page_lists_every_fixed_and_refused_key() -> None:
    """docs/keys.md's tables: every NeMo key that differs here, and why."""
    from launcher_scripts.config.nemo_keys import REFUSED

    page = (REPO / "docs" / "keys.md").read_text()
    for path in {fixed.path for fixed in FIXED} | {refused.path for refused in REFUSED}:
        assert f"| `{path}` |" in page, path


def test_t5s_other_objectives_are_refused(tmp_path: Path) -> None:
    """NeMo's data.dataset_type: ul2 and t5_prefix_lm are not implemented here."""
    args = [f"base_results_dir={tmp_path}/r", "stages=[training]", "training=t5/tiny"]
    with pytest.raises(ConfigError) as error:
        pipeline.plan(
            pipeline.compose([*args, "training.model.data.dataset_type=ul2", "dry_run=true"])
        )
    assert error.value.key == "training.model.data.dataset_type"
    assert "span corruption" in str(error.value) and "Set it to t5" in str(error.value)
    assert len(str(error.value).splitlines()) == 1
