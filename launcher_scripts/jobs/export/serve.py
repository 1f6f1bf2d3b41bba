"""`python3 -m launcher_scripts serve EXPORT_DIR` (launcher_scripts.serving runs it here, or
as a Slurm job with --slurm): start a real Triton server on an export.

Which tritonserver runs, first found wins:
  1. --tritonserver PATH, or $TRITONSERVER;
  2. `tritonserver` on PATH (NVIDIA's Triton containers: /opt/tritonserver/bin);
  3. the one `install-triton` put in a virtual environment ($LLM_LAUNCHER_TRITON_VENV, default
     ~/.cache/llm-launcher/triton-venv): the server binary inside the `nvidia-pytriton` wheel.

The wheel's server needs three things arranged (done here): a backend directory whose Python
backend links (not copies) the wheel's stub, this interpreter's libpython first on
LD_LIBRARY_PATH (the stub embeds it), and the environment's own bin first on PATH so the stub
imports that environment's numpy 1.x (the stub returns empty tensors with numpy 2).

The model's ranks: one process alone, or TP x PP under torchrun on this node; or, run as the
processes of a multi-node job (a Slurm step's tasks, or torchrun's workers on BCP and
Kubernetes: one per rank, `serve --slurm` or `--render` with export.serving.nodes > 1), those
processes themselves: rank 0 serves (Triton, the front, the model server's rank 0) and every
other becomes a model rank that follows it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from launcher_scripts.files import write_atomic
from launcher_scripts.formats.shards import RANK_VARIABLES
from launcher_scripts.jobs.export.http_front import Front
from launcher_scripts.jobs.export.install import bundled_server, default_venv, site_packages
from launcher_scripts.jobs.export.repository import config_inputs
from launcher_scripts.jobs.process import process_info
from launcher_scripts.ports import free_port
from launcher_scripts.recipes.triton_interface import (
    CANCELLED_REQUESTS_VARIABLE,
    MAX_REQUEST_TOKENS,
    MODEL_SERVER_VARIABLE,
    PIPELINE_PARALLEL,
    REQUEST_ID_HEADER,
    STREAM_SUFFIX,
    TENSOR_PARALLEL,
    TEXT_INPUT,
)

MODEL_SERVER_POLL_SECONDS = 0.5
# Each served model is a process of its own, not a rank of the job that started the server.
JOB_VARIABLES = frozenset(RANK_VARIABLES) | {"SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"}


class ServeError(Exception):
    """Why the server cannot start, as one line for the user."""


@dataclass
class TritonInstall:
    binary: Path
    args: list[str] = field(default_factory=list)  # install-specific flags
    env: dict[str, str] = field(default_factory=dict)
    source: str = ""


def find_server(explicit: str | None) -> TritonInstall:
    explicit = explicit or os.environ.get("TRITONSERVER")
    if explicit:
        binary = Path(explicit)
        if not binary.is_file():
            raise ServeError(f"--tritonserver {explicit}: no such file")
        return TritonInstall(binary, source=str(binary))
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), source=f"{on_path} (on PATH)")
    venv = default_venv()
    if (bundled_server(venv) / "bin" / "tritonserver").is_file():
        return _wheel_install(venv)
    raise ServeError(
        "no Triton server found: run `python3 -m launcher_scripts install-triton` (from PyPI, "
        "about 400 MB), put tritonserver on PATH, or pass --tritonserver PATH"
    )


def _wheel_install(venv: Path) -> TritonInstall:
    bundled = bundled_server(venv)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundled / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"the Triton wheel in {venv} has no Python backend stub for {version}")
    backends = venv / "launcher-backends"
    python_backend = backends / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    for target in (
        bundled / "backends" / "python" / "libtriton_python.so",
        bundled / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        link = python_backend / target.name
        if link.is_symlink() or link.exists():
            if link.resolve() == target.resolve():
                continue
            link.unlink()
        link.symlink_to(target)
    libdir = str(sysconfig.get_config_var("LIBDIR") or "")
    libraries = [
        libdir,
        str(site_packages(venv) / "nvidia_pytriton.libs"),
        os.environ.get("LD_LIBRARY_PATH", ""),
    ]
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(part for part in libraries if part),
        "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
    }
    args = [f"--backend-directory={backends}", f"--cache-directory={bundled / 'caches'}"]
    return TritonInstall(bundled / "bin" / "tritonserver", args, env, f"{venv} (install-triton)")


def model_repository(path: Path) -> Path:
    """The repository inside an export directory, or the path itself when it is one."""
    for candidate in (path / "model_repo", path):
        if candidate.is_dir() and any(candidate.glob("*/config.pbtxt")):
            return candidate
    raise ServeError(
        f"{path} holds no Triton model repository (no */config.pbtxt): pass the export stage's "
        "results directory or its model_repo folder"
    )


def server_command(
    install: TritonInstall, repository: Path, http_port: int, grpc_port: int
) -> list[str]:
    """Triton's HTTP endpoint listens on 127.0.0.1 only: users reach it through the front."""
    return [
        str(install.binary),
        f"--model-repository={repository}",
        *install.args,
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--allow-gpu-metrics=false",
        "--strict-readiness=true",
        # Stopping, Triton unloads a model's instances one after another, about a second
        # each (its Python backend's stub and monitor threads), and 10 s ran out on a busy
        # 2-core machine with two models of four. In-flight requests do not count here:
        # the stopper cancels them at once.
        "--exit-timeout-secs=30",  # Triton's default
        "--disable-auto-complete-config",
        # The front's request ids reach the model as request parameters (http_front.py).
        f"--http-header-forward-pattern=^{REQUEST_ID_HEADER}$",
    ]


