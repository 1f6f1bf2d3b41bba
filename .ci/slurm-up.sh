#!/usr/bin/env bash
# Install (if missing) and start a real Slurm on this machine, for CI and tests: this machine as
# the node of partition "batch" (the default), and N more nodes n1..nN in partition "multi",
# each a slurmd in its own network namespace (a veth on the bridge slurmbr0, address
# 10.77.0.1<i>, its own hostname through a UTS namespace), sharing the filesystem and munge.
#
# Idempotent: when Slurm is already up, healthy and configured as below, it does nothing.
# Needs root and Debian (apt-get); no systemd needed: munged, slurmctld and the slurmds are
# started by hand and left running.
#
#   .ci/slurm-up.sh                     # bring it up (or check that it is up)
#   SLURM_UP_TIMEOUT=120 .ci/slurm-up.sh  # seconds to wait for the nodes (default 60)
#   SLURM_UP_CPUS=8 .ci/slurm-up.sh       # advertise 8 CPUs per node whatever the machine has
#                                         # (oversubscribes; for tests needing parallel jobs)
#   SLURM_UP_NODES=0 .ci/slurm-up.sh      # no namespace nodes (default 3, at most 9)
#
# Writes /etc/slurm/slurm.conf (overwritten without backup: this is for CI machines) and
# restarts the daemons when it changes; keeps a marked block of /etc/hosts naming n1..nN.
# Logs: /var/log/slurm/slurmctld.log, /var/log/slurm/slurmd-<node>.log; finished jobs:
# /var/log/slurm/jobcomp.log, read by `sacct -c`.
set -euo pipefail

TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
FORCE_CPUS="${SLURM_UP_CPUS:-}"
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
NODES="${SLURM_UP_NODES:-3}"
CTLD_PID=/run/slurmctld.pid
PARTITION="batch"
MULTI_PARTITION="multi"
NODE="$(hostname -s)"
BRIDGE=slurmbr0
NET=10.77.0          # the bridge is .1, node n<i> is .1<i>
CTLD_ADDR="$NET.1"   # where every node reaches slurmctld (127.0.0.1 is each namespace's own)

log() { echo "slurm-up: $*" >&2; }
die() { echo "slurm-up: ERROR: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root"
[[ -z $FORCE_CPUS || $FORCE_CPUS =~ ^[1-9][0-9]*$ ]] || die "SLURM_UP_CPUS must be a positive integer"

[[ $NODES =~ ^[0-9]$ ]] || die "SLURM_UP_NODES must be a number of nodes from 0 to 9"

MULTI_NODES=()
for ((i = 1; i <= NODES; i++)); do MULTI_NODES+=("n$i"); done
ALL_NODES=("$NODE" "${MULTI_NODES[@]}")

slurmd_pid() { echo "/run/slurmd-$1.pid"; }
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_state() { sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n1; }
usable_state() { [[ $1 =~ ^(idle|mixed|allocated|completing|planned)$ ]]; }
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
all_slurmds_alive() {
    local node
    for node in "${ALL_NODES[@]}"; do pid_alive "$(slurmd_pid "$node")" || return 1; done
}
all_nodes_usable() {
    local node
    for node in "${ALL_NODES[@]}"; do usable_state "$(node_state "$node")" || return 1; done
}

# The namespace nodes' network: a bridge on this machine and one namespace per node.
network_up() {
    local i ns hosts
    ((NODES > 0)) || return 0
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$CTLD_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= NODES; i++)); do
        ns="slurm-n$i"
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            ip link del "veth-n$i" 2>/dev/null || true # an end whose namespace was deleted
            ip link add "veth-n$i" type veth peer name eth0 netns "$ns"
        fi
        ip link set "veth-n$i" master "$BRIDGE"
        ip link set "veth-n$i" up
        # A test that shapes a link (a tbf qdisc) and is killed before it undoes that would
        # leave the node slow for every later run on this machine: links start unshaped.
        tc qdisc del dev "veth-n$i" root 2>/dev/null || true
        ip -n "$ns" addr replace "$NET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route replace default via "$CTLD_ADDR"
    done
    # Every node's name resolves everywhere (a job's MASTER_ADDR is a node name).
    hosts="$(sed '/# slurm-up nodes begin/,/# slurm-up nodes end/d' /etc/hosts)"
    {
        echo "$hosts"
        echo "# slurm-up nodes begin"
        # torch's c10d looks its peers up by their IPv4-mapped IPv6 address: named here too,
        # else each lookup waits 10 s for a DNS server that a namespace cannot reach.
        echo "$CTLD_ADDR slurm-bridge"
        echo "::ffff:$CTLD_ADDR slurm-bridge"
        for ((i = 1; i <= NODES; i++)); do
            echo "$NET.1$i n$i"
            echo "::ffff:$NET.1$i n$i"
        done
        echo "# slurm-up nodes end"
    } >/etc/hosts.slurm-up
    cat /etc/hosts.slurm-up >/etc/hosts # in place: /etc/hosts may be a bind mount
    rm -f /etc/hosts.slurm-up
}

