#!/usr/bin/env bash
# A one-node SLURM on this machine, for the `slurm` tests: bash .ci/slurm.sh install | start | stop | status
#
#   install  Debian's packages: slurmctld slurmd slurm-client munge (apt-get; root or sudo)
#   start    munged, slurmctld and slurmd on the loopback: this host, its CPUs, one partition `debug`, no GPUs,
#            no accounting database; waits until sinfo shows the node idle
#   stop     stops the three daemons this script started (by their pid files) and leaves nothing running
#
# The config goes to /etc/slurm/slurm.conf, where sbatch, squeue and scontrol look, so a job is submitted as a user
# types it; a slurm.conf this script did not write is never overwritten. State and logs: $PAPERLAB_SLURM_DIR
# (default /tmp/paperlab-slurm). In a container without cgroup control, processes are tracked by /proc
# (proctrack/linuxproc) and tasks are not bound (task/none): nothing is confined, which the tests do not need.
set -euo pipefail

STATE=${PAPERLAB_SLURM_DIR:-/tmp/paperlab-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by paperlab .ci/slurm.sh"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

die() { echo "slurm.sh: $*" >&2; exit 1; }

PACKAGES="slurmctld slurmd slurm-client munge"

do_install() {
  command -v apt-get >/dev/null || die "no apt-get: install $PACKAGES with your package manager"
  local apt="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -y -q"
  $apt install $PACKAGES >/dev/null || { $apt update >/dev/null && $apt install $PACKAGES >/dev/null; }
}

write_conf() {
  local host cpus
  host=$(hostname -s)
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script: not touching a real cluster's config"
  fi
  $SUDO mkdir -p "$(dirname "$CONF")" "$STATE"/{ctld,spool,log}
  $SUDO chmod 0755 "$STATE"  # munged refuses a pid file in a group- or world-writable dir
  $SUDO tee "$CONF" >/dev/null <<EOF
$MARK (one node, for tests)
ClusterName=paperlab
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire + 1 s (default 120 s; 10 s keeps the preemption test short)
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# no cgroups (a container may not grant them): processes tracked through /proc, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no slurmdbd: sacct answers "accounting storage is disabled" (submitit warns, README: SLURM paragraph)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# schedule every second (defaults 60 s and 30 s): a requeued job starts as soon as it may
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

do_start() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null ||
    die "SLURM is not installed: bash .ci/slurm.sh install"
  write_conf
  if ! munge -n >/dev/null 2>&1; then  # no munged answering yet: ours (stop stops only ours)
    $SUDO install -d -o munge -g munge -m 0755 /run/munge "$STATE/munge"
    $SUDO runuser -u munge -- munged --pid-file="$STATE/munge/munged.pid"
  fi
  [ -f "$STATE/slurmctld.pid" ] && $SUDO kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null || $SUDO slurmctld -c
  [ -f "$STATE/slurmd.pid" ] && $SUDO kill -0 "$(cat "$STATE/slurmd.pid")" 2>/dev/null || $SUDO slurmd -c
  for _ in $(seq 60); do
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
    [ "$state" = idle ] && { echo "slurm up: $(sinfo -h -N -o '%N %c CPUs, partition %P, %t')"; return 0; }
    sleep 0.5
  done
  echo "--- slurmctld.log" >&2; tail -20 "$STATE/log/slurmctld.log" >&2 || true
  echo "--- slurmd.log" >&2; tail -20 "$STATE/log/slurmd.log" >&2 || true
  die "the node did not become idle in 30 s (sinfo: ${state:-no answer})"
}

stop_pid() {  # $1: pid file; waits until the process is gone
  local pid
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  if $SUDO kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do $SUDO kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  $SUDO rm -f "$1"
}

do_stop() {
  if [ -f "$STATE/slurmctld.pid" ] && jobs=$(squeue -h -o %A 2>/dev/null) && [ -n "$jobs" ]; then
    scancel $jobs || true  # no job outlives the cluster
    for _ in $(seq 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  stop_pid "$STATE/slurmd.pid"
  stop_pid "$STATE/slurmctld.pid"
  stop_pid "$STATE/munge/munged.pid"
  echo "slurm stopped"
}

case "${1:-}" in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  status) sinfo -N -l ;;
  *) die "usage: bash .ci/slurm.sh install | start | stop | status" ;;
esac
