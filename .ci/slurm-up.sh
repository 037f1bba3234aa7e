#!/usr/bin/env bash
# Brings up a one-node SLURM cluster on this machine for the SLURM submission test (tests/launch/test_slurm.py):
# installs Debian's slurm-wlm and munge when missing, writes a slurm.conf for this host (its real CPU count and
# memory, no cgroups), creates a munge key and starts munged, slurmctld and slurmd by hand (no systemd), then
# waits until `sinfo` shows the node idle. Idempotent: a cluster that is already up is left alone.
# Exit 0 when the node is up, 1 otherwise (the caller decides whether that is fatal).
set -uo pipefail

log() { echo "slurm-up: $*" >&2; }

node_up() { sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

if command -v sinfo >/dev/null 2>&1 && node_up; then
    log "already up"; exit 0
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "slurm-wlm/munge missing and cannot be installed here (need root and apt-get)"; exit 1
    fi
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null || {
        log "apt-get install slurm-wlm munge failed"; exit 1; }
fi

host=$(hostname -s)
cpus=$(nproc --all)
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
conf_dir=/etc/slurm
state=/var/spool/arbor-slurm
mkdir -p "$conf_dir" "$state/ctld" "$state/d" /var/log/slurm /run/munge /var/lib/munge /var/log/munge /etc/munge

cat > "$conf_dir/slurm.conf" <<CONF
# Written by arbor's .ci/slurm-up.sh: a one-node cluster for tests.
ClusterName=arbor-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
# Debian's packages look in /etc/slurm; older ones in /etc/slurm-llnl.
[ -d /etc/slurm-llnl ] && cp "$conf_dir/slurm.conf" /etc/slurm-llnl/slurm.conf

if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key

if ! pgrep -x munged >/dev/null; then
    # munged refuses to run as root unless forced; run it as its own user when that user exists.
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || { log "munged failed to start"; exit 1; }
    else
        /usr/sbin/munged --force || { log "munged failed to start"; exit 1; }
    fi
fi
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld || { log "slurmctld failed; see /var/log/slurm/slurmctld.log"; exit 1; }
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd || { log "slurmd failed; see /var/log/slurm/slurmd.log"; exit 1; }

for _ in $(seq 60); do
    if node_up; then log "node $host is up ($cpus CPUs, ${mem_mb} MB)"; exit 0; fi
    # A node that registered as down (e.g. after an unclean restart) is brought back once.
    scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
    sleep 1
done
log "node $host did not become idle; sinfo says: $(sinfo -h -N 2>&1 | head -1)"
exit 1
