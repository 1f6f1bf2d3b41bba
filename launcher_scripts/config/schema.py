"""The keys a configuration may hold, and the type of its boolean keys.

A stage's known keys are the keys of the shipped recipes of its group (`conf/<group>/**`) of the
same kind (the same `dataset`, `model_family`, `evaluation_kind` and `peft_method`), plus the
optional keys its programs read with a default that no shipped recipe spells out: those are
declared beside the code that reads them (`Declared`, on the stage classes). The root's keys are
those of `conf/config.yaml` and the config groups; a cluster file's are those of
`conf/cluster/<cluster_type>.yaml`.

A typo is otherwise silent: Hydra's own hint for a key a recipe lacks is `+key=value`, which
adds the key, and no program reads it. Free-form maps (`env_vars`, `wandb_logger_kwargs`,
`sbatch_options`, ...) hold whatever the user names; a map that is empty in every shipped
recipe holding it is free-form, and so is one declared so. Below a key that the recipes hold
as a scalar or null, nothing is checked (the stage validates such values itself).

Booleans: a key whose every shipped value is true or false (or null) must be a boolean: Hydra
reads an unknown word on the command line (`dry_run=maybe`) as a string, which is truthy.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.config import nemo_keys, yaml_loader
from launcher_scripts.config.compose import conf_dir, config_groups
from launcher_scripts.config.equivalents import equivalent
from launcher_scripts.errors import ConfigError

# The recipe keys that select a job program or a code path: recipes of one group that differ
# in one of them read different keys.
DISCRIMINATORS = ("dataset", "model_family", "evaluation_kind", "peft_method")
CLUSTER = "cluster"
# Root maps whose keys are the user's (exported environment variables).
ROOT_FREE_FORM = ("env_vars",)


class _FreeForm:
    """A map whose keys are not checked one by one."""

    def __repr__(self) -> str:
        return "FREE_FORM"


FREE_FORM = _FreeForm()
# A tree of known keys: a nested dict; None marks a scalar (nothing below it is checked).
Tree = dict[str, Any]


@dataclass(frozen=True)
class Declared:
    """Keys a stage's programs read that its shipped recipes may leave out.

    `optional`: dotted paths within the stage's section, read with a default.
    `free_form`: dotted paths of maps whose keys the program takes as they come (or checks
    itself, with a better message than "unknown key").
    `when`: the discriminator values (e.g. (("evaluation_kind", "fine_tuned"),)) of the
    recipes this applies to, a value or a tuple of them; empty: every recipe of the stage.
    """

    optional: tuple[str, ...] = ()
    free_form: tuple[str, ...] = ()
    when: tuple[tuple[str, str | tuple[str, ...]], ...] = ()

    def applies_to(self, kind: Mapping[str, Any]) -> bool:
        def matches(value: Any, wanted: str | tuple[str, ...]) -> bool:
            return value is None or value in (wanted if isinstance(wanted, tuple) else (wanted,))

        return all(matches(kind.get(name), wanted) for name, wanted in self.when)


# ----- what the shipped recipes hold --------------------------------------------------------


@functools.cache
def shipped(group: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """(recipe name, unresolved content) of every recipe of a group; "" for config.yaml."""
    root = conf_dir()
    files = [root / "config.yaml"] if group == "" else sorted((root / group).rglob("*.yaml"))
    recipes = []
    for path in files:
        # Plain data straight from YAML: building OmegaConf nodes for every recipe of the
        # group cost more than the rest of a launch's checks.
        content = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml_loader.loader())
        if isinstance(content, dict):
            content.pop("defaults", None)
            name = str(path.relative_to(root / group).with_suffix("")) if group else ""
            recipes.append((name, content))
    return tuple(recipes)


def kind_of(section: Mapping[str, Any]) -> dict[str, Any]:
    """The discriminator values a recipe sets (plain strings only)."""
    return {
        name: section[name]
        for name in DISCRIMINATORS
        if name in section and (section[name] is None or isinstance(section[name], str))
    }


# A recipe whose family is its input's (a Hugging Face directory's, a portable file's): its
# keys are read whichever family the user names instead (one for a file not written yet).
AUTO_FAMILY = "auto"


def _same(name: str, shipped_value: Any, value: Any) -> bool:
    return shipped_value == value or (name == "model_family" and shipped_value == AUTO_FAMILY)


def same_kind(
    group: str, kind: Mapping[str, Any]
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The shipped recipes of `group` of the given kind, and the kind they were matched on.

    A kind no shipped recipe has (a user's recipe file naming a new family) falls back to the
    recipes matching its first discriminators, at worst to the whole group: the stage's own
    checks then refuse an unknown family or dataset with their own message."""
    names = [name for name in DISCRIMINATORS if name in kind]
    recipes = list(shipped(group))
    for count in range(len(names), -1, -1):
        wanted = {name: kind[name] for name in names[:count]}
        matching = [
            (name, content)
            for name, content in recipes
            if all(_same(key, content.get(key), value) for key, value in wanted.items())
        ]
        if matching:
            return matching, wanted
    return recipes, {}


