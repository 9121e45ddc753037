#!/usr/bin/env bash
# Start a real single-machine SLURM cluster (4 virtual nodes n[1-4]) for the
# flowreduce test suite. Idempotent: safe to run any number of times.
# Needs root. No systemd: daemons are started directly, in the background.
set -euo pipefail

NODES=(n1 n2 n3 n4)
NODE_CPUS=${FLOWREDUCE_SLURM_NODE_CPUS:-2}
NODE_MEM_MB=${FLOWREDUCE_SLURM_NODE_MEM_MB:-8000}
BASE_PORT=17101
CTLD_PORT=6817
WAIT_SECS=${FLOWREDUCE_SLURM_WAIT_SECS:-60}

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_BASE=/var/spool/slurmd

log() { echo "[slurm-up] $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    echo "up.sh must run as root" >&2
    exit 1
fi

start_ts=$(date +%s)

# ---------------------------------------------------------------- install
pkg_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}

need=()
for p in slurm-wlm munge; do
    pkg_installed "$p" || need+=("$p")
done
if ((${#need[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    have_candidate=1
    for p in "${need[@]}"; do
        cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
        if [[ -z $cand || $cand == "(none)" ]]; then
            have_candidate=0
        fi
    done
    if ((have_candidate == 0)); then
        log "no apt candidate for ${need[*]}: running apt-get update"
        apt-get -o DPkg::Lock::Timeout=600 update -q
    fi
    log "installing ${need[*]}"
    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# ---------------------------------------------------------------- munge
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
chown munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating munge key"
    if command -v mungekey >/dev/null 2>&1; then
        rm -f /etc/munge/munge.key
        mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

pid_alive() {  # pid_alive PIDFILE -> 0 if that process runs (zombies count as dead)
    local f=$1 pid st
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    st=$(ps -o stat= -p "$pid" 2>/dev/null | tr -d ' ') || return 1
    [[ -n $st && $st != Z* ]]
}

if pgrep -x munged >/dev/null 2>&1 && munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running"
else
    log "starting munged"
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n </dev/null | unmunge >/dev/null
fi

# ---------------------------------------------------------------- slurm.conf
HOST=$(hostname -s)
mkdir -p "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$STATE_DIR"
for n in "${NODES[@]}"; do mkdir -p "$SPOOL_BASE/$n"; done

tmpconf=$(mktemp)
trap 'rm -f "$tmpconf"' EXIT
{
    cat <<CONF
# Written by flowreduce tests/infra/slurm/up.sh -- single-machine test cluster.
ClusterName=flowreduce
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_BASE}/%n
SlurmctldPidFile=${RUN_DIR}/slurmctld.pid
SlurmdPidFile=${RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=5
KillWait=5
Waittime=0
CONF
    i=0
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((BASE_PORT + i)) CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
        i=$((i + 1))
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
} >"$tmpconf"

conf_changed=0
if ! cmp -s "$tmpconf" "$CONF"; then
    conf_changed=1
    log "writing $CONF"
    install -m 0644 "$tmpconf" "$CONF"
fi

# ---------------------------------------------------------------- daemons
stop_pidfile() {  # stop_pidfile FILE: stop the daemon recorded there (if alive)
    local f=$1 pid
    pid_alive "$f" || { rm -f "$f"; return 0; }
    pid=$(<"$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do pid_alive "$f" || break; sleep 0.1; done
    pid_alive "$f" && kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
}

if ((conf_changed)); then
    # a running cluster with another config must be restarted to pick it up
    for n in "${NODES[@]}"; do stop_pidfile "$RUN_DIR/slurmd-$n.pid"; done
    stop_pidfile "$RUN_DIR/slurmctld.pid"
fi

if pid_alive "$RUN_DIR/slurmctld.pid"; then
    log "slurmctld already running"
else
    log "starting slurmctld"
    /usr/sbin/slurmctld -i
fi
for n in "${NODES[@]}"; do
    if pid_alive "$RUN_DIR/slurmd-$n.pid"; then
        log "slurmd $n already running"
    else
        log "starting slurmd $n"
        /usr/sbin/slurmd -N "$n"
    fi
done

# ---------------------------------------------------------------- wait
idle_count() {
    sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated" {c++} END {print c+0}'
}
deadline=$((SECONDS + WAIT_SECS))
resumed=0
while :; do
    ready=$(idle_count)
    ((ready >= ${#NODES[@]})) && break
    if ((SECONDS >= deadline)); then
        log "timeout: only $ready/${#NODES[@]} nodes ready after ${WAIT_SECS}s"
        sinfo -N -l >&2 || true
        log "logs: $LOG_DIR"
        exit 1
    fi
    # nodes left down/drained by an earlier run: put them back in service
    if ((resumed == 0)) && sinfo -h -N -o '%T' 2>/dev/null | grep -Eq '^(down|drain|drained|draining)'; then
        scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
        resumed=1
    fi
    sleep 0.5
done

echo "slurm up: cluster flowreduce, ${#NODES[@]} nodes ready ($(sinfo -h -o '%P %a %D %T' | tr '\n' ' ' | sed 's/ $//')), $(($(date +%s) - start_ts))s"
