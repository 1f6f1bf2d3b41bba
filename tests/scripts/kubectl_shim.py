"""A stand-in for kubectl, for tests: every "pod" of an Indexed Job is a process of this machine.

It implements only what the k8s backend calls: `apply -f`, `get job|pods -o json`, `logs` and
`delete` (which, as a kubelet would, gives each pod's process SIGTERM and its grace period before
SIGKILL). `apply` checks each object against the Kubernetes OpenAPI schema in strict mode (what
an API server would refuse) and starts a "kubelet" process that runs each pod's container
command with the pod's declared environment, expanding `$(VAR)` references as Kubernetes does
(the fieldRef of the completion-index annotation gives the pod's index). There is no cluster
DNS: a MASTER_ADDR naming pod 0 of the Job through a Service that selects its pods (the pod
template's subdomain) is rewritten to 127.0.0.1, and MASTER_PORT to a free port; any other
address is left as it is and fails to resolve. Images, volumes, resources, scheduling and
backoff retries are not emulated (the pods see this machine's files and Python; backoffLimit is
taken as 0: the first failing pod fails the Job and its other pods are killed).

$KUBECTL_SHIM_FAILED_GETS=N makes the first N `get job` calls for an existing Job fail, as when
the API server is unreachable.

State lives under $KUBECTL_SHIM_STATE: calls.jsonl (each call's arguments), services/, and one
folder per Job with its object, each pod's log and exit code, and its kubelet's pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from launcher_scripts.ports import free_port

STATE = Path(os.environ["KUBECTL_SHIM_STATE"])
VERSION = os.environ.get("KUBECTL_SHIM_K8S_VERSION", "1.30")
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
POLL = 0.05  # seconds between looks at the pods' processes and logs


def main(argv: list[str]) -> int:
    if argv[:1] == ["__kubelet"]:
        return kubelet(Path(argv[1]))
    STATE.mkdir(parents=True, exist_ok=True)
    with (STATE / "calls.jsonl").open("a") as calls:
        calls.write(json.dumps(argv) + "\n")
    words, flags = parse(argv)
    verb = words[0] if words else ""
    namespace = flags.get("namespace", flags.get("n", "default"))
    if verb == "apply":
        return apply(Path(flags["f"]))
    if verb == "get" and words[1:2] == ["job"]:
        if job_dir(namespace, words[2]).exists() and api_down():
            print("The connection to the server was refused", file=sys.stderr)
            return 1
        return get_job(namespace, words[2], "ignore-not-found" in flags)
    if verb == "get" and words[1:2] == ["pods"]:
        return get_pods(namespace, job_of_selector(flags["selector"]))
    if verb == "logs":
        return logs(namespace, flags)
    if verb == "delete":
        return delete(namespace, words[1:], "ignore-not-found" in flags)
    print(f"kubectl shim: unsupported call {argv}", file=sys.stderr)
    return 2


def api_down() -> bool:
    """Whether this call fails as if the API server were unreachable: the first
    $KUBECTL_SHIM_FAILED_GETS calls asking for an existing Job do."""
    wanted = int(os.environ.get("KUBECTL_SHIM_FAILED_GETS", "0"))
    counter = STATE / "failed_gets"
    failed = int(counter.read_text()) if counter.exists() else 0
    if failed >= wanted:
        return False
    counter.write_text(str(failed + 1))
    return True


def parse(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words and flags (`--name=value`, `--name value`, `-f file`, `--switch`)."""
    switches = {"prefix", "follow", "ignore-not-found"}
    words: list[str] = []
    flags: dict[str, str] = {}
    position = 0
    while position < len(argv):
        arg = argv[position]
        if arg.startswith("-"):
            name, sep, value = arg.lstrip("-").partition("=")
            if not sep and name not in switches:
                position += 1
                value = argv[position]
            flags[name] = value
        else:
            words.append(arg)
        position += 1
    return words, flags


def job_dir(namespace: str, name: str) -> Path:
    return STATE / "jobs" / namespace / name


def job_of_selector(selector: str) -> str:
    label, _, value = selector.partition("=")
    assert label == JOB_NAME_LABEL, f"kubectl shim: selects only by {JOB_NAME_LABEL}"
    return value


# ----- apply -------------------------------------------------------------------------------


