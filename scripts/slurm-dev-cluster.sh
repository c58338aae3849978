#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (munge, slurmctld, slurmd), for the SLURM tests and CI.
#
#   scripts/slurm-dev-cluster.sh start [--owner PID]   configure and start the daemons; wait
#                                                     until the node is idle
#   scripts/slurm-dev-cluster.sh stop     cancel its jobs and stop the daemons this script started
#   scripts/slurm-dev-cluster.sh status   exit 0 when the cluster answers (prints sinfo)
#
# Everything lives under $JAXJOB_SLURM_DIR (default /tmp/jaxjob-slurm): slurm.conf, state, spool,
# pid and log files. Clients find the config only through the environment,
# SLURM_CONF=$JAXJOB_SLURM_DIR/slurm.conf (`start` prints the export line): no global path such
# as /etc/slurm/slurm.conf is written, so no `sbatch` outside that environment reaches this
# cluster. With --owner PID the cluster lives only as long as that process: a watcher stops it
# when PID ends, however it ends (the test suite passes its own pid, so a suite stopped by
# SIGTERM, Ctrl-C or SIGKILL leaves no daemon behind). Needs root and
# `apt-get install -y slurm-wlm munge` (slurm 22.05).
set -euo pipefail

DIR=${JAXJOB_SLURM_DIR:-/tmp/jaxjob-slurm}
CONF=$DIR/slurm.conf
REAPER_PID=$DIR/reaper.pid
MARK="# written by jaxjob scripts/slurm-dev-cluster.sh"
export SLURM_CONF=$CONF

say() { echo "slurm-dev-cluster: $*" >&2; }

# True when the process in pid file $1 is alive.
alive() { [[ -s $1 ]] && kill -0 "$(<"$1")" 2>/dev/null; }

node_state() { sinfo -h -N -o %t 2>/dev/null | head -n1; }

write_conf() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(nproc)
    # 90% of MemTotal: a node whose RealMemory exceeds what slurmd finds is drained.
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$CONF.new" <<EOF
$MARK
ClusterName=jaxjob-dev
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    mv "$CONF.new" "$CONF"
}

# A watcher, in a session of its own, that runs `stop` once process $1 has ended.
watch_owner() {
    local owner=$1
    kill -0 "$owner" 2>/dev/null || { say "--owner $owner is not a running process"; exit 2; }
    # tail --pid returns when the owner exits; `stop` then ends the daemons and this watcher.
    JAXJOB_SLURM_DIR=$DIR setsid bash -c 'tail --pid="$1" -f /dev/null; exec bash "$2" stop' \
        reaper "$owner" "$(realpath "$0")" </dev/null >>"$DIR/log/reaper.log" 2>&1 &
    echo $! >"$REAPER_PID"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    mkdir -p /run/munge
    chown munge:munge /run/munge
    munged --force
    touch "$DIR/munged.ours"  # stop only ends the munged that this script started
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    say "munged did not answer; see /var/log/munge/munged.log"
    exit 1
}

start() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null || {
        say "slurm is not installed: apt-get install -y slurm-wlm munge"
        exit 1
    }
    [[ $(id -u) == 0 ]] || { say "must run as root (the daemons run as root here)"; exit 1; }
    local owner=""
    if [[ ${1:-} == --owner ]]; then owner=${2:?--owner needs a pid}; fi
    mkdir -p "$DIR"
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && sinfo -h >/dev/null 2>&1; then
        say "already running; clients need: export SLURM_CONF=$CONF"
        return
    fi
    write_conf
    [[ -z $owner ]] || watch_owner "$owner"
    start_munge
    # -c: a fresh controller state, so no job of an earlier session comes back to life.
    alive "$DIR/slurmctld.pid" || slurmctld -c -f "$CONF"
    alive "$DIR/slurmd.pid" || slurmd -f "$CONF"
    local state=""
    for _ in $(seq 100); do
        state=$(node_state)
        case $state in
        idle | mix | alloc)
            say "up: node $(hostname -s) $state; clients need: export SLURM_CONF=$CONF"
            return
            ;;
        esac
        sleep 0.2
    done
    say "the node did not become idle (state '${state:-none}'); see $DIR/log/"
    exit 1
}

stop_pid() {
    local pidfile=$1 pid
    alive "$pidfile" || return 0
    pid=$(<"$pidfile")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    if alive "$DIR/slurmctld.pid"; then
        scancel --partition=debug 2>/dev/null || true  # nothing of ours keeps running
    fi
    stop_pid "$DIR/slurmd.pid"
    stop_pid "$DIR/slurmctld.pid"
    if [[ -e $DIR/munged.ours ]]; then
        stop_pid /run/munge/munged.pid
        rm -f "$DIR/munged.ours"
    fi
    # The owner's watcher, unless this is the watcher itself (its pid file names the setsid'd
    # bash, which has exec'd into this stop).
    # Its whole process group: the watcher's bash and its tail.
    if [[ -s $REAPER_PID && $(<"$REAPER_PID") != "$$" ]]; then
        kill -- -"$(<"$REAPER_PID")" 2>/dev/null || true
    fi
    rm -f "$REAPER_PID"
    say "stopped"
}

status() {
    if sinfo 2>/dev/null; then return 0; fi
    say "not running (SLURM_CONF=$CONF)"
    return 1
}

case ${1:-} in
start) start "${@:2}" ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
