#!/usr/bin/env bash
# Install (if missing) and start a real single-node Slurm on this machine, for CI and tests.
#
# Idempotent: when Slurm is already up, healthy and configured as below, it does nothing.
# Needs root and Debian (apt-get); no systemd needed: munged, slurmctld and slurmd are
# started by hand and left running.
#
#   .ci/slurm-up.sh                     # bring it up (or check that it is up)
#   SLURM_UP_TIMEOUT=120 .ci/slurm-up.sh  # seconds to wait for the node (default 60)
#   SLURM_UP_CPUS=8 .ci/slurm-up.sh       # advertise 8 CPUs whatever the machine has
#                                         # (oversubscribes; for tests needing parallel jobs)
#
# Writes /etc/slurm/slurm.conf (overwritten without backup: this is for CI machines) and
# restarts the daemons when it changes. Logs: /var/log/slurm/{slurmctld,slurmd}.log;
# finished jobs: /var/log/slurm/jobcomp.log, read by `sacct -c`.
set -euo pipefail

TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
FORCE_CPUS="${SLURM_UP_CPUS:-}"
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
PARTITION="batch"
NODE="$(hostname -s)"

log() { echo "slurm-up: $*" >&2; }
die() { echo "slurm-up: ERROR: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root"
[[ -z $FORCE_CPUS || $FORCE_CPUS =~ ^[1-9][0-9]*$ ]] || die "SLURM_UP_CPUS must be a positive integer"

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1; }
usable_state() { [[ $1 =~ ^(idle|mixed|allocated|completing|planned)$ ]]; }
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# Prints the wanted slurm.conf.
gen_conf() {
    # First line of `slurmd -C`, e.g.
    # "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    local node_line extra=""
    node_line="$(slurmd -C 2>/dev/null | head -n1)"
    [[ $node_line == NodeName=* ]] || die "unexpected 'slurmd -C' output: '$node_line'"
    if [[ -n $FORCE_CPUS ]]; then
        node_line="$(sed -E "s/\bCPUs=[0-9]+/CPUs=$FORCE_CPUS/; s/\bBoards=[0-9]+/Boards=1/;
            s/\bSocketsPerBoard=[0-9]+/SocketsPerBoard=1/; s/\bCoresPerSocket=[0-9]+/CoresPerSocket=$FORCE_CPUS/;
            s/\bThreadsPerCore=[0-9]+/ThreadsPerCore=1/" <<<"$node_line")"
        # Trust slurm.conf rather than the hardware, else the node is drained as invalid.
        extra="SlurmdParameters=config_overrides"
    fi
    cat <<EOF
# Written by .ci/slurm-up.sh: a single-node Slurm for CI and tests. Edits are overwritten.
ClusterName=ci
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Requeued jobs wait cred_expire+1 s before they may start again (default 120 s).
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
$extra

StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

# Scheduling: fast and permissive for a small test cluster. sched_interval=2: pending jobs
# whose begin time passed (e.g. requeued ones) start within ~2 s instead of up to 60 s.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Finished jobs stay visible to scontrol/squeue -t all for 5 minutes.
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
OverTimeLimit=0

# No slurmdbd: finished jobs are written to a text file that \`sacct -c\` reads.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log

$node_line State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

summary() {
    local cpus version
    cpus="$(sinfo -h -N -n "$NODE" -o %c 2>/dev/null | head -n1)"
    version="$(sinfo -V 2>/dev/null | awk '{print $2}')"
    echo "slurm-up: ready: node=$NODE cpus=${cpus:-?} partition=$PARTITION state=$(node_state) (Slurm ${version:-?})"
}

installed() {
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
        && command -v slurmd >/dev/null && command -v munged >/dev/null
}

# ---------------------------------------------------------------- fast path: nothing to do
if installed && munge_ok && pid_alive "$CTLD_PID" && pid_alive "$SLURMD_PID" \
    && [[ -f $CONF ]] && cmp -s <(gen_conf) "$CONF" \
    && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' \
    && usable_state "$(node_state)"; then
    summary
    exit 0
fi

# ---------------------------------------------------------------- install
if ! installed; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    # No init system here: keep the packages' maintainer scripts from starting services.
    added_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    apt_log="$(mktemp)"
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge; } >"$apt_log" 2>&1; then
        cat "$apt_log" >&2
        die "apt-get install failed"
    fi
    rm -f "$apt_log"
    if [[ -n $added_policy ]]; then rm -f /usr/sbin/policy-rc.d; fi
    installed || die "packages installed but sbatch/slurmctld/slurmd/munged still missing"