def _merge(tree: Tree, node: Mapping[str, Any]) -> None:
    for key, value in node.items():
        key = str(key)
        current = tree.get(key)
        if isinstance(value, dict) and not value:
            tree[key] = FREE_FORM  # {} wherever it is set: the user's own entries
        elif isinstance(value, dict):
            if current is FREE_FORM:
                continue
            if not isinstance(current, dict):
                current = tree[key] = {}
            _merge(current, value)
        else:
            tree.setdefault(key, None)


def _set(tree: Tree, path: str, leaf: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        node = tree.get(part)
        if node is FREE_FORM or (node is None and part in tree):
            return  # already unchecked below
        if node is None:
            node = tree[part] = {}
        tree = node
    if leaf is FREE_FORM or parts[-1] not in tree:
        tree[parts[-1]] = leaf


def known_tree(
    contents: Sequence[Mapping[str, Any]], declared: Sequence[Declared] = (), kind: Any = None
) -> Tree:
    tree: Tree = {}
    for content in contents:
        _merge(tree, content)
    for declaration in declared:
        if kind is not None and not declaration.applies_to(kind):
            continue
        for path in declaration.optional:
            _set(tree, path, None)
        for path in declaration.free_form:
            _set(tree, path, FREE_FORM)
    return tree


def paths(tree: Tree, prefix: str = "") -> Iterator[str]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from paths(value, f"{path}.")


# ----- unknown keys -------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One checked part of the configuration: where it sits, what it may hold, and in words
    which files define that (for the error)."""

    prefix: str  # "training." or "" (the root)
    tree: Tree
    source: str  # why no program reads a key it lacks, e.g. "no training recipe ... has it"
    kind: Mapping[str, Any]
    group: str  # the config group, "" for the root


def stage_section(
    group: str, content: Mapping[str, Any], declared: Sequence[Declared] = ()
) -> Section:
    kind = kind_of(content)
    recipes, matched = same_kind(group, kind)
    tree = known_tree([c for _, c in recipes], declared, kind)
    described = ", ".join(f"{name} {value}" for name, value in matched.items() if value)
    what = f"{group} recipe" + (f" with {described}" if described else "")
    return Section(f"{group}.", tree, f"no {what} (conf/{group}/) has it", kind, group)


def cluster_kinds() -> dict[str, Tree]:
    """The keys of each shipped cluster file, by its name (the cluster_type it is for)."""
    return {name: known_tree([content]) for name, content in shipped(CLUSTER)}


def cluster_section(cluster_type: str) -> Section | None:
    tree = cluster_kinds().get(cluster_type)
    if tree is None:
        return None  # an unknown cluster_type is refused by check_globals
    source = f"the {cluster_type} cluster file (conf/cluster/{cluster_type}.yaml) has no such key"
    return Section(f"{CLUSTER}.", tree, source, {"cluster_type": cluster_type}, CLUSTER)


def root_section() -> Section:
    content = dict(shipped("")[0][1])
    for group in config_groups():
        content.setdefault(group, None)  # checked as a section of its own
    tree = known_tree([content], [Declared(free_form=ROOT_FREE_FORM)])
    source = "conf/config.yaml has no such key and no config group is named so"
    return Section("", tree, source, {}, "")


def unknown_keys(node: Mapping[str, Any], tree: Tree, prefix: str = "") -> Iterator[str]:
    """The dotted paths in `node` (a plain container) that `tree` does not know."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if str(key) not in tree:
            yield path
            continue
        known = tree[str(key)]
        if isinstance(known, dict) and isinstance(value, Mapping):
            yield from unknown_keys(value, known, f"{path}.")


def suggestion(path: str, tree: Tree) -> str | None:
    """The known key the user most likely meant: the same name at another depth, else the
    closest spelling."""
    known = list(paths(tree))
    last = path.rsplit(".", 1)[-1]
    same_name = [p for p in known if p.rsplit(".", 1)[-1] == last]
    if same_name:
        return min(same_name, key=len)
    parent = path.rpartition(".")[0]
    siblings = {p.rsplit(".", 1)[-1]: p for p in known if p.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(last, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    close = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_key_error(section: Section, path: str) -> ConfigError:
    """The one line for a key (`path`, within the section) the section does not know."""
    full = f"{section.prefix}{path}"
    refused = nemo_keys.refusal(section.group, path, section.kind)
    if refused is not None:
        problem, fix = refused
        return ConfigError(full, problem, fix)
    if section.group == CLUSTER:
        elsewhere = [
            name
            for name, tree in cluster_kinds().items()
            if name != section.kind.get("cluster_type") and path in set(paths(tree))
        ]
        if elsewhere:
            kinds = " and ".join(elsewhere)
            return ConfigError(
                full,
                f"is a key of {kinds} cluster files, but cluster_type is "
                f"{section.kind.get('cluster_type')}",
                f"Set cluster_type={elsewhere[0]}, or give a cluster file for "
                f"{section.kind.get('cluster_type')} (without {path})",
            )
    if section.group not in ("", CLUSTER):
        having = [
            name
            for name, content in shipped(section.group)
            if path in set(paths(known_tree([content])))
        ]
        if having:
            shown = ", ".join(having[:3]) + (", ..." if len(having) > 3 else "")
            return ConfigError(
                full,
                f"{section.source}; only {shown} {'has' if len(having) == 1 else 'have'} it",
                f"Choose one of those (e.g. {section.group}={having[0]}), or leave the key out",
            )
    same_setting = equivalent(path, set(paths(section.tree)))
    if same_setting is not None:
        return ConfigError(
            full,
            f"no program reads it: {section.source}",
            f"Use {section.prefix}{same_setting} instead, this recipe's name for that setting",
        )
    meant = suggestion(path, section.tree)
    hint = f"Did you mean {section.prefix}{meant}?" if meant else "Check the spelling"
    return ConfigError(full, f"no program reads it: {section.source}", hint)


def sections(
    cfg: DictConfig, stages: Sequence[str], declared: Mapping[str, Sequence[Declared]]
) -> Iterator[tuple[Section, Any]]:
    """Each part of the composed configuration that is checked, with its content."""
    content = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(content, dict)
    yield root_section(), content  # the groups are leaves of the root: checked below
    cluster_type = content.get("cluster_type")
    cluster = cluster_section(cluster_type) if isinstance(cluster_type, str) else None
    if cluster is not None and isinstance(content.get(CLUSTER), dict):
        yield cluster, content[CLUSTER]
    for stage in stages:
        section = content.get(stage)
        if isinstance(section, dict):
            yield stage_section(stage, section, declared.get(stage, ())), section


def check_known_keys(
    cfg: DictConfig, stages: Sequence[str], declared: Mapping[str, Sequence[Declared]]
) -> None:
    """Every key of the root, the cluster file and the requested stages is one that the
    launcher or a job program reads: else one line naming it and the key meant."""
    for section, content in sections(cfg, stages, declared):
        for path in unknown_keys(content, section.tree):
            raise unknown_key_error(section, path)


def explain_unknown(
    cfg: DictConfig, key: str, value: str, declared: Mapping[str, Sequence[Declared]]
) -> ConfigError:
    """For a command-line `key=value` Hydra could not apply (the recipe lacks the key): the
    unknown-key line, or, for a key the stage reads that this recipe leaves out, how to add
    it. `cfg` is the configuration composed without that override."""
    group, _, path = key.partition(".")
    content = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(content, dict)
    section: Section | None = None
    if group == CLUSTER and isinstance(content.get("cluster_type"), str):
        section = cluster_section(content["cluster_type"])
    elif group in config_groups() and isinstance(content.get(group), dict):
        section = stage_section(group, content[group], declared.get(group, ()))
    if section is None:
        section, path = root_section(), key
    if path in set(paths(section.tree)):
        return ConfigError(
            key,
            f"is not set in this {section.group or 'configuration'} recipe",
            f"Add it with +{key}={value}",
        )
    return unknown_key_error(section, path)


# ----- booleans -----------------------------------------------------------------------------


def _scalars(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _scalars(value, f"{path}.")
        else:
            yield path, value


@functools.cache
def boolean_keys(group: str) -> dict[str, bool]:
    """The keys of a group's shipped files that hold booleans: path -> whether null is
    allowed too. A key with any other value somewhere (or only interpolations) is left out."""
    seen: dict[str, set[str]] = {}
    for _, content in shipped(group):
        for path, value in _scalars(content):
            if isinstance(value, str) and "${" in value:
                continue
            kinds = seen.setdefault(path, set())
            kinds.add("null" if value is None else "bool" if isinstance(value, bool) else "other")
    return {
        path: "null" in kinds
        for path, kinds in seen.items()
        if "bool" in kinds and "other" not in kinds
    }


def check_booleans(resolved: DictConfig, stages: Sequence[str]) -> None:
    """Every boolean key of the root, the cluster file and the requested stages is true or
    false (`dry_run=maybe` is a string, and strings are true)."""
    content = OmegaConf.to_container(resolved, resolve=False)
    assert isinstance(content, dict)
    groups = set(config_groups())
    root = {key: value for key, value in content.items() if key not in groups}
    parts: list[tuple[str, str, Any]] = [("", "", root)]
    if isinstance(content.get(CLUSTER), dict):
        parts.append((CLUSTER, f"{CLUSTER}.", content[CLUSTER]))
    parts += [(s, f"{s}.", content[s]) for s in stages if isinstance(content.get(s), dict)]
    for group, prefix, node in parts:
        typed = boolean_keys(group)
        for path, value in _scalars(node):
            if path not in typed or isinstance(value, bool) or (value is None and typed[path]):
                continue
            key = f"{prefix}{path}"
            allowed = "true, false or null" if typed[path] else "true or false"
            raise ConfigError(key, f"{value!r} is not {allowed}", f"Set {key}=true or {key}=false")
