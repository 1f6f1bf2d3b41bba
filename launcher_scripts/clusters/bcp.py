"""NVIDIA Base Command Platform (`cluster_type=bcp`): bcprun scripts, run from inside a BCP job.

On BCP the launcher itself runs inside a multi-node BCP job (`ngc batch run --replicas N
--array-type PYTORCH`), on its node 0, as the NeMo launcher's BCP instructions have it. Each
JobSpec renders to a bash script that starts its commands on the job's nodes with `bcprun`; the
scripts run one after the other on node 0, so this backend is synchronous like the local one and
shares its process running (submit, tee into the log, cancel, logs) by subclassing it.

Rank wiring. bcprun starts ONE process per node (`--npernode 1`); on each node that process is
`python3 -m torch.distributed.run`, which starts the command's processes and gives each the
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT that our programs read
(launcher_scripts/jobs/training/runtime.py process_info, formats/shards.py). The nodes
meet in torchrun's c10d rendezvous hosted by node 0 (NGC_MASTER_ADDR, else the hostname of the
node running the script, which is node 0), and the rendezvous assigns node ranks. This relies on
nothing of bcprun but "run this command once on each of N nodes": not on which per-process
variables a bcprun version exports, nor on NGC_ARRAY_INDEX reaching the remote processes. The
BCP rank variables (NGC_ARRAY_INDEX/NGC_ARRAY_SIZE, and any RANK/SLURM_* inherited) are unset on
each node before torchrun, because data-preparation programs prefer NGC_ARRAY_INDEX to RANK and
would otherwise split their work by node instead of by process, and wrongly when a job uses
fewer nodes than the BCP job has replicas.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from launcher_scripts.clusters.base import (
    ShellVar,
    check_gpus_per_node,
    export_lines,
    format_argv,
    format_quoted,
    nodes_key,
    refuse_companions,
    shell_word,
    shutdown_env,
)
from launcher_scripts.clusters.local import LocalBackend
from launcher_scripts.config.checks import require_env_name, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.shards import RANK_VARIABLES
from launcher_scripts.jobspec import Command, JobSpec

# torchrun's default c10d rendezvous port; jobs run one at a time, so one port serves them all.
RENDEZVOUS_PORT = 29400


def node_command(job: JobSpec, command: Command) -> str:
    """The shell command bcprun runs once on each node (expanded there, not on node 0)."""
    program = ["-m", command.module, *command.args]
    multi_node = job.array_size is not None or job.resources.nodes > 1
    if not multi_node and command.nproc_per_node == 1:
        return shlex.join(["python3", "-u", *program])
    launcher = ["python3", "-u", "-m", "torch.distributed.run"]
    if multi_node:
        # MASTER_ADDR, MASTER_PORT and LAUNCHER_NNODES come from node 0 through bcprun --env.
        rendezvous = [
            '--nnodes="$LAUNCHER_NNODES"',
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            f"--rdzv-id={shlex.quote(job.name)}",
        ]
    else:
        rendezvous = ["--standalone"]
    words = [
        shlex.join(launcher),
        *rendezvous,
        f"--nproc-per-node={command.nproc_per_node}",
        shlex.join(program),
    ]
    return f"unset {' '.join(RANK_VARIABLES)}; exec {' '.join(words)}"


class BcpBackend(LocalBackend):
    name = "bcp"
    synchronous = True

    def __init__(self, root: Any = None) -> None:
        super().__init__(root)
        self.root = root
        self.cluster = root.cluster if root is not None else {}

    def jobs_use_launcher_environment(self) -> bool:
        return False  # every BCP job runs in an image

    def outer_launch(self, jobs: Sequence[JobSpec], overrides: Sequence[str]) -> tuple[str, str]:
        """The script that starts, from a workstation, the BCP job this run needs: (file
        name, text). A dry run writes it beside the run's results."""
        root = self.root
        # The job runs the pipeline for real: the dry run is this side's.
        overrides = [o for o in overrides if not o.lstrip("+~").startswith("dry_run=")]
        script = ngc_batch_run(
            root.cluster,
            jobs,
            overrides,
            str(root.launcher_scripts_path),
            root.get("container"),
        )
        return "ngc_batch_run.sh", script

    # ----- checks before running ---------------------------------------------------------

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        # The BCP job's replicas are known on its node 0 (check_submission).
        refuse_companions(jobs, self.name)
        gpus = self.cluster.get("gpus_per_node") if self.cluster else None
        limit = None if gpus is None else require_int("cluster.gpus_per_node", gpus)
        check_gpus_per_node(jobs, limit, "cluster.gpus_per_node")

    def jobs_find_gpus(self) -> bool | None:
        return None  # the jobs run on the BCP job's nodes, not here

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        if shutil.which("bcprun") is None:
            raise ConfigError(
                "cluster_type",
                "is bcp but bcprun is not on PATH",
                "Run the launcher inside a Base Command Platform job (on its node 0), or use "
                "cluster_type=local, or dry_run=true to render the scripts",
            )
        replicas = os.environ.get("NGC_ARRAY_SIZE")
        if replicas is None or not replicas.isdigit():
            return
        for job in jobs:
            if job.array_size is None and job.resources.nodes > int(replicas):
                raise ConfigError(
                    nodes_key(job),
                    f"job {job.name} needs {job.resources.nodes} nodes but this BCP job has "
                    f"{replicas} replicas (NGC_ARRAY_SIZE)",
                    f"Start the BCP job with --replicas {job.resources.nodes} or more, or ask "
                    f"for at most {replicas} nodes",
                )

    # ----- rendering ---------------------------------------------------------------------

    def render(self, job: JobSpec) -> str:
        lines = [
            "#!/usr/bin/env bash",
            f"# Stage {job.stage}, job {job.name}: rendered by launcher_scripts (BCP backend).",
            "# Run it on node 0 of a Base Command Platform job: bash <this file>",
            "set -euo pipefail",
            "",
            f"export PYTHONPATH={shlex.quote(job.pythonpath)}${{PYTHONPATH:+:${{PYTHONPATH}}}}",
            *export_lines(job.env),
        ]
        if job.array_size is not None or job.resources.nodes > 1:
            lines.append('replicas="${NGC_ARRAY_SIZE:-1}"')
        if job.array_size is not None:
            size = job.array_size
            lines += [
                f"# {size} array tasks, spread over the replicas; each process takes its share.",
                f"nodes=$(( replicas < {size} ? replicas : {size} ))",
            ]
        else:
            nodes = job.resources.nodes
            lines.append(f"nodes={nodes}")
        if job.array_size is None and job.resources.nodes > 1:
            lines += [
                'if [ "$nodes" -gt "$replicas" ]; then',
                "    echo "
                + shell_word(
                    f"launcher: job {job.name} needs {nodes} nodes but this BCP job has ",
                    ShellVar("replicas"),
                    f" replicas (NGC_ARRAY_SIZE); start it with --replicas {nodes} or more",
                )
                + " >&2",
                "    exit 1",
                "fi",
            ]
        lines += [
            "# Node 0, where this script runs, hosts the rendezvous.",
            'MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"',
            f"MASTER_PORT={RENDEZVOUS_PORT}",
            "export MASTER_ADDR MASTER_PORT",
            f"cd {shlex.quote(job.results_dir)}",
        ]
        env = [
            f"--env {shlex.quote(f'{name}={value}')}"
            for name, value in [*job.env, *shutdown_env(job, self.grace)]
        ]
        for position, command in enumerate(job.commands, start=1):
            words = [
                # The last command replaces the shell, so a cancel's signal reaches bcprun.
                "exec bcprun" if position == len(job.commands) else "bcprun",
                '--nnodes "$nodes"',
                "--npernode 1",
                f"--workdir {shlex.quote(job.results_dir)}",
                '--env "PYTHONPATH=$PYTHONPATH"',
                *env,
                '--env "MASTER_ADDR=$MASTER_ADDR"',
                '--env "MASTER_PORT=$MASTER_PORT"',
                '--env "LAUNCHER_NNODES=$nodes"',
                f"-c {shlex.quote(node_command(job, command))}",
            ]
            lines += [
                "",
                "# shellcheck disable=SC2016  # expanded on each node",
                format_quoted(words),
            ]
        return "\n".join(lines) + "\n"