fi

# ---------------------------------------------------------------- munge
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

if ! munge_ok; then
    log "starting munged"
    if pid_alive /run/munge/munged.pid; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true   # alive but not answering
        sleep 1
    fi
    # A stale socket lock left by a dead munged makes it refuse to start.
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 1 50); do
        munge_ok && break
        sleep 0.2
    done
    munge_ok || die "munged does not work (see /var/log/munge/munged.log)"
fi

# ---------------------------------------------------------------- slurm.conf
install -d -m 0755 /etc/slurm "$LOGDIR" "$STATE_DIR" /var/spool/slurmd

new_conf="$(mktemp)"
trap 'rm -f "$new_conf"' EXIT
gen_conf >"$new_conf"
cpus="$(sed -n 's/^NodeName=.*\bCPUs=\([0-9]*\).*/\1/p' "$new_conf")"
if [[ -n $cpus && $cpus -lt 2 ]]; then
    log "WARNING: only CPUs=$cpus schedulable: 2-task jobs will stay pending (set SLURM_UP_CPUS=2)"
fi

restart=""
if ! cmp -s "$new_conf" "$CONF"; then
    log "writing $CONF"
    install -m 0644 "$new_conf" "$CONF"
    restart=1
fi

# ---------------------------------------------------------------- daemons
stop_daemon() { # pidfile name
    local pid
    pid_alive "$1" || return 0
    pid="$(cat "$1")"
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
}

ctld_was_running=""
if pid_alive "$CTLD_PID"; then ctld_was_running=1; fi
if [[ -n $restart ]]; then
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$CTLD_PID" slurmctld
fi
if ! pid_alive "$CTLD_PID"; then
    # Not running when this script came: whatever jobs its saved state holds belong to an
    # earlier boot (a machine image taken while tests ran). Recovered, they would hold the
    # node as "running" and new jobs would wait behind them; -c starts clean.
    clear=()
    if [[ -z $ctld_was_running ]] && compgen -G "$STATE_DIR/job_state*" >/dev/null; then
        log "slurmctld was not running: dropping the jobs its saved state holds from an earlier boot"
        clear=(-c)
    fi
    log "starting slurmctld"
    slurmctld "${clear[@]}" || die "slurmctld failed to start (see $LOGDIR/slurmctld.log)"
fi
if ! pid_alive "$SLURMD_PID"; then
    log "starting slurmd"
    slurmd || die "slurmd failed to start (see $LOGDIR/slurmd.log)"
fi

# ---------------------------------------------------------------- wait until usable
deadline=$((SECONDS + TIMEOUT))
state=""
while ((SECONDS < deadline)); do
    if timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
        state="$(node_state)"
        usable_state "$state" && break
        case "$state" in
            down* | drain* | fail*)
                log "node is $state: resuming"
                scontrol update nodename="$NODE" state=resume 2>/dev/null || true
                ;;
        esac
    fi
    sleep 1
done
usable_state "$state" \
    || die "node $NODE not usable after ${TIMEOUT}s (state '${state:-no answer from slurmctld}'); see $LOGDIR/slurmctld.log, $LOGDIR/slurmd.log and 'scontrol show node $NODE'"

left=$((deadline - SECONDS))
((left > 10)) || left=10
if ! timeout "$left" srun -N1 -n1 -p "$PARTITION" true; then
    squeue -t all >&2 || true
    die "'srun -N1 -n1 true' failed (the queue is above); see $LOGDIR/slurmctld.log and $LOGDIR/slurmd.log"
fi

summary
