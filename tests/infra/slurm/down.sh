#!/usr/bin/env bash
# Stop the single-machine SLURM test cluster started by up.sh: cancel all
# jobs, stop slurmd/slurmctld/munged and wait until they are gone.
# Safe to run when nothing is running. Needs root.
set -euo pipefail

RUN_DIR=/run/slurm
TERM_WAIT=${FLOWREDUCE_SLURM_STOP_SECS:-15}

log() { echo "[slurm-down] $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    echo "down.sh must run as root" >&2
    exit 1
fi

alive() {  # alive PID -> 0 if running; a zombie counts as stopped
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || return 1
    [[ -n $st && $st != Z* ]]
}

# pids of one daemon: the pidfiles it wrote plus processes with that exact name
pids_of() {  # pids_of NAME [PIDFILE...]
    local name=$1 f p
    shift
    {
        for f in "$@"; do
            [[ -s $f ]] && p=$(<"$f") && [[ $p =~ ^[0-9]+$ ]] && echo "$p"
        done
        pgrep -x "$name" 2>/dev/null || true
    } | sort -un | while read -r p; do alive "$p" && echo "$p"; done
}

stop() {  # stop NAME PIDFILE...: SIGTERM, wait, then SIGKILL
    local name=$1 pids p left
    pids=$(pids_of "$@")
    if [[ -z $pids ]]; then
        return 0
    fi
    log "stopping $name ($(echo $pids))"
    kill $pids 2>/dev/null || true
    for ((i = 0; i < TERM_WAIT * 10; i++)); do
        left=""
        for p in $pids; do alive "$p" && left+=" $p"; done
        [[ -z $left ]] && break
        sleep 0.1
    done
    if [[ -n $left ]]; then
        log "$name did not stop, killing:$left"
        kill -9 $left 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            left=""
            for p in $pids; do alive "$p" && left+=" $p"; done
            [[ -z $left ]] && break
            sleep 0.1
        done
        if [[ -n $left ]]; then
            log "ERROR: $name still running:$left"
            return 1
        fi
    fi
}

# 1. cancel every job while the controller still runs
if command -v squeue >/dev/null 2>&1 && [[ -n $(pids_of slurmctld "$RUN_DIR/slurmctld.pid") ]]; then
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        log "cancelling jobs: $(echo $jobs)"
        timeout 10 scancel $jobs 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null || true) ]] && break
            sleep 0.1
        done
    fi
fi

# 2. daemons: compute nodes, job step daemons, controller, munge
rc=0
stop slurmd "$RUN_DIR"/slurmd-*.pid || rc=1
stop slurmstepd || rc=1
stop slurmctld "$RUN_DIR/slurmctld.pid" || rc=1
stop munged /run/munge/munged.pid || rc=1
rm -f "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmctld.pid" /run/munge/munged.pid

if ((rc)); then
    echo "slurm down: FAILED, some daemons still running" >&2
    exit 1
fi
echo "slurm down: no slurmctld/slurmd/slurmstepd/munged running"
