#!/usr/bin/env bash
# slurm-up.sh — a private, single-machine SLURM cluster for phalanx's SLURM executor.
#
# Starts one slurmctld, several slurmd "nodes" (n1..nN, each its own slurmd on its own port)
# and its own munged, all on 127.0.0.1, without systemd and without cgroups.  Everything
# (config, state, spool, pid files, logs, munge key and socket) lives under one directory,
# so it neither reads nor touches /etc/slurm, /run/munge or a cluster someone else runs.
# Idempotent: re-running leaves a healthy cluster alone; a changed setting restarts it.
#
#   tests/infra/slurm-up.sh                 # start (or check) the cluster
#   export SLURM_CONF=/tmp/phalanx-slurm/slurm.conf
#   sinfo; srun -N2 -n2 hostname            # use it
#   tests/infra/slurm-down.sh [--purge]     # stop it (--purge: delete the directory)
#
# Settings (environment):
#   PHALANX_SLURM_DIR        state directory                          (/tmp/phalanx-slurm)
#   PHALANX_SLURM_NODES      fake nodes n1..nN, one slurmd each        (3)
#   PHALANX_SLURM_NODE_CPUS  CPUs advertised per node (may exceed the real cores) (2)
#   PHALANX_SLURM_NODE_MEM   RealMemory MB per node                    (2048)
#   PHALANX_SLURM_PORT       slurmctld port; slurmd ports follow it    (6917)
#   PHALANX_SLURM_TIMEOUT    seconds to wait for the nodes to be idle  (60)
# Across hosts (set by tests/infra/slurm-multihost-up.sh; unset: the loopback cluster above):
#   PHALANX_SLURM_NODE_HOSTS "name=addr ..." one node per host, NodeHostname=name NodeAddr=addr,
#                            every slurmd on port PORT+1 of its own address
#   PHALANX_SLURM_CTLD_HOST  SlurmctldHost value                        (localhost(127.0.0.1))
#   PHALANX_SLURM_EXEC       command prefix that runs a daemon inside a host: PREFIX HOST CMD...
#   PHALANX_SLURM_CTLD_ON    the host slurmctld runs in (through PHALANX_SLURM_EXEC)
#   PHALANX_SLURM_PREEMPT=1  also a partition "urgent" whose jobs preempt (cancel) the other
#                            partitions' jobs: SLURM's PREEMPTED state, for real (a separate
#                            cluster: tests/test_slurm_preemption.py starts its own)
# Partitions: "debug" (default, all nodes) and "small" (MaxNodes=1, MaxTime=5): a job that
# asks "small" for 2 nodes is accepted and stays PENDING (PartitionNodeLimit) — the tests use
# it for SLURM's "can never start" reasons.
# Needs the packages from scripts/setup-slurm.sh (run here when missing and we are root).
set -euo pipefail