def wait_ready(process: subprocess.Popen, http_port: int, timeout: float) -> None:
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServeError(
                f"tritonserver exited with code {process.returncode} before it was ready: see "
                "its log above (a model that failed to load is named there)"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise ServeError(f"tritonserver was not ready within {timeout:.0f} s: raise --ready-timeout")


PROG = "python3 -m launcher_scripts serve"
DESCRIPTION = "Start a Triton server on an export stage's model repository."


def server_options() -> argparse.ArgumentParser:
    """The server's options: this program's, and the launcher's `serve` command's, which adds
    its own (launcher_scripts.serving)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("export_dir", type=Path, help="export results dir or its model_repo")
    parser.add_argument("--http-port", type=port, default=8000, help="a number, or auto")
    parser.add_argument("--grpc-port", type=port, default=8001, help="a number, or auto")
    parser.add_argument("--tritonserver", help="the tritonserver binary to run")
    parser.add_argument("--ready-timeout", type=float, default=600, help="seconds (default 600)")
    parser.add_argument(
        "--endpoint-file", type=Path, help="once ready, write the host and ports here (JSON)"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=16,
        help="sequences the model generates at once (in-flight batching; default 16)",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, parents=[server_options()])
    return parser.parse_args(argv)


def port(value: str) -> int:
    """A port number; `auto` takes a free one (a shared node may have 8000 in use)."""
    if value == "auto":
        return free_port()
    number = int(value)
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a port number")
    return number


def write_endpoint(path: Path, http_port: int, grpc_port: int) -> None:
    host = socket.getfqdn()
    endpoint = {"host": host, "http": f"{host}:{http_port}", "grpc": f"{host}:{grpc_port}"}
    write_atomic(path, json.dumps(endpoint) + "\n")


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve until the server exits or is stopped; `args`: server_options()'s."""
    if args.slots < 1:
        print(f"error: --slots {args.slots}: give 1 or more (sequences at once)", file=sys.stderr)
        return 2
    try:
        repository = model_repository(args.export_dir.resolve())
        install = find_server(args.tritonserver)
    except ServeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    job = process_info()
    spread = job.launcher in ("slurm", "torchrun") and job.world_size > 1
    if spread:
        try:
            check_step(served_model(repository), job.world_size)
        except ServeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if job.rank != 0:  # a model rank: it follows rank 0 until the server stops
            command = model_server_command(served_model(repository), None, args.slots)
            os.execv(sys.executable, command)
    models = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
    with tempfile.TemporaryDirectory(prefix="serve-") as scratch:
        cancelled = Path(scratch) / "cancelled"
        cancelled.mkdir()
        socket_path = Path(scratch) / "model.sock"
        configs = {m: (repository / m / "config.pbtxt").read_text() for m in models}
        inputs = {m: config_inputs(config) for m, config in configs.items()}
        # OpenAI's API serves the text models: not their streaming twins (it streams itself)
        # nor the ensemble and its steps.
        texts = [
            m
            for m, config in configs.items()
            if TEXT_INPUT in inputs[m]
            and "model_file" in config
            and "decoupled: true" not in config
        ]
        try:  # before anything starts, so that a port in use fails at once
            front = Front(args.http_port, free_port(), cancelled, socket_path, tuple(texts), inputs)
        except OSError as error:
            print(f"error: --http-port {args.http_port}: {error.strerror}", file=sys.stderr)
            return 2
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
        # Spread over a job's processes, the model server is its rank 0: it keeps their ranks.
        model_env = dict(os.environ) if spread else env
        model = start_model_server(repository, socket_path, args.slots, model_env, spread)
        try:
            wait_model_server(model, socket_path, args.ready_timeout)
        except ServeError as error:
            print(f"error: {error}", file=sys.stderr)
            stop_process(model)
            return 1
        print(f"starting Triton from {install.source} on {repository}", flush=True)
        command = server_command(install, repository, front.backend_port, args.grpc_port)
        triton_env = env | install.env
        triton_env[CANCELLED_REQUESTS_VARIABLE] = str(cancelled)
        triton_env[MODEL_SERVER_VARIABLE] = str(socket_path)
        process = subprocess.Popen(command, env=triton_env)
        stopper = _Stopper(process, front)
        front.start()
        try:
            return _serve(process, front, args, models, stopper, model)
        finally:
            front.stop()
            stop_process(model)


@dataclass
class ServedModel:
    """What the repository's (non-streaming) model serves: its config.pbtxt's parameters."""

    model_file: Path
    max_request_tokens: str | None
    tensor: int
    pipeline: int


def served_model(repository: Path) -> ServedModel:
    for config in sorted(repository.glob("*/config.pbtxt")):
        if config.parent.name.endswith(STREAM_SUFFIX):
            continue
        text = config.read_text()
        model_file = _config_parameter(text, "model_file")
        if model_file:
            return ServedModel(
                (config.parent / model_file).resolve(),
                _config_parameter(text, MAX_REQUEST_TOKENS),
                int(_config_parameter(text, TENSOR_PARALLEL) or 1),
                int(_config_parameter(text, PIPELINE_PARALLEL) or 1),
            )
    raise ServeError(f"{repository}: no model's config.pbtxt names its model_file: export again")


def _config_parameter(config: str, key: str) -> str | None:
    found = re.search(
        rf'key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*"([^"]+)"', config
    )
    return found.group(1) if found else None


def check_step(served: ServedModel, tasks: int) -> None:
    """A multi-node job's processes are the model's ranks: as many as the export's TP x PP."""
    ranks = served.tensor * served.pipeline
    if tasks != ranks:
        raise ServeError(
            f"this job has {tasks} processes, but the export serves at TP={served.tensor} x "
            f"PP={served.pipeline}: run it with {ranks}, one per model rank (serve --slurm or "
            "--render with export.serving.nodes dividing them does)"
        )


def model_server_command(served: ServedModel, socket_path: Path | None, slots: int) -> list[str]:
    """One model rank's command (jobs/inference/model_server.py); only rank 0 listens on
    `socket_path` (None for the others)."""
    socket_path = socket_path or Path(tempfile.gettempdir()) / "serve-follower.sock"
    command = [sys.executable, "-m", "launcher_scripts.jobs.inference.model_server"]
    command += ["--model", str(served.model_file), "--socket", str(socket_path)]
    command += ["--slots", str(slots), "--tensor", str(served.tensor)]
    command += ["--pipeline", str(served.pipeline)]
    if served.max_request_tokens is not None:
        command += ["--max-request-tokens", served.max_request_tokens]
    return command


def start_model_server(
    repository: Path, socket_path: Path, slots: int, env: dict[str, str], spread: bool = False
) -> subprocess.Popen:
    """The model's processes: TP x PP of them under torchrun when the export asked for more
    than one; or, `spread` over a multi-node job's processes, its rank 0 (the other processes
    are the other ranks). Triton's models ask rank 0."""
    served = served_model(repository)
    processes = served.tensor * served.pipeline
    command = model_server_command(served, socket_path, slots)
    if processes > 1 and not spread:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
        command = [command[0], *launcher, *command[1:]]
    where = "spread over the job's nodes" if spread else "on this node"
    print(
        f"starting the model server: TP={served.tensor} x PP={served.pipeline} "
        f"({processes} process(es) {where}), {slots} slots",
        flush=True,
    )
    return subprocess.Popen(command, env=env)


def wait_model_server(process: subprocess.Popen, socket_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not socket_path.exists():
        if process.poll() is not None:
            raise ServeError(f"the model server exited with code {process.returncode} (above)")
        if time.monotonic() > deadline:
            raise ServeError(f"the model server was not listening after {timeout:.0f} s")
        time.sleep(0.2)


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _serve(
    process: subprocess.Popen,
    front: Front,
    args: argparse.Namespace,
    models: list[str],
    stopper: _Stopper,
    model: subprocess.Popen | None = None,
) -> int:
    try:
        wait_ready(process, front.backend_port, args.ready_timeout)
        print(
            f"ready: models {', '.join(models)} at http://localhost:{args.http_port} (HTTP) "
            f"and localhost:{args.grpc_port} (gRPC); Ctrl-C stops the server",
            flush=True,
        )
        if args.endpoint_file:
            write_endpoint(args.endpoint_file, args.http_port, args.grpc_port)
        code = _wait_both(process, model, stopper)
    except ServeError as error:
        if stopper.asked:  # stopped while it was starting
            return stopper.stopped(process.wait())
        print(f"error: {error}", file=sys.stderr)
        stopper.stop(signal.SIGTERM, None)
        process.wait()
        return 1
    except KeyboardInterrupt:  # SIGINT arrived before the handler was in place
        stopper.stop(signal.SIGINT, None)
        code = process.wait()
    return stopper.stopped(code) if stopper.asked else code


def _wait_both(triton: subprocess.Popen, model: subprocess.Popen | None, stopper: _Stopper) -> int:
    """Triton's exit code. A model server that exits first (a rank died: torchrun ends the
    others) stops Triton too, with one line, instead of leaving clients waiting on nothing."""
    while True:
        try:
            return triton.wait(timeout=MODEL_SERVER_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if model is not None and model.poll() is not None and not stopper.asked:
            raise ServeError(
                f"the model server exited with code {model.returncode} (a model rank failed; "
                "its log is above): stopping the Triton server"
            )


class _Stopper:
    """Ctrl-C (SIGINT, to the whole process group from a terminal) or SIGTERM (scancel, a
    container's stop): the model drops the requests it is generating for, so that Triton's
    wait for in-flight requests (--exit-timeout-secs) ends at once instead of running out,
    and the server stops with one line."""

    def __init__(self, process: subprocess.Popen, front: Front) -> None:
        self.process = process
        self.front = front
        self.asked = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.stop)

    def stop(self, _signum: int, _frame: object) -> None:
        self.asked = True
        self.front.cancel_all()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stopped(self, code: int) -> int:
        if code == 0:
            print("stopped: the Triton server has shut down", flush=True)
            return 0
        print(f"stopped: tritonserver exited with code {code} (its log is above)", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
