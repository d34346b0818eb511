#!/usr/bin/env bash
# A one-node Slurm on this machine, for the `slurm` tests and for trying a sweep by hand.
#
#   scripts/local_slurm.sh start    # install (apt-get) when missing, configure, start; waits until idle
#   scripts/local_slurm.sh status   # exit 0 when the partition answers, else 1
#   scripts/local_slurm.sh stop     # kill exactly the daemons `start` launched
#
# Needs root (apt-get, munge's key, slurmd runs jobs as their submitter). No systemd: munged,
# slurmctld and slurmd run as plain background processes whose PIDs are kept under $KVBENCH_SLURM_DIR
# (default /tmp/kvbench-slurm), together with their logs, spool folders and the generated slurm.conf.
# Accounting is off (no slurmdbd), as on many small clusters, so `sacct` fails by design.
set -euo pipefail

STATE_DIR=${KVBENCH_SLURM_DIR:-/tmp/kvbench-slurm}
PARTITION=${KVBENCH_SLURM_PARTITION:-cpu}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
DAEMONS=(munged slurmctld slurmd)

say() { echo "local_slurm: $*" >&2; }

alive() {  # alive NAME: its recorded PID is a running process
    local pidfile=$STATE_DIR/$1.pid
    [[ -s $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sinfo >/dev/null; then
        return
    fi
    [[ $(id -u) == 0 ]] || { say "slurm-wlm and munge are missing and installing them needs root"; exit 1; }
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # The packages' init scripts must not start the services: this script starts the daemons itself.
    local policy=/usr/sbin/policy-rc.d ours=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        ours=1
    fi
    apt-get update -qq >/dev/null || true
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    [[ $ours == 0 ]] || rm -f "$policy"
}

write_conf() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(nproc)
    # Leave a quarter of the memory to the operating system and the sweep's own process.
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 3 / 4)}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$STATE_DIR"/{ctld,d,log}
    cat >"$CONF" <<EOF
# Written by kvbench scripts/local_slurm.sh: a one-node test cluster, no accounting.
ClusterName=kvbench
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$STATE_DIR/slurmctld.daemon.pid
SlurmdPidFile=$STATE_DIR/slurmd.daemon.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# A cancelled, preempted or requeued job gets SIGTERM, then SIGKILL this many seconds later.
KillWait=2
# Requeue: jobs may be requeued (scontrol requeue, node failure) and preemption requeues them.
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Finished jobs stay visible to squeue/scontrol for this long: without accounting it is the only record.
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
# A job that names no memory gets its share per CPU, not the whole node.
DefMemPerCPU=$((mem_mb / cpus))
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP PriorityTier=1
# Same node, higher tier: a job here preempts (requeues) jobs of the $PARTITION partition.
PartitionName=urgent Nodes=$host Default=NO MaxTime=INFINITE State=UP PriorityTier=10
EOF
    # slurmd loads a cgroup plugin even with proctrack/linuxproc; let it pick the host's version.
    echo "CgroupPlugin=autodetect" >"$CONF_DIR/cgroup.conf"
}

start_munge() {
    if alive munged; then return; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    # munged runs as root here, so root must own its key and folders.
    chown -R root:root /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    # --foreground keeps the recorded PID the daemon's own; --force tolerates a stale socket.
    setsid munged --foreground --force >"$STATE_DIR/log/munged.log" 2>&1 </dev/null &
    echo $! >"$STATE_DIR/munged.pid"
    for _ in $(seq 50); do
        munge -n </dev/null >/dev/null 2>&1 && return
        sleep 0.1
    done
    say "munged did not come up: see $STATE_DIR/log/munged.log"
    exit 1
}

start_daemon() {  # start_daemon NAME ARGS...: a slurm daemon in the foreground (-D) of its own session
    local name=$1
    shift
    if alive "$name"; then return; fi
    setsid "$name" -D "$@" >"$STATE_DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$STATE_DIR/$name.pid"
}

cluster_up() {
    sinfo -h -p "$PARTITION" -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated|completing)'
}

start() {
    install_packages
    if alive munged && alive slurmctld && alive slurmd && cluster_up; then
        say "already running (partition $PARTITION)"
        return
    fi
    mkdir -p "$STATE_DIR"/log
    write_conf
    start_munge
    # -i: ignore state saved by an earlier cluster (its jobs belong to a finished test session).
    start_daemon slurmctld -i
    start_daemon slurmd
    for _ in $(seq 150); do
        if cluster_up; then
            # A node left down by an earlier unclean stop comes back here.
            scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
            say "up: partition $PARTITION, $(nproc) CPUs, state in $STATE_DIR"
            return
        fi
        for d in "${DAEMONS[@]}"; do
            alive "$d" || { say "$d exited: see $STATE_DIR/log/"; tail -n 5 "$STATE_DIR/log/$d".* >&2 || true; stop; exit 1; }
        done
        sleep 0.2
    done
    say "the partition did not become idle in 30 s: see $STATE_DIR/log/"
    stop
    exit 1
}

stop() {
    local d pid
    # Reverse order: slurmd first, munged last (the others authenticate through it while exiting).
    for d in slurmd slurmctld munged; do
        [[ -s $STATE_DIR/$d.pid ]] || continue
        pid=$(cat "$STATE_DIR/$d.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$STATE_DIR/$d.pid"
    done
    say "stopped"
}

status() {
    local d ok=0
    for d in "${DAEMONS[@]}"; do
        if alive "$d"; then echo "$d: running (pid $(cat "$STATE_DIR/$d.pid"))"; else echo "$d: stopped"; ok=1; fi
    done
    if cluster_up; then sinfo -p "$PARTITION"; else echo "partition $PARTITION: not answering"; ok=1; fi
    return $ok
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
