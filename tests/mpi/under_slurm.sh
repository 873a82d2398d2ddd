#!/bin/bash
# The MPI backend under Slurm's srun (direct launch, no mpirun): starts a
# private single-node Slurm (munged, slurmctld, slurmd) in a temporary
# directory, runs the MPI tests and the ptdist example (mpi_ptdist) under
# srun, and stops it all again.
#
#   under_slurm.sh MPI_TESTS MPI_PTDIST CHECK_OUTPUT_PY
#
# Nothing outside the temporary directory is read or written: its own
# slurm.conf (SLURM_CONF), munge key and socket (AuthInfo=socket=), spool,
# state, logs, pid files and free TCP ports, so a system Slurm, another run
# of this script or a leftover daemon cannot clash with it. Root only (the
# daemons run as root). Exits 77 (skipped) without root, without srun,
# slurmctld, slurmd or munged (Debian: slurmd slurmctld), or without a
# cgroup file system (slurmd needs one). Every wait is
# bounded; on exit (however it comes) every process it started is killed
# and the directory removed. DCOMM_SRUN_MPI picks srun's --mpi (default
# pmix: Debian's Open MPI; MPICH needs pmi2), DCOMM_SRUN_TIMEOUT each srun's
# limit in seconds (default 60).
set -u

if [ $# -ne 3 ]; then
  echo "usage: $0 MPI_TESTS MPI_PTDIST CHECK_OUTPUT_PY" >&2
  exit 2
fi
mpi_tests=$1 mpi_ptdist=$2 check_output=$3
mpi=${DCOMM_SRUN_MPI:-pmix}

# The daemons are in /usr/sbin, which a user's PATH may lack.
PATH=$PATH:/usr/sbin:/sbin
for tool in srun sinfo scancel slurmctld slurmd munged python3; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "skipped: $tool not found (Debian: apt-get install slurmd slurmctld)"
    exit 77
  fi
done
if [ "$(id -u)" -ne 0 ]; then
  echo "skipped: a private Slurm needs root (its daemons run as root)"
  exit 77
fi
# Debian 12's slurmd (Slurm 22.05) will not start without a cgroup file
# system, whatever its proctrack and task plugins: a chroot that binds
# /sys without its submounts has none. A machine or container has one.
if ! mountpoint -q /sys/fs/cgroup; then
  echo "skipped: slurmd needs a cgroup file system at /sys/fs/cgroup, and none is mounted"
  exit 77
fi

dir=$(mktemp -d /tmp/dcomm-slurm.XXXXXX) || exit 1
# munged requires every directory above its socket to be searchable by all.
chmod 0755 "$dir"
export SLURM_CONF=$dir/slurm.conf

pids=()

# The last lines of each log, for a failure.
show_logs() {
  for log in munged slurmctld slurmd; do
    if [ -s "$dir/$log.log" ]; then
      echo "--- last 30 lines of $log.log"
      tail -n 30 "$dir/$log.log"
    fi
  done
}

# Every process whose environment holds this run's SLURM_CONF (the
# daemons, slurmstepd, srun, the ranks), but this shell.
ours() {
  local f p
  while read -r f; do
    p=${f#/proc/}
    p=${p%/environ}
    [ "$p" != "$$" ] && echo "$p"
  done < <(grep -lzxF "SLURM_CONF=$SLURM_CONF" /proc/[0-9]*/environ 2>/dev/null)
}

# PID runs (and is no zombie: the daemons are reaped by the final wait).
running() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

# On a normal exit the daemons get TERM and up to 10 s; on a signal (meson's
# timeout sends TERM, then KILL half a second later) everything gets KILL at
# once. Then anything left that carries this run's SLURM_CONF gets KILL.
interrupted=0
cleanup() {
  local status=$? p alive
  trap - EXIT INT TERM HUP
  if [ $interrupted = 0 ]; then
    [ -n "${pids[*]}" ] && timeout 10 scancel --quiet --full "--user=$(id -un)" >/dev/null 2>&1
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for _ in $(seq 20); do
      alive=0
      for p in "${pids[@]}"; do running "$p" && alive=1; done
      [ $alive = 0 ] && break
      sleep 0.5
    done
  fi
  for p in "${pids[@]}" $(ours); do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$dir"
  exit "$status"
}
trap cleanup EXIT
trap 'interrupted=1; exit 130' INT TERM HUP

fail() {
  echo "FAILED: $*"
  show_logs
  exit 1
}

# Free TCP ports: the kernel's choice for port 0 (closed again at once).
read -r ctld_port slurmd_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
[ -n "$slurmd_port" ] || fail "no free TCP ports"

node=$(hostname -s 2>/dev/null || uname -n)
# Job ids of their own too: Open MPI names its shared memory (/dev/shm) after
# the job, so two clusters' job 1.0 on one host would share segments.
first_job_id=$((100000 + (RANDOM << 10 | RANDOM % 1024) % 60000000))
mkdir -p "$dir/state" "$dir/spool" "$dir/tmp"

# munged: its own key, socket, pid, seed and log.
dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
chmod 0400 "$dir/munge.key"
munged --foreground --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
  --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed" --log-file="$dir/munged.log" \
  </dev/null >>"$dir/munged.log" 2>&1 &
pids+=($!)

cat >"$SLURM_CONF" <<EOF
ClusterName=dcomm-test
FirstJobId=$first_job_id
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
TmpFS=$dir/tmp
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF

if ! timeout 10 srun --mpi=list 2>&1 | grep -qx "[[:space:]]*$mpi"; then
  echo "skipped: srun has no --mpi=$mpi plugin (srun --mpi=list)"
  exit 77
fi

for _ in $(seq 50); do
  [ -S "$dir/munge.socket" ] && break
  sleep 0.2
done
[ -S "$dir/munge.socket" ] || fail "munged did not start"

slurmctld -D -i </dev/null >>"$dir/slurmctld.log" 2>&1 &
pids+=($!)
slurmd -D -N "$node" </dev/null >>"$dir/slurmd.log" 2>&1 &
pids+=($!)

# Up to 30 s for the node to be idle.
state=
for _ in $(seq 60); do
  state=$(timeout 5 sinfo -h -n "$node" -o %t 2>/dev/null)
  [ "$state" = idle ] && break
  sleep 0.5
done
[ "$state" = idle ] || fail "node $node not idle after 30 s (state: '${state:-no answer}')"
echo "private Slurm up: node $node, slurmctld port $ctld_port, slurmd port $slurmd_port"

# What srun runs with: Open MPI's shared memory transport may not use its
# single-copy mechanism (ptrace) in a container; session files in $dir.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export TMPDIR=$dir/tmp
run=(timeout -k 5 "${DCOMM_SRUN_TIMEOUT:-60}" srun "--mpi=$mpi" --kill-on-bad-exit=1 --time=2)

failed=()
step() {
  local name=$1 started=$SECONDS
  shift
  echo "=== $name"
  # In the background: bash runs a trap only once a foreground command ends.
  "$@" &
  if wait $!; then
    echo "=== $name: passed ($((SECONDS - started)) s)"
  else
    echo "=== $name: FAILED, status $? ($((SECONDS - started)) s)"
    failed+=("$name")
  fi
}
step "mpi_tests, srun -n 3" "${run[@]}" -n 3 "$mpi_tests"
step "mpi_tests, srun -n 1" "${run[@]}" -n 1 "$mpi_tests"
step "mpi_ptdist send_recv, srun -n 2" python3 "$check_output" "${run[@]}" -n 2 "$mpi_ptdist" send_recv \
  -- 'Rank-0 has sent the following tensor to Rank-1' 'tensor([ 1., -1.])' \
  'Rank-1 has recieved the following tensor from Rank-0'
step "mpi_ptdist all_reduce, srun -n 3" python3 "$check_output" "${run[@]}" -n 3 "$mpi_ptdist" all_reduce \
  -- 'Rank 0 has tensor([0.])' 'Rank 1 has tensor([0.])' 'Rank 2 has tensor([0.])'

if [ ${#failed[@]} -gt 0 ]; then
  fail "$(printf '%s; ' "${failed[@]}")"
fi
echo "all ${SECONDS} s: passed"
