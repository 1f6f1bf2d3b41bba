"""NCCL topology files for cloud VMs whose hypervisor hides the PCI tree (NCCL_TOPO_FILE).

On a VM, NCCL cannot see which GPU sits beside which InfiniBand NIC, so it pairs them badly and
all-reduce across nodes loses bandwidth; a topology file tells it. Bare-metal nodes (OCI's BM
shapes, on-premises DGX) need none: NCCL reads the real tree. AWS needs none either: the
aws-ofi-nccl plugin applies its own file on p4d and p5.

The machines are described here as data (NUMA nodes, their CPU masks, the virtual PCIe switches
and the GPU and NIC bus ids under each, as the CSP documents them) and the XML is rendered from
that: `python3 -m csp_tools.topology` rewrites the shipped files, and a test checks that they
match. The files live in csp_tools/<csp>/, as the NeMo launcher keeps them; the root key
`nccl_topology` picks one by name and every job exports NCCL_TOPO_FILE with its path under
launcher_scripts_path (which container jobs mount).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError

CSP_TOOLS = "csp_tools"  # the folder of the files, in launcher_scripts_path
GPU_CLASS = "0x030200"  # 3D controller
NIC_CLASS = "0x020700"  # InfiniBand controller
BRIDGE_CLASS = "0x060400"  # PCI bridge
BRIDGE_IDS = ("vendor", "device", "subsystem_vendor", "subsystem_device")


@dataclass(frozen=True)
class Switch:
    """A PCIe switch and the devices behind it."""

    busid: str
    gpus: tuple[str, ...]
    nics: tuple[str, ...]


@dataclass(frozen=True)
class Numa:
    affinity: str  # the node's CPUs, as a comma-separated hexadecimal mask
    switches: tuple[Switch, ...]


@dataclass(frozen=True)
class Machine:
    name: str  # the nccl_topology value that picks it
    file: str  # in csp_tools/
    title: str
    cpu: dict[str, str]  # vendor, familyid, modelid
    link_speed: str
    numa: tuple[Numa, ...]
    bridge_ids: bool = False  # the switches carry (zeroed) vendor and device ids

    def gpu_count(self) -> int:
        return sum(len(s.gpus) for n in self.numa for s in n.switches)


def _pairs(switch: str, *devices: tuple[str, str]) -> Switch:
    """A switch of (GPU, NIC) pairs."""
    return Switch(switch, tuple(g for g, _ in devices), tuple(n for _, n in devices))


def _one_pair_each(first: int, gpu_domains: tuple[str, ...]) -> tuple[Switch, ...]:
    """Switches ffff:ff:0<first>.0 onwards, each with one GPU (its PCI domain given) and the
    NIC of domain 010<n>."""
    return tuple(
        _pairs(f"ffff:ff:0{n}.0", (f"{domain}:00:00.0", f"010{n}:00:00.0"))
        for n, domain in enumerate(gpu_domains, start=first)
    )


AMD_ROME = {"vendor": "AuthenticAMD", "familyid": "23", "modelid": "49"}
INTEL_SPR = {"vendor": "GenuineIntel", "familyid": "6", "modelid": "143"}

MACHINES = (
    # Standard_ND96asr_v4 / ND96amsr_A100_v4: 8 A100 and 8 HDR InfiniBand NICs, 4 NUMA nodes of
    # 24 cores, one switch per node with two GPU/NIC pairs.
    Machine(
        "azure_ndv4",
        "azure/topo.xml",
        "Azure ND A100 v4 (8 A100, 8 HDR InfiniBand)",
        AMD_ROME,
        "16 GT/s",
        (
            Numa(
                "00000000,00000000,00ffffff",
                (
                    _pairs(
                        "ffff:ff:01.0",
                        ("0003:00:00.0", "0103:00:00.0"),
                        ("0004:00:00.0", "0104:00:00.0"),
                    ),
                ),
            ),
            Numa(
                "00000000,0000ffff,ff000000",
                (
                    _pairs(
                        "ffff:ff:02.0",
                        ("0001:00:00.0", "0101:00:00.0"),
                        ("0002:00:00.0", "0102:00:00.0"),
                    ),
                ),
            ),
            Numa(
                "000000ff,ffff0000,00000000",
                (
                    _pairs(
                        "ffff:ff:03.0",
                        ("000d:00:00.0", "0107:00:00.0"),
                        ("000e:00:00.0", "0108:00:00.0"),
                    ),
                ),
            ),
            Numa(
                "ffffff00,00000000,00000000",
                (
                    _pairs(
                        "ffff:ff:04.0",
                        ("000b:00:00.0", "0105:00:00.0"),
                        ("000c:00:00.0", "0106:00:00.0"),
                    ),
                ),
            ),
        ),
    ),
    # Standard_ND96isr_H100_v5: 8 H100 and 8 NDR InfiniBand NICs, 2 NUMA nodes, a switch per
    # GPU/NIC pair.
    Machine(
        "azure_ndv5",
        "azure/ndv5-topo.xml",
        "Azure ND H100 v5 (8 H100, 8 NDR InfiniBand)",
        INTEL_SPR,
        "32.0 GT/s PCIe",
        (
            Numa("ffffffff,ffff0000,00000000", _one_pair_each(1, ("0001", "0002", "0003", "0008"))),
            Numa("00000000,0000ffff,ffffffff", _one_pair_each(5, ("0009", "000a", "000b", "000c"))),
        ),
        bridge_ids=True,
    ),
)
BY_NAME = {machine.name: machine for machine in MACHINES}


def render(machine: Machine) -> str:
    link = f'link_speed="{machine.link_speed}" link_width="16"'
    cpu = " ".join(f'{key}="{value}"' for key, value in machine.cpu.items())
    lines = [f"<!-- {machine.title}: csp_tools/topology.py renders this file -->"]
    lines.append('<system version="1">')
    for index, numa in enumerate(machine.numa):
        lines.append(f'  <cpu numaid="{index}" affinity="{numa.affinity}" arch="x86_64" {cpu}>')
        for switch in numa.switches:
            ids = " ".join(f'{key}="0x0000"' for key in BRIDGE_IDS) if machine.bridge_ids else ""
            bridge = f'busid="{switch.busid}" class="{BRIDGE_CLASS}" {link} {ids}'.rstrip()
            lines.append(f"    <pci {bridge}>")
            for gpu, nic in zip(switch.gpus, switch.nics, strict=True):
                lines.append(f'      <pci busid="{gpu}" class="{GPU_CLASS}" {link}/>')
                lines.append(f'      <pci busid="{nic}" class="{NIC_CLASS}" {link}/>')
            lines.append("    </pci>")
        lines.append("  </cpu>")
    lines.append("</system>")
    return "\n".join(lines) + "\n"


def topology_file(name: str, code: str | Path) -> Path:
    """The shipped file of a machine in `code` (launcher_scripts_path)."""
    return Path(code) / CSP_TOOLS / BY_NAME[name].file


def check_choice(root: Mapping[str, Any]) -> None:
    """The root key `nccl_topology`: a shipped machine's name or an existing topology file,
    and not beside env_vars.NCCL_TOPO_FILE, which it sets."""
    chosen = root.get("nccl_topology")
    if chosen is None:
        return
    if (root.get("env_vars") or {}).get("NCCL_TOPO_FILE") is not None:
        raise ConfigError(
            "nccl_topology", "is set and so is env_vars.NCCL_TOPO_FILE, which it sets", "Keep one"
        )
    if str(chosen) in BY_NAME:
        return
    path = Path(str(chosen))
    if path.suffix != ".xml" or not path.is_absolute():
        raise ConfigError(
            "nccl_topology",
            f"{chosen!r} is neither a shipped topology nor an absolute path to a .xml file",
            f"Use one of: {', '.join(BY_NAME)}, or /path/to/topo.xml",
        )
    if not path.is_file():
        raise ConfigError("nccl_topology", f"{path} does not exist", "Fix the path")


def exported_path(root: Mapping[str, Any]) -> str | None:
    """What NCCL_TOPO_FILE is set to in every job (None: not set)."""
    chosen = root.get("nccl_topology")
    if chosen is None:
        return None
    if str(chosen) in BY_NAME:
        return str(topology_file(str(chosen), str(root["launcher_scripts_path"])))
    return str(chosen)