start_slurmd() { # node
    if [[ $1 == "$NODE" ]]; then
        slurmd || die "slurmd failed to start (see $LOGDIR/slurmd-$1.log)"
    else
        # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup from slurmd.
        nsenter --net="/run/netns/slurm-$1" unshare --uts sh -c "hostname $1 && exec slurmd -N $1" \
            || die "slurmd of node $1 failed to start (see $LOGDIR/slurmd-$1.log)"
    fi
}

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
    local ctld_host="$NODE" multi=""
    if ((NODES > 0)); then
        ctld_host="$NODE($CTLD_ADDR)"
        multi="$(sed -E "s/^NodeName=[^ ]+/NodeName=n[1-$NODES] NodeAddr=$NET.1[1-$NODES]/" <<<"$node_line") State=UNKNOWN
PartitionName=$MULTI_PARTITION Nodes=n[1-$NODES] MaxTime=INFINITE State=UP"
    fi
    cat <<EOF
# Written by .ci/slurm-up.sh: a Slurm for CI and tests. Edits are overwritten.
ClusterName=ci
SlurmctldHost=$ctld_host
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
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$(slurmd_pid %n)
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
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
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
$multi
EOF
}

summary() {
    local cpus version multi=""
    cpus="$(sinfo -h -N -n "$NODE" -o %c 2>/dev/null | head -n1)"
    version="$(sinfo -V 2>/dev/null | awk '{print $2}')"
    if ((NODES > 0)); then multi=", nodes=n[1-$NODES] partition=$MULTI_PARTITION"; fi
    echo "slurm-up: ready: node=$NODE cpus=${cpus:-?} partition=$PARTITION$multi (Slurm ${version:-?})"
}

installed() {
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
        && command -v slurmd >/dev/null && command -v munged >/dev/null
}

# ---------------------------------------------------------------- the namespace nodes' network
network_up # idempotent, so also after a change to this script's network or hosts

# ---------------------------------------------------------------- fast path: nothing else to do
if installed && munge_ok && pid_alive "$CTLD_PID" && all_slurmds_alive \
    && [[ -f $CONF ]] && cmp -s <(gen_conf) "$CONF" \
    && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' \
    && all_nodes_usable; then
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
cpus="$(sed -n 's/^NodeName=.*\bCPUs=\([0-9]*\).*/\1/p' "$new_conf" | head -n1)"
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
    for node in "${ALL_NODES[@]}"; do stop_daemon "$(slurmd_pid "$node")" "slurmd of $node"; done
    stop_daemon /run/slurmd.pid slurmd # where slurm-up.sh kept it before the namespace nodes
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
for node in "${ALL_NODES[@]}"; do
    if ! pid_alive "$(slurmd_pid "$node")"; then
        log "starting slurmd of $node"
        start_slurmd "$node"
    fi
done

# ---------------------------------------------------------------- wait until usable
deadline=$((SECONDS + TIMEOUT))
while ((SECONDS < deadline)); do
    if timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
        all_nodes_usable && break
        for node in "${ALL_NODES[@]}"; do
            state="$(node_state "$node")"
            case "$state" in
                down* | drain* | fail*)
                    log "node $node is $state: resuming"
                    scontrol update nodename="$node" state=resume 2>/dev/null || true
                    ;;
            esac
        done
    fi
    sleep 1
done
for node in "${ALL_NODES[@]}"; do
    state="$(node_state "$node")"
    usable_state "$state" \
        || die "node $node not usable after ${TIMEOUT}s (state '${state:-no answer from slurmctld}'); see $LOGDIR/slurmctld.log, $LOGDIR/slurmd-$node.log and 'scontrol show node $node'"
done

left=$((deadline - SECONDS))
((left > 10)) || left=10
if ! timeout "$left" srun -N1 -n1 -p "$PARTITION" true; then
    squeue -t all >&2 || true
    die "'srun -N1 -n1 true' failed (the queue is above); see $LOGDIR/slurmctld.log and $LOGDIR/slurmd-$NODE.log"
fi
if ((NODES > 0)) && ! timeout "$left" srun -N"$NODES" -p "$MULTI_PARTITION" true; then
    squeue -t all >&2 || true
    die "'srun -N$NODES -p $MULTI_PARTITION true' failed (the queue is above); see $LOGDIR/slurmd-n<i>.log"
fi

summary