def apply(path: Path) -> int:
    objects = [obj for obj in yaml.safe_load_all(path.read_text()) if obj is not None]
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            print(
                f'Error from server (BadRequest): error when creating "{path}": '
                f"{obj.get('kind')}: {error.message}",
                file=sys.stderr,
            )
            return 1
    for obj in objects:
        namespace = obj["metadata"].get("namespace", "default")
        name = obj["metadata"]["name"]
        if obj["kind"] == "Service":
            target = STATE / "services" / namespace / f"{name}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(obj))
            print(f"service/{name} created")
        elif obj["kind"] == "Job":
            folder = job_dir(namespace, name)
            if folder.exists():
                same = json.loads((folder / "job.json").read_text()) == obj
                if not same:
                    print(
                        f'The Job "{name}" is invalid: spec.template: field is immutable',
                        file=sys.stderr,
                    )
                    return 1
                print(f"job.batch/{name} unchanged")
                continue
            assert obj["spec"].get("completionMode") == "Indexed", "the shim runs Indexed Jobs"
            folder.mkdir(parents=True)
            (folder / "job.json").write_text(json.dumps(obj))
            kubelet_process = subprocess.Popen(
                [sys.executable, __file__, "__kubelet", str(folder)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=(folder / "kubelet.err").open("wb"),
                start_new_session=True,  # its own process group: delete kills it and its pods
            )
            (folder / "kubelet.pid").write_text(str(kubelet_process.pid))
            print(f"job.batch/{name} created")
        else:
            print(f"kubectl shim: cannot apply a {obj['kind']}", file=sys.stderr)
            return 1
    return 0


# ----- the pods ----------------------------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: `$$` is a literal `$`, `$(NAME)` a declared variable's
    value (left as it is when undeclared), any other `$` itself."""
    out: list[str] = []
    position = 0
    while position < len(text):
        char = text[position]
        if char != "$" or position + 1 == len(text):
            out.append(char)
            position += 1
            continue
        following = text[position + 1]
        if following == "$":
            out.append("$")
            position += 2
        elif following == "(" and (close := text.find(")", position + 2)) != -1:
            name = text[position + 2 : close]
            out.append(env.get(name, f"$({name})"))
            position = close + 1
        else:
            out.append(char + following)
            position += 2
    return "".join(out)


def pod_env(job: dict[str, Any], index: int, port: int) -> dict[str, str]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    values: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            field = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == INDEX_FIELD, f"kubectl shim: no fieldRef {field}"
            values[entry["name"]] = str(index)
        else:
            values[entry["name"]] = expand(entry.get("value", ""), values)
    if values.get("MASTER_ADDR") == pod_zero_name(job):
        values["MASTER_ADDR"] = "127.0.0.1"  # no cluster DNS: pod 0 is this machine
        values["MASTER_PORT"] = str(port)  # and a free port of it
    return values


def pod_zero_name(job: dict[str, Any]) -> str | None:
    """`<job>-0.<service>`, when a Service of the namespace selects this Job's pods and is
    their subdomain: the name cluster DNS would give pod 0."""
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    subdomain = job["spec"]["template"]["spec"].get("subdomain")
    service = STATE / "services" / namespace / f"{subdomain}.json"
    if not subdomain or not service.exists():
        return None
    selector = json.loads(service.read_text())["spec"].get("selector", {})
    return f"{name}-0.{subdomain}" if selector == {JOB_NAME_LABEL: name} else None


def kubelet(folder: Path) -> int:
    """Run every pod of the Job to its end; the first failure fails the Job."""
    job = json.loads((folder / "job.json").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    processes: dict[int, subprocess.Popen] = {}
    for index in range(job["spec"]["completions"]):
        env = pod_env(job, index, port)
        argv = [expand(arg, env) for arg in container["command"] + container.get("args", [])]
        with (folder / f"pod-{index}.log").open("wb") as log:
            processes[index] = subprocess.Popen(
                argv,
                cwd=container.get("workingDir"),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        (folder / f"pod-{index}.pid").write_text(str(processes[index].pid))
        (folder / f"pod-{index}.started").touch()
    failed = False
    while processes:
        for index, process in list(processes.items()):
            code = process.poll()
            if code is None:
                continue
            code = 128 - code if code < 0 else code  # a signal, as a container reports it
            (folder / f"pod-{index}.exit").write_text(str(code))
            del processes[index]
            if code != 0 and not failed:
                failed = True
                for other in processes.values():
                    other.terminate()
        time.sleep(POLL)
    (folder / "condition").write_text("Failed" if failed else "Complete")
    return 0


# ----- get -----------------------------------------------------------------------------------


def pod_states(folder: Path) -> list[tuple[int, int | None]]:
    """(index, exit code or None while running) of each started pod."""
    states = []
    for started in sorted(folder.glob("pod-*.started")):
        index = int(started.name.split("-")[1].split(".")[0])
        exit_file = folder / f"pod-{index}.exit"
        states.append((index, int(exit_file.read_text()) if exit_file.exists() else None))
    return sorted(states)


def get_job(namespace: str, name: str, ignore_not_found: bool) -> int:
    folder = job_dir(namespace, name)
    if not folder.exists():
        if ignore_not_found:
            return 0
        print(f'Error from server (NotFound): jobs.batch "{name}" not found', file=sys.stderr)
        return 1
    job = json.loads((folder / "job.json").read_text())
    states = pod_states(folder)
    running = sum(1 for _, code in states if code is None)
    status: dict[str, Any] = {
        "active": running,
        "ready": running,
        "succeeded": sum(1 for _, code in states if code == 0),
        "failed": sum(1 for _, code in states if code not in (None, 0)),
    }
    condition = folder / "condition"
    if condition.exists():
        kind = condition.read_text()
        reason = "BackoffLimitExceeded" if kind == "Failed" else "CompletionsReached"
        status["conditions"] = [{"type": kind, "status": "True", "reason": reason}]
    print(json.dumps({**job, "status": status}))
    return 0


def get_pods(namespace: str, name: str) -> int:
    folder = job_dir(namespace, name)
    items = []
    for index, code in pod_states(folder) if folder.exists() else []:
        state = {"running": {}} if code is None else {"terminated": {"exitCode": code}}
        items.append(
            {
                "metadata": {
                    "name": f"{name}-{index}-shim",
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                    "labels": {JOB_NAME_LABEL: name},
                },
                "status": {"containerStatuses": [{"name": "main", "state": state}]},
            }
        )
    print(json.dumps({"kind": "List", "items": items}))
    return 0


# ----- logs and delete -------------------------------------------------------------------------


def logs(namespace: str, flags: dict[str, str]) -> int:
    name = job_of_selector(flags["selector"])
    folder = job_dir(namespace, name)
    job = json.loads((folder / "job.json").read_text()) if folder.exists() else None
    pods = list(range(job["spec"]["completions"])) if job else []
    if not pods:
        print(f"No resources found in {namespace} namespace.", file=sys.stderr)
        return 0
    follow = "follow" in flags
    limit = int(flags.get("max-log-requests", 5))
    if follow and len(pods) > limit:
        print(
            f"error: you are attempting to follow {len(pods)} log streams, but maximum "
            f"allowed concurrency is {limit}, use --max-log-requests to increase the limit",
            file=sys.stderr,
        )
        return 1
    for index in pods:
        if not (folder / f"pod-{index}.started").exists():
            print(
                f'error: container "main" in pod "{name}-{index}-shim" is waiting to start: '
                "ContainerCreating",
                file=sys.stderr,
            )
            return 1
    tail = int(flags.get("tail", 10))  # kubectl's default with a selector: the last 10 lines
    prefix = "prefix" in flags
    offsets = dict.fromkeys(pods, 0)
    while True:
        done = all((folder / f"pod-{index}.exit").exists() for index in pods)
        for index in pods:
            data = (folder / f"pod-{index}.log").read_bytes()[offsets[index] :]
            complete = data if done else data[: data.rfind(b"\n") + 1]
            offsets[index] += len(complete)
            lines = complete.decode(errors="replace").splitlines()
            if not follow and tail >= 0:
                lines = lines[-tail:] if tail else []
            for line in lines:
                print(f"[pod/{name}-{index}-shim/main] {line}" if prefix else line, flush=True)
        if done or not follow:
            return 0
        time.sleep(POLL)


def _group_runs(group: int) -> bool:
    """Whether a process of this process group is alive and not a zombie."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        state, _parent, process_group = text[text.rfind(")") + 2 :].split()[:3]
        if int(process_group) == group and state not in ("Z", "X"):
            return True
    return False