D=${PHALANX_SLURM_DIR:-/tmp/phalanx-slurm}
NNODES=${PHALANX_SLURM_NODES:-3}
NCPUS=${PHALANX_SLURM_NODE_CPUS:-2}
NMEM=${PHALANX_SLURM_NODE_MEM:-2048}
PORT=${PHALANX_SLURM_PORT:-6917}
UP_TIMEOUT=${PHALANX_SLURM_TIMEOUT:-60}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ME=$(id -un)
CONF=$D/slurm.conf
CTLD_HOST=${PHALANX_SLURM_CTLD_HOST:-localhost(127.0.0.1)}
read -r -a HOSTS <<<"${PHALANX_SLURM_NODE_HOSTS:-}"  # name=addr ...
if [[ ${#HOSTS[@]} -gt 0 ]]; then
  NODES=("${HOSTS[@]%%=*}"); NNODES=${#NODES[@]}
else
  NODES=(); for i in $(seq 1 "$NNODES"); do NODES+=("n$i"); done
fi
# a daemon's command line inside host $1 (as is without PHALANX_SLURM_EXEC)
in_host() { local h=$1; shift; if [[ -n ${PHALANX_SLURM_EXEC:-} && -n $h ]]; then $PHALANX_SLURM_EXEC "$h" "$@"; else "$@"; fi; }
export SLURM_CONF=$CONF
t_start=$(date +%s.%N)
log() { echo "[slurm-up] $*" >&2; }
# alive unless gone or a zombie (PID 1 here may reap orphaned daemons late, and a zombie
# still passes kill -0)
pid_alive() { local s; s=$(sed -E 's/.*\) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1; [[ -n $s && $s != Z ]]; }
alive() { [[ -s $1 ]] && pid_alive "$(cat "$1")"; }
stop_pidfile() {  # stop a daemon this script started, by its own pid file (never by name)
  local pf=$1 pid
  if alive "$pf"; then
    pid=$(cat "$pf"); kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pf"
}

# ---------------------------------------------------------------- 1. packages
for b in slurmctld slurmd srun sbatch squeue scancel munge unmunge; do
  if ! command -v "$b" >/dev/null 2>&1; then
    if [[ $(id -u) == 0 && -x $HERE/../../scripts/setup-slurm.sh ]]; then
      "$HERE/../../scripts/setup-slurm.sh"; break
    fi
    log "'$b' is missing: run scripts/setup-slurm.sh as root (Debian: slurm-wlm munge)"; exit 2
  fi
done
MUNGED=$(command -v munged || echo /usr/sbin/munged)

# ---------------------------------------------------------------- 2. directories, munge
install -d -m 0755 "$D" "$D/run" "$D/log" "$D/ctld"
for n in "${NODES[@]}"; do install -d -m 0755 "$D/spool/$n"; done
if [[ $(id -u) == 0 ]] && id munge >/dev/null 2>&1; then MUSER=munge; else MUSER=$ME; fi
# munged refuses group/world-writable directories on the way to its socket and key
install -d -o "$MUSER" -m 0755 "$D/munge"
if [[ ! -s $D/munge/munge.key ]]; then
  log "creating a munge key for this cluster"
  (umask 077; dd if=/dev/urandom bs=1 count=1024 of="$D/munge/munge.key" status=none)
  chown "$MUSER" "$D/munge/munge.key"; chmod 0400 "$D/munge/munge.key"
fi
MSOCK=$D/munge/munge.socket
munge_ok() { munge -S "$MSOCK" -n 2>/dev/null | unmunge -S "$MSOCK" >/dev/null 2>&1; }
if ! munge_ok; then
  log "starting munged (socket $MSOCK)"
  stop_pidfile "$D/munge/munged.pid"
  rm -f "$MSOCK" "$MSOCK.lock"
  margs=(--socket="$MSOCK" --key-file="$D/munge/munge.key" --pid-file="$D/munge/munged.pid"
         --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed")
  if [[ $MUSER != "$ME" ]]; then
    runuser -u "$MUSER" -- "$MUNGED" "${margs[@]}" </dev/null >/dev/null 2>&1
  else
    "$MUNGED" "${margs[@]}" </dev/null >/dev/null 2>&1
  fi
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || { log "munged did not start: $(tail -3 "$D/munge/munged.log" 2>/dev/null)"; exit 1; }
fi

# ---------------------------------------------------------------- 3. slurm.conf
nodes="n[1-${NNODES}]"; ports="[$((PORT+1))-$((PORT+NNODES))]"
[[ $NNODES == 1 ]] && { nodes=n1; ports=$((PORT+1)); }
if [[ ${#HOSTS[@]} -gt 0 ]]; then
  what="${NNODES} nodes, one slurmd in each host (${HOSTS[*]})"; bindto="its host's address"
  nodelines=$(for h in "${HOSTS[@]}"; do
    echo "NodeName=${h%%=*} NodeHostname=${h%%=*} NodeAddr=${h#*=} Port=$((PORT+1)) CPUs=${NCPUS} RealMemory=${NMEM} State=UNKNOWN"
  done)
else
  what="${NNODES} fake nodes on 127.0.0.1"; bindto=127.0.0.1
  nodelines="NodeName=${nodes} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${ports} CPUs=${NCPUS} RealMemory=${NMEM} State=UNKNOWN"
fi
preemption=""
if [[ ${PHALANX_SLURM_PREEMPT:-} == 1 ]]; then
  preemption="PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10"
fi
newconf=$(mktemp)
cat >"$newconf" <<EOF
# generated by phalanx tests/infra/slurm-up.sh: ${what}, no cgroups
ClusterName=phalanx
SlurmctldHost=${CTLD_HOST}
SlurmctldPort=${PORT}
SlurmUser=${ME}
SlurmdUser=${ME}
AuthType=auth/munge
CredType=cred/munge
# this cluster's own munged, not /run/munge
AuthInfo=socket=${MSOCK}
# bind slurmctld, slurmd and srun's listeners to ${bindto} instead of 0.0.0.0
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=${D}/ctld
SlurmdSpoolDir=${D}/spool/%n
SlurmctldPidFile=${D}/run/slurmctld.pid
SlurmdPidFile=${D}/run/slurmd-%n.pid
SlurmctldLogFile=${D}/log/slurmctld.log
SlurmdLogFile=${D}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# finished jobs for 'sacct -c' (no slurmdbd needed)
JobCompType=jobcomp/filetxt
JobCompLoc=${D}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
ReturnToService=2
# several slurmd on one host advertising more CPUs than it has
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
# finished jobs stay visible to squeue/scontrol for 5 minutes (the executor reads their state)
MinJobAge=300
KillWait=2
Waittime=0
${nodelines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=small Nodes=ALL MaxNodes=1 MaxTime=5 State=UP
${preemption}
EOF
if ! cmp -s "$newconf" "$CONF"; then
  [[ -f $CONF ]] && log "settings changed: restarting the daemons"
  for pf in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid"; do [[ -e $pf ]] && stop_pidfile "$pf"; done
  install -m 0644 "$newconf" "$CONF"
fi
rm -f "$newconf"

# ---------------------------------------------------------------- 4. daemons
if ! alive "$D/run/slurmctld.pid"; then
  log "starting slurmctld on ${CTLD_HOST}:${PORT}"
  in_host "${PHALANX_SLURM_CTLD_ON:-}" slurmctld -i -f "$CONF" </dev/null >>"$D/log/start.log" 2>&1  # -i: ignore stale state
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
scontrol ping 2>/dev/null | grep -q 'is UP' || { log "slurmctld is not up:"; tail -5 "$D/log/slurmctld.log" >&2; exit 1; }
for i in $(seq 1 "$NNODES"); do
  n=${NODES[$((i-1))]}
  if ! alive "$D/run/slurmd-$n.pid"; then
    if [[ ${#HOSTS[@]} -gt 0 ]]; then
      log "starting slurmd $n in host $n on ${HOSTS[$((i-1))]#*=}:$((PORT+1))"
      in_host "$n" slurmd -f "$CONF" -N "$n" </dev/null >>"$D/log/start.log" 2>&1
    else
      log "starting slurmd $n on 127.0.0.1:$((PORT+i))"
      slurmd -f "$CONF" -N "$n" </dev/null >>"$D/log/start.log" 2>&1
    fi
  fi
done

# ---------------------------------------------------------------- 5. wait for idle nodes
deadline=$(( $(date +%s) + UP_TIMEOUT ))
while :; do
  states=$(sinfo -h -N -p debug -o '%N %T' 2>/dev/null || true)
  nup=$(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$states" || true)
  [[ $nup -ge $NNODES ]] && break
  while read -r n st; do  # nodes an unclean stop left DOWN or DRAINED
    case $st in down*|drain*|fail*) scontrol update NodeName="$n" State=RESUME 2>/dev/null || true;; esac
  done <<<"$states"
  if (( $(date +%s) > deadline )); then log "nodes not ready:"; echo "$states" >&2; exit 1; fi
  sleep 0.2
done
log "cluster up in $(awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
sinfo
cat <<EOF

Use it:   export SLURM_CONF=$CONF
          ${PHALANX_SLURM_SRUN:-srun} -N2 -n2 bash -c 'echo \$SLURM_PROCID \$SLURMD_NODENAME'
phalanx:  phalanx run workflows/<workflow>.yaml --site site-configs/slurm-local.yaml
Stop it:  ${PHALANX_SLURM_DOWN:-$HERE/slurm-down.sh}            (--purge also deletes $D)
EOF
