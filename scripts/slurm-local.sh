#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying and testing dtrain under srun/sbatch.
#
#   scripts/slurm-local.sh start   # munged, slurmctld and slurmd; waits until the node is idle
#   export SLURM_CONF=/tmp/dtrain-slurm/slurm.conf   # (start prints it) then srun, sbatch, sinfo
#   scripts/slurm-local.sh stop    # stops the daemons and removes the folder
#
# Needs root and `make install-launchers` (Debian's slurm-wlm and munge). Everything lives
# in $DTRAIN_SLURM_DIR (default /tmp/dtrain-slurm): the config, a munge key of its own, the
# state, the logs. The daemons listen on ports $DTRAIN_SLURMCTLD_PORT and
# $DTRAIN_SLURMD_PORT (default 16817 and 16818). The node is this host at 127.0.0.1 with
# max(2, cores) CPUs (more than the cores is allowed), processes tracked through /proc (no
# cgroups), no accounting.
set -euo pipefail

DIR=${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}
CTLD_PORT=${DTRAIN_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${DTRAIN_SLURMD_PORT:-16818}
NODE=$(hostname -s)
CPUS=$(nproc)
if ((CPUS < 2)); then CPUS=2; fi

die() { echo "slurm-local: $*" >&2; exit 1; }

stop_pidfile() {  # stop the process a pid file names, waiting up to 10 s
    local file=$1 pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

stop() {
    [[ -e $DIR ]] || return 0
    grep -qs '^ClusterName=dtrain-local$' "$DIR/slurm.conf" || [[ -z $(ls -A "$DIR") ]] ||
        die "$DIR holds no cluster of this script: not removing it"
    stop_pidfile "$DIR/slurmd.pid"
    stop_pidfile "$DIR/slurmctld.pid"
    stop_pidfile "$DIR/munge/munged.pid"
    rm -rf "$DIR"
}

write_config() {
    cat >"$DIR/slurm.conf" <<EOF
ClusterName=dtrain-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    [[ $(id -u) == 0 ]] || die "run as root (slurmd starts jobs as their user)"
    for tool in munged mungekey slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || die "$tool not found: make install-launchers"
    done
    stop  # a cluster left by an earlier start
    mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool"
    chmod 700 "$DIR" "$DIR/munge"
    mungekey --create --keyfile="$DIR/munge/munge.key"
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    write_config
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld || die "slurmctld did not start: see $DIR/slurmctld.log"
    slurmd || die "slurmd did not start: see $DIR/slurmd.log"
    for _ in $(seq 60); do
        if [[ $(sinfo -h -N -o %t 2>/dev/null) == idle ]]; then
            echo "export SLURM_CONF=$DIR/slurm.conf"
            return 0
        fi
        sleep 0.5
    done
    sinfo -N -l >&2 || true
    die "the node is not idle after 30 s: see $DIR/slurmctld.log and $DIR/slurmd.log"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop" ;;
esac
