"""The processes of a local job: its main process and its process group, read from /proc
(a zombie counts as ended) with a signal probe where there is no /proc."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

KILL_WAIT_SECONDS = 30  # the most a kill waits for the killed processes to be gone
PROCFS = Path("/proc/self/stat").exists()


def kill_group(group: int) -> None:
    """SIGKILL to every process of the group, then wait until they are gone."""
    send(-group, signal.SIGKILL)
    # Wait for the group to be gone, so the caller finds no process of the job (a killed
    # process takes a moment to exit), but not forever: one stuck in the kernel may not.
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    while members(group) and time.monotonic() < deadline:
        time.sleep(0.05)


def send(pid: int, signum: int) -> None:
    """os.kill, where a negative pid is a process group; a process already gone is fine."""
    try:
        if pid < 0:
            os.killpg(-pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process from /proc, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (command name) "
    return fields[0], int(fields[2])


def running(pid: int) -> bool:
    """Whether the job's main process is alive: not ended, not a zombie, still leading its
    group (a pid reused by another process is not)."""
    if not PROCFS:  # (macOS): a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[1] == pid


def members(group: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    if not PROCFS:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [group]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == group and stat[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)
