"""Kubernetes (`cluster_type=k8s`): Indexed Jobs applied with kubectl, one after the other.

Each JobSpec renders to a manifest (launcher_scripts/clusters/k8s_manifest.py says what is in
it and why). Kubernetes has no dependencies between Jobs, so this backend is synchronous like
the local and BCP ones: `kubectl apply -f <manifest>`, then it polls `kubectl get job -o json`
until the Job's Complete or Failed condition, streaming its pods' logs (`kubectl logs -f
--prefix`, every pod of the Job by its job-name label) into the job's log file and the
terminal. A failed Job stops the pipeline with its first failing pod's exit code.

The launcher writes each stage's config into base_results_dir, which the pods read through
their volume: the machine running the launcher must see the same storage at the same paths.

Job names are fixed by the run's configuration, so a rerun applies a Job of the same name: a
finished one left from before (until ttl_seconds_after_finished) is deleted first; a running one
is never touched (the submission stops and says how to cancel it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher_scripts.clusters.base import (
    BackendDefaults,
    JobLog,
    JobRecord,
    refuse_companions,
    utc_now,
)
from launcher_scripts.clusters.k8s_manifest import (
    CONTAINER,
    JOB_NAME_LABEL,
    is_multi_node,
    k8s_name,
    manifests,
    pod_count,
    render_manifest,
)
from launcher_scripts.clusters.k8s_settings import K8sSettings, settings_from
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.jobspec import JobSpec

KUBECTL_TIMEOUT = 120  # seconds for one API call, as for sbatch
LOG_DRAIN_SECONDS = 60  # how long the log stream may run on after its Job ended
API_RETRIES = 10  # failed `kubectl get job` calls in a row that a wait rides out
STREAM_LAG_POLLS = 3  # polls a Job may take to finish after its log stream ended
# Waiting reasons of a pod's container worth telling the user while the Job seems to hang.
STUCK_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)


@dataclass(frozen=True)
class JobRef:
    """A submitted Job, as the manifest records it: `namespace/name` (the Service, when there
    is one, has the Job's name)."""

    namespace: str
    name: str

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def parse(cls, job_id: str) -> JobRef:
        namespace, _, name = job_id.partition("/")
        return cls(namespace, name)

    def selector(self) -> str:
        return f"{JOB_NAME_LABEL}={self.name}"


def kubectl(*args: str) -> subprocess.CompletedProcess:
    """One kubectl call; LauncherError when it cannot be made or does not answer."""
    try:
        return subprocess.run(
            ["kubectl", *args], capture_output=True, text=True, timeout=KUBECTL_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        raise LauncherError(
            f"kubectl {args[0]} did not answer within {KUBECTL_TIMEOUT} s: is the API server up?"
        ) from None
    except OSError as error:
        raise LauncherError(f"kubectl could not be run: {error}") from None


def get_job(ref: JobRef) -> dict[str, Any] | None:
    """The Job object, or None when there is none of that name."""
    result = kubectl(
        "get", "job", ref.name, f"--namespace={ref.namespace}", "--ignore-not-found", "-o", "json"
    )
    if result.returncode != 0:
        raise LauncherError(f"kubectl get job {ref.id} failed: {result.stderr.strip()}")
    return json.loads(result.stdout) if result.stdout.strip() else None


def get_pods(ref: JobRef) -> list[dict[str, Any]]:
    try:
        result = kubectl(
            "get",
            "pods",
            f"--namespace={ref.namespace}",
            f"--selector={ref.selector()}",
            "-o",
            "json",
        )
    except LauncherError:
        return []
    if result.returncode != 0:
        return []  # only used for exit codes and hints; the Job's state comes from get_job
    return json.loads(result.stdout).get("items", [])


def job_state(job: dict[str, Any]) -> str:
    """The launcher's state of a Job object: its terminal condition, else whether pods run."""
    for condition in job.get("status", {}).get("conditions") or ():
        if condition.get("status") == "True":
            if condition.get("type") == "Complete":
                return "COMPLETED"
            if condition.get("type") == "Failed":
                return "FAILED"
    return "RUNNING" if job.get("status", {}).get("active") else "PENDING"


def failure_reason(job: dict[str, Any]) -> str:
    for condition in job.get("status", {}).get("conditions") or ():
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
    return ""


def pod_exit_code(pods: Sequence[dict[str, Any]]) -> int | None:
    """The first failing pod's exit code (by completion index), else 0 when any pod ended."""
    codes: list[tuple[int, int]] = []
    for pod in pods:
        index = (
            pod.get("metadata", {})
            .get("annotations", {})
            .get("batch.kubernetes.io/job-completion-index", "0")
        )
        for status in pod.get("status", {}).get("containerStatuses") or ():
            terminated = status.get("state", {}).get("terminated")
            if status.get("name") == CONTAINER and terminated is not None:
                codes.append((int(index), int(terminated.get("exitCode", 0))))
    failing = [code for _, code in sorted(codes) if code != 0]
    if failing:
        return failing[0]
    return 0 if codes else None


def stuck_pods(pods: Sequence[dict[str, Any]]) -> list[str]:
    """One line per pod that cannot start or be placed: what to tell the user."""
    lines = []
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status", {})
        for condition in status.get("conditions") or ():
            if condition.get("type") == "PodScheduled" and condition.get("reason") == (
                "Unschedulable"
            ):
                lines.append(f"pod {name}: Unschedulable: {condition.get('message', '')}")
        for container in status.get("containerStatuses") or ():
            waiting = container.get("state", {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                lines.append(f"pod {name}: {waiting['reason']}: {waiting.get('message', '')}")
    return lines


class K8sBackend(BackendDefaults):
    name = "k8s"
    synchronous = True
    script_suffix = "_manifest.yaml"

    def __init__(self, root: Any = None) -> None:
        """`root` is the resolved config; status, logs and cancel need none."""
        self.root = root
        self.settings: K8sSettings | None = settings_from(root) if root is not None else None

    def jobs_use_launcher_environment(self) -> bool:
        return False  # every pod runs an image

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        refuse_companions(jobs, self.name)

    # ----- rendering ---------------------------------------------------------------------

    def render(self, job: JobSpec) -> str:
        settings = self._settings()
        _validate_schemas(job, settings)
        return render_manifest(job, settings)

    def log_path(self, job: JobSpec, run_id: str) -> str:
        return str(Path(job.results_dir) / f"log-{job.name}_{run_id}.out")

    def _settings(self) -> K8sSettings:
        if self.settings is None:
            raise LauncherError("the k8s backend renders only with a configuration (a bug)")
        return self.settings

    # ----- checks before submitting ------------------------------------------------------

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        if shutil.which("kubectl") is None:
            raise ConfigError(
                "cluster_type",
                "is k8s but kubectl is not on PATH",
                "Install kubectl and point it at the cluster (KUBECONFIG), or use dry_run=true "
                "to render the manifests",
            )

    # ----- submission --------------------------------------------------------------------

    def submit(
        self,
        script: str,
        job: JobSpec,
        record: JobRecord,
        after: Sequence[str],
        on_start: Callable[[JobRecord], None],
    ) -> None:
        """Apply the manifest, then wait for the Job, teeing its pods' logs into the log."""
        settings = self._settings()
        ref = JobRef(settings.namespace, k8s_name(job.name))
        with open(record.log, "ab") as log:
            out = _Tee(log)
            self._remove_finished(ref, out)
            applied = kubectl("apply", "-f", script)
            if applied.returncode != 0:
                raise LauncherError(
                    f"kubectl apply failed for {job.name}: {applied.stderr.strip()}"
                )
            out.line(applied.stdout.strip())
            record.job_ids = [ref.id]
            record.checkpoint_exit_code = job.checkpoint_exit_code
            record.grace_seconds = settings.signal_grace_seconds
            record.state = "PENDING"
            record.start = utc_now()
            on_start(record)
            try:
                _Watch(ref, pod_count(job), settings.poll_seconds, out).run(record)
            except KeyboardInterrupt:
                self.cancel(record)
                record.state, record.exit_code = "CANCELLED", 130
        record.end = utc_now()
        if is_multi_node(job) and record.state in ("COMPLETED", "FAILED"):
            # The Job stays (for kubectl describe) until its TTL; its Service is of no more use.
            kubectl(
                "delete",
                f"service/{ref.name}",
                f"--namespace={ref.namespace}",
                "--ignore-not-found",
            )

    def _remove_finished(self, ref: JobRef, out: _Tee) -> None:
        """A Job of this name left by an earlier run: deleted when it has ended."""
        existing = get_job(ref)
        if existing is None:
            return
        if job_state(existing) not in ("COMPLETED", "FAILED"):
            raise LauncherError(
                f"Job {ref.name} is already running in namespace {ref.namespace} (an earlier run "
                f"of this configuration?): cancel it with `kubectl delete job {ref.name} -n "
                f"{ref.namespace}`, or give this run another run.name"
            )
        out.line(f"launcher: deleting the finished Job {ref.id} of an earlier run")
        # Foreground: its pods are gone before new ones take their hostnames.
        deleted = kubectl(
            "delete",
            f"job/{ref.name}",
            f"service/{ref.name}",
            f"--namespace={ref.namespace}",
            "--ignore-not-found",
            "--cascade=foreground",
            "--wait=true",
        )
        if deleted.returncode != 0:
            raise LauncherError(f"kubectl delete job {ref.id} failed: {deleted.stderr.strip()}")

    # ----- status, cancel, logs ----------------------------------------------------------

    def refresh(self, record: JobRecord) -> None:
        if record.state in ("COMPLETED", "FAILED", "CANCELLED") or not record.job_ids:
            return  # a finished Job may be gone (its TTL); the record already says how it ended
        if shutil.which("kubectl") is None:
            return
        try:
            job = get_job(JobRef.parse(record.job_ids[0]))
        except LauncherError:
            return  # the API server is unreachable now: the record says what was known
        if job is not None:
            record.state = job_state(job)
        elif record.state in ("PENDING", "RUNNING"):
            # Gone before it finished (deleted, or its namespace was): nothing says how it ended.
            record.state = "LOST"

    def cancel(self, record: JobRecord) -> int | None:
        """Delete the Job: Kubernetes sends its pods' programs SIGTERM and kills them after
        their terminationGracePeriodSeconds (cluster.signal_grace_seconds for a checkpointing
        job), so there is nothing to wait for here."""
        self.end(record)
        return None

    def stopped(self, record: JobRecord) -> bool:
        return True  # Kubernetes enforces the grace period itself

    def end(self, record: JobRecord) -> None:
        if not record.job_ids:
            return
        ref = JobRef.parse(record.job_ids[0])
        kubectl(
            "delete",
            f"job/{ref.name}",
            f"service/{ref.name}",
            f"--namespace={ref.namespace}",
            "--ignore-not-found",
        )

    def logs(self, record: JobRecord) -> list[JobLog]:
        log = Path(record.log)
        return [JobLog(log)] if log.exists() else []


class _Tee:
    """Bytes to the terminal and the job's log, as they come."""

    def __init__(self, log: IO[bytes]) -> None:
        self.log = log
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            self.log.write(data)
            self.log.flush()

    def line(self, text: str) -> None:
        if text:
            self.write(f"{text}\n".encode())


class _Watch:
    """Polls one Job to its end, streaming its pods' logs once they have started."""

    def __init__(self, ref: JobRef, pods: int, poll_seconds: float, out: _Tee) -> None:
        self.ref, self.pods, self.poll_seconds, self.out = ref, pods, poll_seconds, out
        self.stream: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.told: set[str] = set()
        self.idle_polls = 0

    def run(self, record: JobRecord) -> None:
        try:
            while True:
                job = self._get_job()
                if job is None:  # deleted from outside: `launcher_scripts cancel`, say
                    self.out.line(f"launcher: Job {self.ref.id} was deleted")
                    record.state, record.exit_code = "LOST", None
                    return
                state = job_state(job)
                if state in ("COMPLETED", "FAILED"):
                    break
                record.state = state
                if self.stream is None and self._all_started(job):
                    self._start_logs(follow=True)
                elif self.stream is not None and self.stream.poll() is not None:
                    # Polls after the stream ended with the Job still not finished: a few are
                    # the controller catching up with pods that have just ended.
                    self.idle_polls += 1
                    if self.idle_polls == STREAM_LAG_POLLS:
                        self._tell(
                            "the log stream ended before the Job; follow it with `kubectl "
                            f"logs -f -l {self.ref.selector()} -n {self.ref.namespace}`"
                        )
                self._tell_stuck()
                time.sleep(self.poll_seconds)
            if self.stream is None:
                self._start_logs(follow=False)
            self._finish_logs()
            code = pod_exit_code(get_pods(self.ref))
            if state == "FAILED":
                reason = failure_reason(job)
                self.out.line(f"launcher: Job {self.ref.id} failed: {reason}")
                code = code or 1  # e.g. DeadlineExceeded with its pods gone
            record.state, record.exit_code = state, code if code is not None else 0
        finally:
            if self.stream is not None and self.stream.poll() is None:
                self.stream.terminate()
                self.stream.wait()
            if self.reader is not None:
                self.reader.join()  # its last bytes reach the log before the log is closed

    def _get_job(self) -> dict[str, Any] | None:
        """The Job, riding out a few failed calls (an API server restarting, say)."""
        failures = 0
        while True:
            try:
                return get_job(self.ref)
            except LauncherError as error:
                failures += 1
                if failures > API_RETRIES:
                    raise LauncherError(
                        f"kubectl could not reach the API server {failures} times in a row while "
                        f"waiting for Job {self.ref.id} (it may still be running): {error}"
                    ) from None
                self.out.line(f"launcher: {error}; trying again")
                time.sleep(self.poll_seconds)

    def _all_started(self, job: dict[str, Any]) -> bool:
        """Every pod is running or done: `kubectl logs -f` fails on a pod still starting."""
        status = job.get("status", {})
        started = sum(int(status.get(key) or 0) for key in ("ready", "succeeded", "failed"))
        return started >= self.pods

    def _start_logs(self, follow: bool) -> None:
        argv = [
            "kubectl",
            "logs",
            f"--namespace={self.ref.namespace}",
            f"--selector={self.ref.selector()}",
            "--prefix",
            "--tail=-1",
            f"--max-log-requests={max(self.pods, 1)}",
        ]
        if follow:
            argv.append("--follow")
        self.stream = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._copy, args=(self.stream,), daemon=True)
        self.reader.start()

    def _copy(self, stream: subprocess.Popen) -> None:
        assert stream.stdout is not None
        while chunk := os.read(stream.stdout.fileno(), 65536):
            self.out.write(chunk)

    def _finish_logs(self) -> None:
        assert self.stream is not None and self.reader is not None
        try:
            self.stream.wait(timeout=LOG_DRAIN_SECONDS)
        except subprocess.TimeoutExpired:
            self.stream.terminate()
            self.stream.wait()
        self.reader.join()

    def _tell_stuck(self) -> None:
        for line in stuck_pods(get_pods(self.ref)):
            self._tell(line)

    def _tell(self, line: str) -> None:
        """Say it once."""
        if line not in self.told:
            self.told.add(line)
            self.out.line(f"launcher: {line}")


def _validate_schemas(job: JobSpec, settings: K8sSettings) -> None:
    """Check the objects against the Kubernetes OpenAPI schemas of cluster.k8s_version when
    kubernetes-validate is installed (a dev dependency; the tests always check)."""
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import VersionNotSupportedError
    except ImportError:
        return
    for obj in manifests(job, settings):
        try:
            kubernetes_validate.validate(obj, settings.k8s_version, strict=True)
        except (VersionNotSupportedError, kubernetes_validate.SchemaNotFoundError):
            return  # a Kubernetes release newer than this validator knows: nothing to check with
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in error.path) or "(top)"
            raise ConfigError(
                "cluster",
                f"the {obj['kind']} of job {job.name} is not valid Kubernetes "
                f"{settings.k8s_version} at {where}: {error.message}",
                "Fix the cluster key that sets it (tolerations, node_selector, labels, ...)",
            ) from None
