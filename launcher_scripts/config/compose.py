"""Compose `conf/config.yaml` with command-line overrides through Hydra's compose API.

The compose API (rather than `@hydra.main`) keeps Hydra from creating output folders or
changing logging, and lets every composition error become one actionable line.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.config import (
    recipe_cache,
    resolvers,  # noqa: F401  (registers the resolvers)
    yaml_loader,
)
from launcher_scripts.errors import ConfigError, LauncherError

yaml_loader.install()  # Hydra's reading of the recipes, in C
recipe_cache.install()  # each recipe file loaded once per process


def conf_dir() -> Path:
    """`conf/` beside the package when installed, at the checkout's top level otherwise."""
    package_dir = Path(__file__).resolve().parents[1]
    for candidate in (package_dir / "conf", package_dir.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise LauncherError(
        f"no conf/config.yaml beside {package_dir}: reinstall the launcher (pip install -e .)"
    )


def recipe_options(group: str, root: Path | None = None) -> list[str]:
    """The recipes of a config group, as a user names them (e.g. 'gpt3/126m')."""
    group_dir = (root or conf_dir()) / group
    return sorted(str(p.relative_to(group_dir).with_suffix("")) for p in group_dir.rglob("*.yaml"))


def config_groups(root: Path | None = None) -> list[str]:
    root = root or conf_dir()
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def is_recipe_file(value: str) -> bool:
    """A group value naming a recipe file outside conf/ (an absolute path to a .yaml)."""
    return value.endswith((".yaml", ".yml")) and Path(value).is_absolute()


def short_recipe_names(overrides: Sequence[str], root: Path | None = None) -> list[str]:
    """`<group>=<file name>` names the recipe of that name when only one recipe of the group
    has it: `conversion=convert_t5` is t5/convert_t5 (the NeMo launcher's documentation uses
    such names from before its recipes had family folders)."""
    root = root or conf_dir()
    groups = set(config_groups(root))
    rewritten = []
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~")
        short = sep and group in groups and "/" not in value and not is_recipe_file(value)
        if short and not (root / group / f"{value}.yaml").is_file():
            named = [r for r in recipe_options(group, root) if r.rsplit("/", 1)[-1] == value]
            if len(named) == 1:
                override = f"{key}={named[0]}"
        rewritten.append(override)
    return rewritten


def check_recipe_overrides(overrides: Sequence[str], root: Path | None = None) -> None:
    """Name the unknown recipe and list the available ones, before Hydra's longer message."""
    root = root or conf_dir()
    groups = set(config_groups(root))
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in groups or is_recipe_file(value):
            continue
        if not (root / key / f"{value}.yaml").is_file():
            available = ", ".join(recipe_options(key, root)) or "none"
            raise ConfigError(
                f"{key}={value}", "no such recipe", f"Available {key} recipes: {available}"
            )


def recipe_file_overrides(overrides: Sequence[str], root: Path | None = None) -> list[str]:
    """`<group>=/abs/path/recipe.yaml` loads that group's recipe from a file outside conf/
    (the AutoConfigurator writes such recipes): the file is registered in Hydra's config store
    under a name made from its path, and the override names that entry instead."""
    root = root or conf_dir()
    groups = set(config_groups(root))
    rewritten = []
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~")
        if sep and group in groups and is_recipe_file(value):
            path = Path(value)
            try:
                node = OmegaConf.load(path)
            except FileNotFoundError:
                raise ConfigError(
                    override,
                    "no such file",
                    f"Give the absolute path of an existing recipe, or a name from conf/{group}/",
                ) from None
            except (OSError, yaml.YAMLError) as error:
                raise ConfigError(
                    override, f"cannot be read: {_first_line(error)}", "Fix the recipe file"
                ) from None
            if not isinstance(node, DictConfig):
                raise ConfigError(override, "is not a mapping of keys", "Fix the recipe file")
            name = "file_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
            ConfigStore.instance().store(group=group, name=name, node=node)
            override = f"{key}={name}"
        rewritten.append(override)
    return rewritten


# NeMo's cluster types, by this launcher's: `interactive` (the node one is logged in to) runs
# jobs as `local` does.
CLUSTER_TYPE_ALIASES = {"interactive": "local"}
# NeMo's conf/config.yaml keeps `cluster: bcm` whatever the cluster type ("leave it as bcm even
# if using bcp; it will be ignored for bcp"): that pair means the bcp file.
IGNORED_CLUSTER_FILES = {("bcm", "bcp")}


def cluster_aliases(overrides: Sequence[str]) -> list[str]:
    """NeMo's cluster settings as this launcher's: `cluster_type=interactive` is `local`, and
    `cluster=bcm` beside `cluster_type=bcp` is left out, as NeMo ignores it."""
    rewritten = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "cluster_type" and value in CLUSTER_TYPE_ALIASES:
            override = f"{key}={CLUSTER_TYPE_ALIASES[value]}"
        rewritten.append(override)
    cluster_type = next(
        (
            o.partition("=")[2]
            for o in reversed(rewritten)
            if o.partition("=")[0].lstrip("+") == "cluster_type"
        ),
        None,
    )
    return [
        o
        for o in rewritten
        if not (
            o.partition("=")[0].lstrip("+") == "cluster"
            and (o.partition("=")[2], cluster_type) in IGNORED_CLUSTER_FILES
        )
    ]


# Sections that take any key: `env_vars.NAME=value` adds a variable as `++env_vars.NAME` would
# (NeMo's documentation writes it without the `+` Hydra asks for a key not in the file).
OPEN_SECTIONS = ("env_vars.",)


def open_section_keys(overrides: Sequence[str]) -> list[str]:
    return [
        f"++{override}" if override.startswith(OPEN_SECTIONS) and "=" in override else override
        for override in overrides
    ]


def matching_cluster(
    overrides: Sequence[str], root: Path, config_name: str = "config"
) -> list[str]:
    """`cluster=<cluster_type>` when the user chose a cluster type but no cluster file.

    Each cluster type has its file, conf/cluster/<cluster_type>.yaml, so `cluster_type=bcp` alone
    is enough; a `cluster=...` override (a site's own file) always wins. Hydra's defaults list
    cannot interpolate a plain key, hence this.
    """
    cluster_type = None
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if key == "cluster":
            return []
        if key == "cluster_type" and sep:
            cluster_type = value
    if cluster_type is None:
        cluster_type = OmegaConf.load(root / f"{config_name}.yaml").get("cluster_type")
        cluster_type = CLUSTER_TYPE_ALIASES.get(cluster_type, cluster_type)
    if cluster_type and (root / "cluster" / f"{cluster_type}.yaml").is_file():
        return [f"cluster={cluster_type}"]
    return []


def chosen_cluster(overrides: Sequence[str]) -> str | None:
    """The cluster file named on the command line (`cluster=<name or path>`), if any."""
    chosen = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") == "cluster":
            chosen = value
    return chosen


def check_cluster_file(overrides: Sequence[str], cfg: DictConfig, root: Path) -> None:
    """A shipped cluster file is for the cluster_type it is named after: `cluster_type=local
    cluster=bcm` would render Slurm settings and run locally. A site's own file (another name,
    or a path) is checked key by key against its cluster_type in preflight."""
    chosen = chosen_cluster(overrides)
    cluster_type = cfg.get("cluster_type")
    shipped = {p.stem for p in (root / "cluster").glob("*.yaml")}
    if chosen in shipped and isinstance(cluster_type, str) and chosen != cluster_type:
        raise ConfigError(
            "cluster",
            f"cluster={chosen} is the {chosen} cluster file but cluster_type={cluster_type}",
            f"Set cluster_type={chosen}, or leave cluster out (cluster_type={cluster_type} "
            f"picks conf/cluster/{cluster_type}.yaml)",
        )


def compose_config(overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    """The composed, unresolved configuration. Raises ConfigError on any composition error."""
    root = conf_dir()
    overrides = open_section_keys(cluster_aliases(short_recipe_names(overrides, root)))
    check_recipe_overrides(overrides, root)
    given = list(overrides)
    overrides = [*recipe_file_overrides(overrides, root), *unused_groups(given, root, config_name)]
    overrides = [*matching_cluster(overrides, root, config_name), *overrides]
    cfg = compose_in(root, config_name, overrides, "Check the recipe names")
    check_cluster_file(given, cfg, root)
    if cfg.get("cluster_type") in CLUSTER_TYPE_ALIASES:  # set so in a site's conf/config.yaml
        cfg.cluster_type = CLUSTER_TYPE_ALIASES[cfg.cluster_type]
    return cfg


REFERENCE = re.compile(r"\$\{(\w+)\.")  # an interpolation reading a top-level section


@functools.cache
def _root_defaults(root: Path, config_name: str) -> tuple[dict[str, str], tuple[str, ...] | None]:
    """The root config's recipe choice per group and its default stages."""
    data = yaml.safe_load((root / f"{config_name}.yaml").read_text()) or {}
    chosen = {}
    for entry in data.get("defaults") or []:
        if isinstance(entry, dict) and len(entry) == 1:
            ((group, recipe),) = entry.items()
            if isinstance(group, str) and isinstance(recipe, str):
                chosen[group] = recipe
    stages = data.get("stages")
    listed = isinstance(stages, list) and all(isinstance(name, str) for name in stages)
    return chosen, tuple(stages) if listed else None


def _stages_given(overrides: Sequence[str]) -> tuple[str, ...] | None:
    """The stages of a `stages=[a,b]` override (None: none given, or one this cannot read)."""
    found = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if key.strip() != "stages" or not sep:
            continue
        value = value.strip()
        if not (value.startswith("[") and value.endswith("]")):
            return None
        names = [name.strip().strip("'\"") for name in value[1:-1].split(",") if name.strip()]
        if not all(re.fullmatch(r"\w+", name) for name in names):
            return None
        found = tuple(names)
    return found


def _recipe_text(root: Path, group: str, recipe: str) -> str | None:
    path = Path(recipe) if is_recipe_file(recipe) else root / group / f"{recipe}.yaml"
    try:
        return path.read_text()
    except OSError:
        return None


def unused_groups(overrides: Sequence[str], root: Path, config_name: str = "config") -> list[str]:
    """`~<group>` for each recipe group of the root's defaults list that this run neither
    runs, names on the command line, nor reads through an interpolation of a group it keeps
    (a conversion recipe reads `${training.run.name}`): composing a one-stage run builds that
    stage's recipe, not all eleven, which was most of a launch's composing time. Nothing is
    left out when the stages or a kept recipe cannot be read here: Hydra then reports it."""
    chosen, default_stages = _root_defaults(root, config_name)
    stages = _stages_given(overrides)
    if stages is None and any(o.partition("=")[0].strip() == "stages" for o in overrides):
        return []
    stages = stages if stages is not None else default_stages
    if stages is None:
        return []
    chosen = dict(chosen)
    keep = {"cluster", *stages}
    references = []
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~").split(".")[0]
        keep.add(group)
        if sep and group == key.lstrip("+~") and group in chosen:
            chosen[group] = value
        references += REFERENCE.findall(value)
    pending = [*keep, *references]
    while pending:
        group = pending.pop()
        if group not in chosen:
            continue
        keep.add(group)
        text = _recipe_text(root, group, chosen[group])
        if text is None:
            return []
        pending += [name for name in REFERENCE.findall(text) if name not in keep]
    return [f"~{group}" for group in chosen if group not in keep]


class UnknownOverride(LauncherError):
    """Hydra refused `key=value` because the composed config has no such key."""

    def __init__(self, message: str, override: str, key: str) -> None:
        super().__init__(message)
        self.override, self.key = override, key


NOT_OVERRIDABLE = re.compile(r"Could not override '([^']+)'")


def compose_in(
    root: Path,
    config_name: str,
    overrides: Sequence[str],
    missing_fix: str,
    return_hydra_config: bool = False,
) -> DictConfig:
    """Hydra's compose of `<root>/<config_name>.yaml`, each composition error one line
    (`missing_fix` says how to fix a missing config)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            return compose(
                config_name=config_name,
                overrides=list(overrides),
                return_hydra_config=return_hydra_config,
            )
    except MissingConfigException as error:
        raise ConfigError("config", _first_line(error), missing_fix) from error
    except yaml.YAMLError as error:  # a recipe file PyYAML cannot read
        raise LauncherError(yaml_problem(error)) from None
    except HydraException as error:
        message = f"bad override: {_first_line(error)}"
        missing = NOT_OVERRIDABLE.search(str(error))
        if missing:
            key = missing.group(1)
            for override in overrides:
                if override.partition("=")[0] == key:
                    raise UnknownOverride(message, override, key) from error
        raise LauncherError(message) from error


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML file's parse error as one line: where, what, and the usual fix."""
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "a recipe"
    problem = getattr(error, "problem", None) or _first_line(error)
    return (
        f"{where}: not valid YAML ({problem}): fix that line (quote a value that holds "
        "${...}, ': ' or ' #', e.g. in a [ ] list)"
    )


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__
