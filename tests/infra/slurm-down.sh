#!/usr/bin/env bash
# slurm-down.sh — stop the cluster tests/infra/slurm-up.sh started, by its pid files only
# (never by process name: other SLURM daemons on this machine are left alone).
#   --purge   also delete the state directory (config, state, logs, munge key)
# PHALANX_SLURM_DIR: the state directory (default /tmp/phalanx-slurm), as for slurm-up.sh.
set -uo pipefail
D=${PHALANX_SLURM_DIR:-/tmp/phalanx-slurm}
export SLURM_CONF=$D/slurm.conf
log() { echo "[slurm-down] $*" >&2; }
pid_alive() { local s; s=$(sed -E 's/.*\) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1; [[ -n $s && $s != Z ]]; }
stop_pidfile() {
  local pf=$1 pid
  [[ -f $pf ]] || return 0
  pid=$(cat "$pf" 2>/dev/null)
  if [[ -n $pid ]] && pid_alive "$pid"; then
    log "stopping $(basename "$pf" .pid) (pid $pid)"
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && { log "SIGKILL $pid"; kill -9 "$pid" 2>/dev/null; }
  fi
  rm -f "$pf"
}

ctld_pid=$(cat "$D/run/slurmctld.pid" 2>/dev/null || true)
# ask slurmctld only when ours runs (no connection attempts to an address that is gone)
if [[ -n $ctld_pid ]] && pid_alive "$ctld_pid" && [[ -f $SLURM_CONF ]] && command -v scancel >/dev/null \
   && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  # this cluster's jobs only (SLURM_CONF points at it): their tasks must not outlive slurmd
  jobs=$(squeue -h -t PD,R,CG,S -o %i 2>/dev/null | sort -u)
  if [[ -n $jobs ]]; then
    log "cancelling jobs: $(echo $jobs)"
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 100); do [[ -z $(squeue -h -t PD,R,CG,S 2>/dev/null) ]] && break; sleep 0.1; done
  fi
fi
for pf in "$D"/run/slurmd-*.pid; do [[ -e $pf ]] && stop_pidfile "$pf"; done
stop_pidfile "$D/run/slurmctld.pid"
stop_pidfile "$D/munge/munged.pid"
if [[ ${1:-} == --purge ]]; then
  log "removing $D"
  rm -rf "$D"
fi
exit 0
