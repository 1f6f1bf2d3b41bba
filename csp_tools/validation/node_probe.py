"""One node's diagnostics, run on the node (one task): DCGM's `dcgmi diag -r LEVEL` where DCGM is
installed, else built-in checks.

- GPU nodes: the GPU count against the job's GRES (SLURM_GPUS_ON_NODE or --expect-gpus),
  uncorrected ECC errors (nvidia-smi), Xid errors in the kernel log (where it is readable), a
  bf16 matmul's TFLOP/s and a device copy's memory bandwidth against the GPU's published
  figures (--matmul-fraction, --memory-fraction of them).
- Nodes without GPUs: a float32 matmul's TFLOP/s and a memory copy's bandwidth, against the
  absolute floors given (none by default); the cluster-wide comparison (a node slower than the
  median) is made by the caller over every node's figures.

Prints one JSON line: node, passed, and each check (name, status pass|fail|skipped, value,
unit, limit, detail). Exits 1 when a check failed. `--inject-fault CHECK` (or
CSP_VALIDATION_INJECT_FAULT=CHECK,...) fails that check on purpose: how a test, or a user trying
the report and the exclusion, makes a node fail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

INJECT_ENV = "CSP_VALIDATION_INJECT_FAULT"

# Dense bf16 TFLOP/s and memory TB/s from NVIDIA's data sheets, by a part of the name
# nvidia-smi reports; the first match wins, so the specific names come first.
PUBLISHED: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 4.8),
    ("H100 PCIe", 756.0, 2.0),
    ("H100 NVL", 835.0, 3.9),
    ("H100", 989.0, 3.35),
    ("A100-SXM4-80GB", 312.0, 2.039),
    ("A100 80GB PCIe", 312.0, 1.935),
    ("A100", 312.0, 1.555),
)


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skipped
    detail: str
    value: float | None = None
    unit: str = ""
    limit: float | None = None


def judged(name: str, value: float, unit: str, limit: float | None, what: str) -> Check:
    """A measured figure against a floor (None: reported, not judged)."""
    if limit is None:
        return Check(name, "pass", f"{what} {value:.4g} {unit} (no floor set)", value, unit)
    passed = value >= limit
    relation = ">=" if passed else "<"
    detail = f"{what} {value:.4g} {unit} {relation} floor {limit:.4g} {unit}"
    return Check(name, "pass" if passed else "fail", detail, value, unit, limit)


def published_figures(gpu_name: str) -> tuple[float, float] | None:
    for part, tflops, terabytes in PUBLISHED:
        if part in gpu_name:
            return tflops, terabytes
    return None


def gpu_count_check(found: int, expected: int | None) -> Check:
    if expected is None:
        return Check("gpu_count", "skipped", f"{found} GPUs; no GRES to compare with", found)
    status = "pass" if found == expected else "fail"
    return Check("gpu_count", status, f"{found} GPUs visible, GRES {expected}", found, "", expected)


def ecc_check(nvidia_smi_csv: str) -> Check:
    """`nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total --format=csv,noheader,
    nounits` read: any GPU with uncorrected errors fails ([N/A]: ECC off, not an error)."""
    errors = {}
    for line in nvidia_smi_csv.strip().splitlines():
        index, _, count = (part.strip() for part in line.partition(","))
        if count.isdigit() and int(count) > 0:
            errors[index] = int(count)
    if errors:
        listed = ", ".join(f"GPU {i}: {n}" for i, n in errors.items())
        return Check("ecc", "fail", f"uncorrected ECC errors ({listed})", sum(errors.values()))
    return Check("ecc", "pass", "no uncorrected ECC errors", 0)


XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")


def xid_check(kernel_log: str | None) -> Check:
    if kernel_log is None:
        return Check("xid", "skipped", "the kernel log is not readable here (dmesg)")
    found = XID.findall(kernel_log)
    if found:
        codes = sorted({int(code) for _, code in found})
        return Check("xid", "fail", f"{len(found)} Xid errors, codes {codes}", len(found))
    return Check("xid", "pass", "no Xid errors in the kernel log", 0)


def timed(work: Callable[[], None], repeats: int, synchronize: Callable[[], None]) -> float:
    """Seconds per call of `work`, after one untimed call."""
    work()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    synchronize()
    return (time.perf_counter() - start) / repeats


def synchronizer(device: str) -> Callable[[], None]:
    """What waits for the device's queued work: nothing on the CPU."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def matmul_tflops(device: str, dtype: object, size: int) -> float:
    import torch as t

    a = t.randn(size, size, device=device, dtype=dtype)
    b = t.randn(size, size, device=device, dtype=dtype)
    seconds = timed(lambda: t.mm(a, b), 5, synchronizer(device))
    return 2 * size**3 / seconds / 1e12


