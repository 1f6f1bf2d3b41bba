"""No configured value reaches a shell unquoted, on any backend.

Every stage case of the golden scripts is rendered for every backend with shell syntax in every
path (the three root paths, which every stage's paths derive from), the stage's run name, an
environment variable, the W&B key file, the container image and mounts and the backend's own
cluster keys. Each script must pass `bash -n`, then runs end to end under stand-ins for the
programs it calls (tests/scripts/standin.py: python3, srun, scontrol, bcprun, ngc) with fake
SLURM_* / NGC_* variables: no marker file may appear, and each program must get its arguments,
working folder and environment exactly as configured. A Kubernetes container's command is run
the same way, after Kubernetes' own $(VAR) expansion. Values a target cannot hold are refused in
preflight with one line naming the key.
"""

from __future__ import annotations

import gzip
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf, open_dict

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.clusters.bcp import ngc_batch_run
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import escape_interpolations
from launcher_scripts.errors import ConfigError
from launcher_scripts.pipeline import plan
from tests.support import REPO
from tests.support.commands import run_main, run_ops
from tests.support.golden_cases import CASES, ONLY_ON, case_backends, case_overrides

# Shell syntax that creates a marker file wherever it reaches a shell unquoted.
HOSTILE = "x $(touch M1) `touch M2`;touch M3 'q' \"d\" ${IFS}y |touch M4 &"
# Where a value may hold a newline (not on an #SBATCH line): what follows it, too.
NEWLINE = "\n$(touch M5)\ntouch M5 #"
MARKERS = ("M1", "M2", "M3", "M4", "M5")
ROLES = ("python3", "srun", "scontrol", "bcprun", "ngc")
STANDIN = REPO / "tests" / "scripts" / "standin.py"


def hydra_text(text: str) -> str:
    """`text` as a quoted Hydra override value that composes to exactly `text`."""
    return "'" + text.replace("'", "\\'").replace("${", "\\${") + "'"


def standin_path(folder: Path) -> str:
    """A PATH whose python3, srun, scontrol, bcprun and ngc are the stand-ins."""
    folder.mkdir(parents=True, exist_ok=True)
    for role in ROLES:
        program = folder / role
        program.write_text(
            f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} "
            f'{role} "$@"\n'
        )
        program.chmod(0o755)
    return f"{folder}:/usr/local/bin:/usr/bin:/bin"


class Hostile:
    """A configuration full of shell syntax for one backend, under `root`."""

    def __init__(self, root: Path, backend: str) -> None:
        self.root, self.backend = root, backend
        # An #SBATCH line (the job's --output is in its results folder) cannot hold a newline.
        tail = "" if backend == "bcm" else NEWLINE
        self.paths = {
            key: str(root / f"{key} {HOSTILE}{tail}")
            for key in ("launcher_scripts_path", "data_dir", "base_results_dir")
        }
        self.env_value = HOSTILE + NEWLINE
        self.key_file = root / f"key {HOSTILE}"
        self.key_file.write_text("not a real key\n")

    def overrides(self, case: str) -> list[str]:
        stage, _ = CASES[case]
        paths = [f"{key}={hydra_text(value)}" for key, value in self.paths.items()]
        # The pods see everything under the test's folder.
        volume = f"{{name:work,mount_path:{hydra_text(str(self.root))},host_path:'{self.root}'}}"
        _, composed = case_overrides(case, self.backend, paths, [f"cluster.volumes=[{volume}]"])
        mounts = [str(self.root / f"mount {HOSTILE}"), f"{self.root}/src:/dst {HOSTILE}"]
        composed += [
            f"{stage}.run.name={hydra_text('run ' + HOSTILE)}",
            f"+env_vars.LAUNCHER_TEST={hydra_text(self.env_value)}",
            f"wandb_api_key_file={hydra_text(str(self.key_file))}",
            "dry_run=true",
        ]
        if self.backend != "local":  # local starts no container, and refuses one
            composed += [
                f"container={hydra_text('nvcr.io/nvidia/nemo:24.05 ' + HOSTILE)}",
                f"container_mounts=[{','.join(hydra_text(mount) for mount in mounts)}]",
            ]
        if self.backend == "local" and stage == "training":
            composed.append("training.trainer.num_nodes=1")  # local runs this machine alone
        return composed + self.cluster_overrides()

    def cluster_overrides(self) -> list[str]:
        text = hydra_text(HOSTILE)
        if self.backend == "bcm":
            keys = ("partition", "account", "qos", "reservation", "comment", "job_name_prefix")
            return [f"++cluster.{key}={text}" for key in keys] + [
                f"++cluster.sbatch_options.constraint={text}",
                f"++cluster.srun_args=[{hydra_text('--comment=' + HOSTILE)}]",
            ]
        if self.backend == "bcp":
            keys = ("job_name", "org", "team", "ace", "instance", "total_runtime", "result_dir")
            workspace = f"{{id:{text},mount:{hydra_text('/mnt/' + HOSTILE)}}}"
            return [f"cluster.{key}={text}" for key in keys] + [
                f"+cluster.env.LAUNCHER_TEST={hydra_text(self.env_value)}",
                f"cluster.workspaces=[{workspace}]",
            ]
        if self.backend == "k8s":
            return [f"+cluster.env.LAUNCHER_TEST_K8S={hydra_text(self.env_value)}"]
        return []


