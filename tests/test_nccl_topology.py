"""NCCL topology files for cloud VMs (the reference's 4.3.1: csp_tools/<csp>/topo.xml), picked by
`nccl_topology` and exported as NCCL_TOPO_FILE in every job."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from launcher_scripts import pipeline
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.nccl_topology import (
    BRIDGE_CLASS,
    GPU_CLASS,
    MACHINES,
    NIC_CLASS,
    render,
    topology_file,
)
from tests.support import REPO
from tests.support.dry_runs import without_slurm

GPU_RUN = ("stages=[training]", "training=gpt3/126m", "cluster_type=bcm", "container=x:1")


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_the_shipped_file_is_the_rendered_description(machine) -> None:
    shipped = topology_file(machine.name, REPO)
    assert shipped.read_text() == render(machine), "run python3 -m csp_tools.topology"


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_each_gpu_sits_behind_a_switch_with_a_nic_of_its_numa_node(machine) -> None:
    root = ElementTree.fromstring(topology_file(machine.name, REPO).read_text())
    assert root.tag == "system" and root.get("version") == "1"
    gpus, nics = set(), set()
    for cpu in root.findall("cpu"):
        assert cpu.get("affinity") and cpu.get("arch") == "x86_64"
        for switch in cpu.findall("pci"):
            assert switch.get("class") == BRIDGE_CLASS
            kinds = [device.get("class") for device in switch.findall("pci")]
            assert kinds.count(GPU_CLASS) == kinds.count(NIC_CLASS) >= 1
            gpus |= {d.get("busid") for d in switch if d.get("class") == GPU_CLASS}
            nics |= {d.get("busid") for d in switch if d.get("class") == NIC_CLASS}
    assert len(gpus) == len(nics) == machine.gpu_count() == 8  # no bus id given twice


def planned_env(tmp_path: Path, *overrides: str) -> dict[str, str]:
    args = [f"base_results_dir={tmp_path}/r", "dry_run=true", *GPU_RUN, *overrides]
    _, _, stages = pipeline.plan(pipeline.compose(args))
    return dict(stages[0].jobs[0].spec.env)


def test_a_shipped_topology_is_exported_from_the_code_jobs_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_slurm(monkeypatch)
    env = planned_env(tmp_path, "nccl_topology=azure_ndv4")
    assert env["NCCL_TOPO_FILE"] == str(REPO / "csp_tools" / "azure" / "topo.xml")
    assert Path(env["NCCL_TOPO_FILE"]).is_file()
    own = tmp_path / "site-topo.xml"
    own.write_text(render(MACHINES[1]))
    assert planned_env(tmp_path, f"nccl_topology={own}")["NCCL_TOPO_FILE"] == str(own)
    assert "NCCL_TOPO_FILE" not in planned_env(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("nccl_topology=azure_ndv9",), "neither a shipped topology"),
        (("nccl_topology=/nowhere/topo.xml",), "does not exist"),
        (("nccl_topology=azure_ndv4", "env_vars.NCCL_TOPO_FILE=/t.xml"), "Keep one"),
    ],
)
def test_a_bad_topology_is_refused_in_one_line(
    overrides: tuple[str, ...], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_slurm(monkeypatch)
    with pytest.raises(ConfigError) as error:
        planned_env(tmp_path, *overrides)
    assert error.value.key == "nccl_topology" and says in str(error.value)