def copy_gbps(device: str, megabytes: int) -> float:
    """GB/s of a copy: each byte read once and written once."""
    import torch as t

    source = t.empty(megabytes * 2**20, dtype=t.uint8, device=device)
    target = t.empty_like(source)
    seconds = timed(lambda: target.copy_(source), 5, synchronizer(device))
    return 2 * source.numel() / seconds / 1e9


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def dcgm_check(level: int) -> Check:
    result = run(["dcgmi", "diag", "-r", str(level)], timeout=3600)
    if result is None:
        return Check("dcgm", "fail", f"dcgmi diag -r {level} did not finish")
    failed = [line.strip() for line in result.stdout.splitlines() if re.search(r"\bFail", line)]
    if result.returncode != 0 or failed:
        first = failed[0] if failed else (result.stderr.strip() or f"exit {result.returncode}")
        return Check("dcgm", "fail", f"dcgmi diag -r {level}: {first}")
    return Check("dcgm", "pass", f"dcgmi diag -r {level}: no test failed")


def gpu_checks(args: argparse.Namespace) -> list[Check]:
    import torch

    checks = [gpu_count_check(torch.cuda.device_count(), args.expect_gpus)]
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=index,ecc.errors.uncorrected.volatile.total"
        smi = run(["nvidia-smi", query, "--format=csv,noheader,nounits"])
        if smi is not None and smi.returncode == 0:
            checks.append(ecc_check(smi.stdout))
    dmesg = run(["dmesg"])
    checks.append(xid_check(dmesg.stdout if dmesg is not None and dmesg.returncode == 0 else None))
    if args.dcgm_level and shutil.which("dcgmi"):
        return [*checks, dcgm_check(args.dcgm_level)]
    name = torch.cuda.get_device_name(0)
    published = published_figures(name)
    floors = (None, None)
    if published is not None:
        floors = (args.matmul_fraction * published[0], args.memory_fraction * published[1] * 1e3)
    for index in range(torch.cuda.device_count()):
        torch.cuda.set_device(index)
        tflops = matmul_tflops("cuda", torch.bfloat16, 8192)
        checks.append(judged(f"matmul_gpu{index}", tflops, "TFLOP/s", floors[0], "bf16 matmul"))
        gbps = copy_gbps("cuda", 1024)
        checks.append(judged(f"memory_gpu{index}", gbps, "GB/s", floors[1], "device copy"))
    if published is None:
        checks.append(Check("published", "skipped", f"no published figures known for {name}"))
    return checks


def cpu_checks(args: argparse.Namespace) -> list[Check]:
    import torch

    tflops = matmul_tflops("cpu", torch.float32, args.cpu_matmul_size)
    gbps = copy_gbps("cpu", args.cpu_copy_megabytes)
    return [
        judged("matmul_cpu", tflops, "TFLOP/s", args.min_cpu_tflops, "float32 matmul"),
        judged("memory_cpu", gbps, "GB/s", args.min_cpu_memory_gbps, "memory copy"),
    ]


def inject(checks: list[Check], faults: set[str]) -> list[Check]:
    unknown = faults - {c.name for c in checks}
    for check in checks:
        if check.name in faults:
            check.status, check.detail = "fail", f"injected fault ({INJECT_ENV}): {check.detail}"
    return checks + [Check(name, "fail", "injected fault: no such check ran") for name in unknown]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="node_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--expect-gpus", type=int, default=None)
    parser.add_argument("--dcgm-level", type=int, default=0, help="dcgmi diag -r LEVEL (0: off)")
    parser.add_argument("--matmul-fraction", type=float, default=0.5)
    parser.add_argument("--memory-fraction", type=float, default=0.6)
    parser.add_argument("--min-cpu-tflops", type=float, default=None)
    parser.add_argument("--min-cpu-memory-gbps", type=float, default=None)
    parser.add_argument("--cpu-matmul-size", type=int, default=512)
    parser.add_argument("--cpu-copy-megabytes", type=int, default=64)
    parser.add_argument("--inject-fault", action="append", default=[], metavar="CHECK")
    args = parser.parse_args(argv)
    if args.expect_gpus is None and os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        args.expect_gpus = int(os.environ["SLURM_GPUS_ON_NODE"])
    from_env = os.environ.get(INJECT_ENV, "")
    args.inject_fault += [name for name in from_env.split(",") if name]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    checks = gpu_checks(args) if torch.cuda.is_available() else cpu_checks(args)
    checks = inject(checks, set(args.inject_fault))
    passed = not any(c.status == "fail" for c in checks)
    report = {"node": socket.gethostname(), "passed": passed, "checks": [asdict(c) for c in checks]}
    print(json.dumps(report), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