def move_case_inputs(cfg: Any, stage: str, data_dir: str) -> None:
    """The case's own input files (literal /data/... paths) moved under `data_dir` and created
    there, since preflight reads them."""
    raw = OmegaConf.to_container(cfg[stage], resolve=False)
    for key, value in raw.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and v.startswith("/data/") for v in values):
            continue
        moved = [data_dir + item.removeprefix("/data") for item in values]
        for path in map(Path, moved):
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".gz":
                path.write_bytes(gzip.compress(b'{"text": "a"}\n'))
            elif path.suffix:
                path.write_text('{"text": "a"}\n')
            elif key == "hf_model_dir":  # a Hugging Face model: its family from config.json
                path.mkdir()
                (path / "config.json").write_text('{"model_type": "t5"}')
            else:  # a folder of inputs
                path.mkdir()
                (path / "a.jsonl").write_text('{"text": "a"}\n')
        cfg[stage][key] = escape_interpolations(moved if isinstance(value, list) else moved[0])


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and env values: `$$` is `$`, `$(NAME)` of
    a declared variable its value, any other reference stays as it is."""
    out, position = [], 0
    while position < len(text):
        if text.startswith("$$", position):
            out.append("$")
            position += 2
        elif text.startswith("$(", position) and text.find(")", position) > 0:
            end = text.index(")", position)
            name = text[position + 2 : end]
            out.append(env[name] if name in env else text[position : end + 1])
            position = end + 1
        else:
            out.append(text[position])
            position += 1
    return "".join(out)


def run_manifest(manifest: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    """The Job's container command, as the kubelet would start it, on this machine."""
    job = next(doc for doc in yaml.safe_load_all(manifest) if doc and doc["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = dict(environment)
    for variable in container["env"]:
        env[variable["name"]] = (
            k8s_expand(variable["value"], env) if "value" in variable else "0"  # fieldRefs
        )
    command = [k8s_expand(word, env) for word in container["command"]]
    Path(container["workingDir"]).mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        command, cwd=container["workingDir"], env=env, capture_output=True, text=True
    )


def records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def contains(sequence: list[str], part: list[str]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def markers(root: Path) -> list[Path]:
    return [path for path in root.rglob("M[1-5]") if path.name in MARKERS]


@pytest.mark.parametrize(("case", "backend_name"), case_backends(BACKENDS))
def test_hostile_values_stay_text(case: str, backend_name: str, tmp_path: Path) -> None:
    hostile = Hostile(tmp_path, backend_name)
    overrides = hostile.overrides(case)
    cfg = compose_config(overrides)
    assert cfg.base_results_dir == hostile.paths["base_results_dir"]  # composed as intended
    move_case_inputs(cfg, CASES[case][0], hostile.paths["data_dir"])
    backend, _resolved, planned = plan(cfg)
    jobs = [job for stage in planned for job in stage.jobs]
    log = tmp_path / "standin.jsonl"
    environment = {
        "PATH": standin_path(tmp_path / "bin"),
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "STANDIN_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node0",
        # A heterogeneous job's components (a job with companions): a node each.
        **{f"SLURM_JOB_NODELIST_HET_GROUP_{group}": f"node{group}" for group in range(4)},
        "NGC_ARRAY_SIZE": "64",
        "NGC_MASTER_ADDR": "node0",
    }
    work = tmp_path / "work"
    work.mkdir()
    for index, job in enumerate(jobs):
        spec = job.spec
        Path(spec.results_dir).mkdir(parents=True, exist_ok=True)
        start = len(records(log))
        if backend_name == "k8s":
            result = run_manifest(job.script, environment)
        else:
            script = tmp_path / f"job{index}.sh"
            script.write_text(job.script)
            check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            assert check.returncode == 0, check.stderr
            result = subprocess.run(
                ["bash", str(script)], cwd=work, env=environment, capture_output=True, text=True
            )
        assert not markers(tmp_path), f"{spec.name}: a value ran as shell code"
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        programs = [r for r in records(log)[start:] if r["role"] == "python3"]
        for command in [*spec.commands, *(c.command for c in spec.companions)]:
            ran = [r for r in programs if contains(r["argv"], [command.module, *command.args])]
            assert ran, f"{spec.name}: {command.module} did not get its arguments intact"
            assert all(Path(r["cwd"]) == Path(spec.results_dir) for r in ran)
            assert all(r["env"]["LAUNCHER_TEST"] == hostile.env_value for r in ran)
            assert all(r["env"]["WANDB_API_KEY_FILE"] == str(hostile.key_file) for r in ran)
            assert all(
                r["env"]["PYTHONPATH"].startswith(hostile.paths["launcher_scripts_path"])
                for r in ran
            )
        if backend_name == "bcp" and "NGC_ARRAY_SIZE" in job.script:
            # A multi-node job on too few replicas stops with a line naming the job.
            few = subprocess.run(
                ["bash", str(script)],
                cwd=work,
                env={**environment, "NGC_ARRAY_SIZE": "1"},
                capture_output=True,
                text=True,
            )
            assert not markers(tmp_path), f"{spec.name}: a value ran as shell code"
            if spec.array_size is None and spec.resources.nodes > 1:
                assert few.returncode == 1 and f"job {spec.name} needs" in few.stderr
    if backend_name == "bcp":
        # The script that starts the BCP job from a workstation: its command line is run by a
        # shell there, which runs main.py with the overrides as they were given.
        _name, text = backend.outer_launch([job.spec for job in jobs], overrides)
        Path(hostile.paths["launcher_scripts_path"]).mkdir(parents=True, exist_ok=True)
        outer = tmp_path / "ngc_batch_run.sh"
        outer.write_text(text)
        start = len(records(log))
        result = subprocess.run(
            ["bash", str(outer)], cwd=work, env=environment, capture_output=True, text=True
        )
        assert not markers(tmp_path), "ngc_batch_run.sh: a value ran as shell code"
        assert result.returncode == 0, result.stderr
        [main] = [r for r in records(log)[start:] if r["role"] == "python3"]
        assert main["argv"] == ["main.py", *[o for o in overrides if o != "dry_run=true"]]
        assert main["cwd"] == hostile.paths["launcher_scripts_path"]


# ----- values a target cannot hold ------------------------------------------------------------

STAGE_CASES = sorted(
    {stage: case for case, (stage, _) in CASES.items() if case not in ONLY_ON}.items()
)
BAD_JOB_NAMES = ["two\nlines", "a/b", "tab\there", "bell\a"]
BAD_ENV_NAMES = ["A;touch M1", "1A", "A-B", "A B", "A$(touch M1)", "A=B", ""]


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize(("stage", "case"), STAGE_CASES)
def test_a_job_name_no_file_or_scheduler_can_hold_is_refused(
    stage: str, case: str, backend_name: str
) -> None:
    _, overrides = case_overrides(case, backend_name)
    composed = compose_config([*overrides, "dry_run=true"])
    for name in BAD_JOB_NAMES:
        cfg = composed.copy()
        with open_dict(cfg):
            cfg[stage].run.name = name
        with pytest.raises(ConfigError) as error:
            plan(cfg)
        assert error.value.key == f"{stage}.run.name", (name, str(error.value))


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_a_code_path_pythonpath_cannot_hold_is_refused(backend_name: str) -> None:
    _, overrides = case_overrides("training_gpt3_tiny", backend_name)
    with pytest.raises(ConfigError) as error:
        plan(compose_config([*overrides, "dry_run=true", "launcher_scripts_path='/opt/a:b'"]))
    assert error.value.key == "launcher_scripts_path", str(error.value)


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_an_env_var_name_a_shell_cannot_export_is_refused(backend_name: str) -> None:
    _, overrides = case_overrides("training_gpt3_tiny", backend_name)
    composed = compose_config([*overrides, "dry_run=true"])
    for name in BAD_ENV_NAMES:
        cfg = composed.copy()
        with open_dict(cfg):
            cfg.env_vars[name] = "1"
        with pytest.raises(ConfigError) as error:
            plan(cfg)
        assert error.value.key == f"env_vars.{name}", str(error.value)


def slurm_plan(*overrides: str) -> None:
    _, composed = case_overrides("training_gpt3_126m_container", "bcm")
    plan(compose_config([*composed, "dry_run=true", *overrides]))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        *[
            (f"++cluster.{key}='a\nb'", f"cluster.{key}")
            for key in ("partition", "account", "qos", "reservation", "comment", "exclude")
        ],
        ("++cluster.job_name_prefix='a\nb'", "cluster.job_name_prefix"),
        ("++cluster.sbatch_options.constraint='a\nb'", "cluster.sbatch_options.constraint"),
        ("++cluster.sbatch_options.gres='gpu\r8'", "cluster.sbatch_options.gres"),
        # The job's --output file is in its results folder: no newline, no Slurm pattern.
        ("base_results_dir='/results\n$(touch M1)'", "training.run.results_dir"),
        ("base_results_dir=/results%j", "training.run.results_dir"),
        ("base_results_dir='/res\\\\ults'", "training.run.results_dir"),
        ("training.run.name=run%x", "training.run.results_dir"),
        # pyxis's --container-mounts is a comma-separated list of SRC[:DST[:FLAGS]].
        ("container_mounts=['/a,/etc:/b']", "container_mounts[0]"),
        ("container_mounts=[/ok,'/x,y:/z']", "container_mounts[1]"),
        ("base_results_dir='/res,ults'", "base_results_dir"),
        ("data_dir='/da:ta'", "data_dir"),
        ("launcher_scripts_path='/co,de'", "launcher_scripts_path"),
        ("training.run.time_limit='1 day'", "training.run.time_limit"),
    ],
)
def test_a_value_slurm_cannot_hold_is_refused(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        slurm_plan(override)
    assert error.value.key == key, str(error.value)


@pytest.mark.parametrize(
    ("cluster", "key"),
    [
        ({"env": {"A;touch M1": "1"}}, "cluster.env.A;touch M1"),
        ({"env": {"1A": "1"}}, "cluster.env.1A"),
        ({"workspaces": [{"id": "ws:1", "mount": "/m"}]}, "cluster.workspaces[0].id"),
        ({"workspaces": [{"id": "ws", "mount": "/m:ro"}]}, "cluster.workspaces[0].mount"),
    ],
)
def test_a_value_the_ngc_command_cannot_hold_is_refused(cluster: dict, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        ngc_batch_run({"image": "nvcr.io/nvidia/nemo:24.05", **cluster}, [], [], "/opt/launcher")
    assert error.value.key == key, str(error.value)


def test_a_refused_name_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = run_main(
        f"base_results_dir={results}",
        f"data_dir={tmp_path / 'data'}",
        "stages=[training]",
        "training.run.name='two\nlines'",
        "dry_run=true",
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: training.run.name: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not results.exists()


# ----- for real -------------------------------------------------------------------------------


def test_a_local_run_with_shell_syntax_in_every_path_runs(tmp_path: Path) -> None:
    """Data preparation for real (local backend), its paths and run name full of shell syntax:
    it completes, writes where it was told, and `status` reads its run."""
    hostile = Hostile(tmp_path, "local")
    name = f"prep {HOSTILE}"
    result = run_main(
        f"base_results_dir={hydra_text(hostile.paths['base_results_dir'])}",
        f"data_dir={hydra_text(hostile.paths['data_dir'])}",
        f"data_preparation.run.name={hydra_text(name)}",
        f"+env_vars.LAUNCHER_TEST={hydra_text(hostile.env_value)}",
        "stages=[data_preparation]",
        cwd=tmp_path,
    )
    assert not markers(tmp_path) and not markers(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shards = Path(hostile.paths["data_dir"]) / "custom_dataset" / "preprocessed"
    assert list(shards.glob("*_text_document.bin"))
    results = Path(hostile.paths["base_results_dir"])
    status = run_ops("status", str(results), "--json")
    assert status.returncode == 0, status.stderr
    states = [
        job["state"] for stage in json.loads(status.stdout)["stages"] for job in stage["jobs"]
    ]
    assert states == ["COMPLETED", "COMPLETED"]


@pytest.mark.usefixtures("slurm")
def test_sbatch_reads_the_directives_as_written(tmp_path: Path) -> None:
    """The #SBATCH lines of a requeueable job with shell syntax in its name, results folder and
    comment, as the real sbatch reads them (held, so it never runs)."""
    hostile = Hostile(tmp_path, "bcm")
    _, composed = case_overrides("training_gpt3_tiny", "bcm")
    composed += [
        f"base_results_dir={hydra_text(hostile.paths['base_results_dir'])}",
        f"training.run.name={hydra_text('run ' + HOSTILE)}",
        f"++cluster.comment={hydra_text(HOSTILE)}",
        f"++cluster.job_name_prefix={hydra_text('p ' + HOSTILE + ':')}",
        "dry_run=true",
    ]
    _, _, planned = plan(compose_config(composed))
    [job] = [job for stage in planned for job in stage.jobs]
    assert job.spec.checkpoint_exit_code is not None  # the job whose log path was the hole
    script = tmp_path / "job.sh"
    script.write_text(job.script)
    Path(job.spec.results_dir).mkdir(parents=True)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:

        def squeue(field: str) -> str:
            return subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", field], capture_output=True, text=True
            ).stdout.rstrip("\n")

        assert squeue("%j") == f"p {HOSTILE}:{job.spec.name}"
        assert squeue("%k") == HOSTILE
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True
        ).stdout
        [output] = [
            line.strip()[len("StdOut=") :] for line in shown.splitlines() if "StdOut=" in line
        ]
        assert output == f"{job.spec.results_dir}/slurm-{job.spec.name}_{job_id}.out"
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert not markers(tmp_path)
