"""bench/gpu/fetch-wheels.sh: valid bash, shellcheck clean, and its package lists agree with the
project's requirements (every requirement the GPU machine needs is fetched, already on the machine,
or named as left out). No network: the script is read, not run."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO

SCRIPT = REPO / "bench" / "gpu" / "fetch-wheels.sh"
TEXT = SCRIPT.read_text()

# Fetched wheels may never be these: they come with torch on the machine and weigh GBs.
NEVER = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")


def _array(name: str) -> list[str]:
    """The items of the bash array `NAME=( ... )`, comments dropped, quotes removed."""
    match = re.search(rf"^{name}=\(\n(.*?)^\)", TEXT, re.S | re.M)
    assert match, f"{name} not found in {SCRIPT}"
    items = []
    for line in match.group(1).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith('"'):
            items.append(line[1 : line.index('"', 1)])
        else:
            items.append(line.split("#")[0].strip())
    return items


def _pins() -> dict[str, str]:
    """Every fetched wheel (always, from sdist, or in an optional group): name -> pinned version."""
    specs = _array("WHEELS") + _array("SDIST_WHEELS")
    for group in _array("OPTIONAL_GROUPS"):
        specs += group.split(":", 1)[1].split()
    pins = {}
    for spec in specs:
        name, sep, version = spec.partition("==")
        assert sep and version, f"{spec}: every fetched wheel is pinned with =="
        pins[canonicalize_name(name)] = version
    return pins


def _left_out() -> set[str]:
    names = {canonicalize_name(item.split(":", 1)[0]) for item in _array("LEFT_OUT")}
    return names | {canonicalize_name(g.split(":", 1)[0]) for g in _array("OPTIONAL_GROUPS")}


def _project_requirements() -> list[Requirement]:
    """The runtime dependencies, the [train] extra and pytest-xdist (the test command's -n 2)."""
    pyproject = (REPO / "pyproject.toml").read_text()

    def block(pattern: str) -> list[str]:
        match = re.search(pattern + r"\s*=\s*\[(.*?)\n\]", pyproject, re.S | re.M)
        assert match, pattern
        return re.findall(r'^\s*"([^"]+)"', match.group(1), re.M)

    reqs = block(r"^dependencies") + block(r"^train")
    reqs += [r for r in block(r"^dev") if r.startswith("pytest-xdist")]
    reqs += [
        line.strip()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return [Requirement(r) for r in reqs]


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_mode_and_no_dependency_resolution():
    assert "set -euo pipefail" in TEXT
    # pip resolves nothing itself: the closure is the explicit list (no torch can come in).
    assert "--no-deps" in TEXT and "--only-binary=:all:" in TEXT
    assert "--python-version 3.12" in TEXT and "--abi cp312" in TEXT
    # The 64 MiB is all that travels to the machine: the checkout's files take their share.
    assert "TRAVEL=$((64 * 1024 * 1024))" in TEXT
    assert "BUDGET=$((TRAVEL - checkout - MARGIN))" in TEXT and "git ls-files" in TEXT


def test_never_fetches_torch_nvidia_or_triton():
    bad = [name for name in _pins() if NEVER.match(name)]
    assert not bad, f"fetched wheels that come with torch on the machine: {bad}"


def test_fetched_and_on_machine_are_disjoint():
    on_machine = {canonicalize_name(n) for n in _array("ON_MACHINE")}
    assert not on_machine & set(_pins())
    assert {"torch", "transformers", "sentencepiece", "safetensors", "pytest"} <= on_machine


def test_every_project_requirement_is_accounted_for():
    pins = _pins()
    on_machine = {canonicalize_name(n) for n in _array("ON_MACHINE")}
    left_out = _left_out()
    missing = []
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{name}=={pins[name]} in {SCRIPT.name} does not satisfy the project's {req}"
            )
        elif name not in on_machine and name not in left_out:
            missing.append(str(req))
    assert not missing, f"neither fetched, on the GPU machine, nor left out: {missing}"


def test_core_launcher_packages_are_fetched():
    pins = _pins()
    for name in ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime"):
        assert name in pins, name
    assert {"lm-eval", "transformer-engine"} <= _left_out()


def test_wheels_installed_alone_are_fetched_and_not_resolved():
    """A wheel installed with --no-deps there is fetched, and listed apart from requirements.txt
    (pip would otherwise look for its declared dependencies, which are not in .whl/)."""
    alone = {canonicalize_name(n) for line in _array("INSTALL_ALONE") for n in line.split()}
    assert alone and alone <= set(_pins()), alone
    assert 'alone.txt"' in TEXT
    run_sh = (REPO / "bench" / "gpu" / "run.sh").read_text()
    assert "--no-deps" in run_sh and "alone.txt" in run_sh
