"""A provider's validation settings: `csp_tools/<csp>/validation.yaml` over the generic ones,
and a site's own file (--settings) over those.

Each folder of csp_tools/ holds one provider's file (limits that fit its GPUs and network, and
the environment its jobs need); `generic` is the base every provider's file overrides key by
key.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from csp_tools.validation.allreduce_sweep import size

CSP_ROOT = Path(__file__).resolve().parents[1]
BASE = "generic"
FREE_FORM = ("env",)  # sections whose keys are the user's own (variable names)


class SettingsError(ValueError):
    """A provider or settings file that cannot be used: one line naming it and the fix."""


def providers() -> list[str]:
    return sorted(p.parent.name for p in CSP_ROOT.glob("*/validation.yaml"))


@dataclass(frozen=True)
class Settings:
    csp: str
    min_busbw_gbps: float
    pair_straggler_fraction: float
    min_bytes: int
    max_bytes: int
    matmul_fraction: float
    memory_fraction: float
    node_straggler_fraction: float
    dcgm_level: int
    env: dict[str, str] = field(default_factory=dict)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merged(base[key], value)
        else:
            merged[key] = value
    return merged


def _read(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise SettingsError(f"{path}: cannot be read ({error}); fix the file") from None
    if not isinstance(loaded, dict):
        raise SettingsError(f"{path}: is not a mapping of keys; fix the file")
    return loaded


def _paths(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every key of the tree by its dotted path ('interconnect.min_bytes'), sections too."""
    found: dict[str, Any] = {}
    for key, value in tree.items():
        found[f"{prefix}{key}"] = value
        if isinstance(value, dict) and key not in FREE_FORM:
            found.update(_paths(value, f"{prefix}{key}."))
    return found


def _meant(path: str, known: list[str]) -> str | None:
    """The setting a mistyped path most likely meant: the same name in another section, else
    the closest spelling within its own section."""
    section, _, name = path.rpartition(".")
    same_name = [k for k in known if k.rpartition(".")[2] == name]
    if same_name:
        return same_name[0]
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.6)
    return siblings[close[0]] if close else None


def _check_keys(loaded: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    """Every key of a file is a setting (the generic file's keys): a mistyped one would be
    ignored, and its default used, without a word."""
    known = _paths(schema)
    for key in _paths(loaded):
        if key in known or (key.split(".")[0] in FREE_FORM and "." in key):
            continue
        section = key.rpartition(".")[0]
        meant = _meant(key, list(known))
        if meant:
            hint = f"did you mean {meant}?"
        else:
            keys = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
            hint = f"the {section or 'top-level'} keys are {', '.join(keys)}"
        raise SettingsError(f"{path}: {key} is not a setting; {hint}")


def raw_settings(csp: str, site_file: Path | None = None) -> tuple[dict[str, Any], Path]:
    """The merged settings files as read, and the last file read (for messages)."""
    if csp not in providers():
        raise SettingsError(f"--csp={csp}: no such provider; use one of {', '.join(providers())}")
    raw = schema = _read(CSP_ROOT / BASE / "validation.yaml")
    where = CSP_ROOT / csp / "validation.yaml"
    over = [where] if csp != BASE else []
    if site_file is not None:
        over.append(site_file)
        where = site_file
    for path in over:
        loaded = _read(path)
        _check_keys(loaded, schema, path)
        raw = _merged(raw, loaded)
    return raw, where


def load(csp: str, site_file: Path | None = None) -> Settings:
    """The provider's settings, and over them a site's own file (--settings), if given."""
    raw, where = raw_settings(csp, site_file)
    try:
        interconnect, node = raw["interconnect"], raw["node"]
        settings = Settings(
            csp=csp,
            min_busbw_gbps=float(interconnect["min_busbw_gbps"]),
            pair_straggler_fraction=float(interconnect["straggler_fraction"]),
            min_bytes=size(str(interconnect["min_bytes"])),
            max_bytes=size(str(interconnect["max_bytes"])),
            matmul_fraction=float(node["matmul_fraction"]),
            memory_fraction=float(node["memory_fraction"]),
            node_straggler_fraction=float(node["straggler_fraction"]),
            dcgm_level=int(node["dcgm_level"]),
            env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        )
    except (KeyError, TypeError, ValueError, argparse.ArgumentTypeError) as error:
        raise SettingsError(f"{where}: bad or missing key ({error}); fix the file") from None
    for name in settings.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SettingsError(f"{where}: env: {name!r} is not a variable name; fix the file")
    for name in ("pair_straggler_fraction", "node_straggler_fraction"):
        if not 0 <= getattr(settings, name) <= 1:
            raise SettingsError(f"{where}: {name} must be between 0 and 1")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    """For the manual job scripts: `--exports` prints the provider's environment as shell
    exports; `--get=section.key` prints one setting."""
    parser = argparse.ArgumentParser(prog="settings", description=main.__doc__)
    parser.add_argument("--csp", default=BASE)
    parser.add_argument("--settings", type=Path, default=None, help="a site's validation.yaml")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--exports", action="store_true")
    action.add_argument("--get", metavar="SECTION.KEY")
    args = parser.parse_args(argv)
    try:
        settings = load(args.csp, args.settings)  # checks every value, whichever is printed
        raw, where = raw_settings(args.csp, args.settings)
    except SettingsError as error:
        print(f"settings: {error}", file=sys.stderr)
        return 2
    if args.exports:
        for name, value in settings.env.items():
            print(f"export {name}={shlex.quote(value)}")
        return 0
    value: Any = raw
    for part in args.get.split("."):
        if not isinstance(value, dict) or part not in value:
            print(f"settings: {where}: no setting {args.get}", file=sys.stderr)
            return 2
        value = value[part]
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