def ngc_batch_run(
    cluster: Mapping[str, Any],
    jobs: Sequence[JobSpec],
    overrides: Sequence[str],
    launcher_scripts_path: str,
    image: str | None = None,
) -> str:
    """A script with the `ngc batch run` command that starts a BCP job running this launcher
    (`python3 main.py overrides...` on node 0) with enough replicas for every job."""
    replicas = max(
        [job.array_size or job.resources.nodes for job in jobs] + [1],
    )
    image = str(cluster.get("image") or image or "")
    if not image:
        raise ConfigError("cluster.image", "is not set", "Set cluster.image or container")
    name = str(cluster.get("job_name") or "launcher")
    inner = [
        "python3",
        "main.py",
        *overrides,
    ]
    commandline = f"cd {shlex.quote(launcher_scripts_path)} && {shlex.join(inner)}"
    argv = ["ngc", "batch", "run", "--name", name]
    for key in ("org", "team", "ace"):
        if cluster.get(key):
            argv += [f"--{key}", str(cluster[key])]
    argv += ["--instance", str(cluster.get("instance") or "dgxa100.80g.8.norm")]
    argv += ["--image", image, "--replicas", str(replicas), "--array-type", "PYTORCH"]
    argv += ["--total-runtime", str(cluster.get("total_runtime") or "24h")]
    argv += ["--result", str(cluster.get("result_dir") or "/results")]
    for index, workspace in enumerate(cluster.get("workspaces") or ()):
        for part in ("id", "mount"):
            if ":" in str(workspace[part]):
                raise ConfigError(
                    f"cluster.workspaces[{index}].{part}",
                    f"{workspace[part]!r} holds a colon, which ngc's --workspace ID:MOUNT:MODE "
                    "cannot hold",
                    "Remove it",
                )
        argv += ["--workspace", f"{workspace['id']}:{workspace['mount']}:RW"]
    for key, value in sorted((cluster.get("env") or {}).items()):
        require_env_name(f"cluster.env.{key}", key)
        argv += ["--env-var", f"{key}:{value}"]
    argv += ["--commandline", commandline]
    return "#!/usr/bin/env bash\n" + format_argv(argv) + "\n"