# What kubectl calls each kind when it deletes one, and when it finds none.
KINDS = {"job": ("job.batch", "jobs.batch"), "service": ("service", "services")}


def terminate_pods(folder: Path) -> None:
    """What the kubelet does to a deleted Job's pods: SIGTERM to each container's process 1
    (here: the process of the container command), then SIGKILL once the pod's
    terminationGracePeriodSeconds (Kubernetes' default: 30) have passed. Unlike kubectl's
    delete, the shim's waits for it."""
    pod_spec = json.loads((folder / "job.json").read_text())["spec"]["template"]["spec"]
    deadline = time.monotonic() + pod_spec.get("terminationGracePeriodSeconds", 30)
    running = [
        int(path.read_text())
        for path in folder.glob("pod-*.pid")
        if not path.with_suffix(".exit").exists()
    ]
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    while running and time.monotonic() < deadline:
        running = [pid for pid in running if alive(pid)]
        time.sleep(POLL)


def alive(pid: int) -> bool:
    """Running, not a zombie its kubelet has yet to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def delete(namespace: str, targets: list[str], ignore_not_found: bool) -> int:
    for target in targets:
        kind, _, name = target.partition("/")
        if kind == "job":
            folder = job_dir(namespace, name)
            found = folder.exists()
            if found:
                terminate_pods(folder)
                # The kubelet and every pod (they may all have ended). Wait until they are gone:
                # a kubelet killed mid-step could still write a file into the folder.
                group = int((folder / "kubelet.pid").read_text())
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
                # Until none of them runs. Not until the group is gone: its zombies may never be
                # reaped here (no init reaps in a container), and they write nothing. A fixed
                # wait was too short on a busy machine.
                while _group_runs(group):
                    time.sleep(0.01)
                shutil.rmtree(folder)
        elif kind == "service":
            path = STATE / "services" / namespace / f"{name}.json"
            found = path.exists()
            path.unlink(missing_ok=True)
        else:
            print(f"kubectl shim: cannot delete {target}", file=sys.stderr)
            return 1
        singular, plural = KINDS[kind]
        if found:
            print(f'{singular} "{name}" deleted')
        elif not ignore_not_found:
            print(f'Error from server (NotFound): {plural} "{name}" not found', file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
