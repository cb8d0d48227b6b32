#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the tests marked `slurm` and for trying
# `start_hosts("slurm", n)` without a cluster. Run as root; needs Debian's packages
# (apt-get install slurmctld slurmd slurm-client munge).
#
#   bash tests/slurm/local_cluster.sh start DIR [NODES]   # prints `export SLURM_CONF=...`
#   bash tests/slurm/local_cluster.sh stop DIR
#
# It is started as an admin would start one, with everything under DIR so that several
# can run side by side and nothing under /etc/slurm or /etc/munge is touched:
# - munged with its own key (DIR/munge.key) and socket; slurm.conf points Slurm at it
#   (AuthInfo=socket=...).
# - slurmctld, and NODES slurmd daemons (default 2), each in a UTS namespace of its own
#   whose hostname is its node's name (`unshare --uts`), resolving through /etc/hosts to a
#   loopback address of its own (127.0.X.i, lines tagged with DIR, removed by stop). So,
#   as on a real cluster, each node has its own name and address, and a job's processes
#   on two nodes can serve the same port.
# - one partition `debug` (the default) over all nodes, OverSubscribe=FORCE: jobs may share
#   nodes, as two tests' jobs may.
# `stop` cancels every job, stops the daemons (TERM, then KILL), kills any process still
# carrying this cluster's SLURM_CONF (what its jobs started), and removes the /etc/hosts
# lines. Clients (sinfo, sbatch, start_hosts) find the cluster through SLURM_CONF.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
nodes=${3:-2}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start|stop DIR [NODES]" >&2; exit 2; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/slurm.conf
marker="# colocate-local-slurm $dir"

pids_of() {  # the pids in the pid files given (those that exist)
    for f in "$@"; do [ -s "$f" ] && cat "$f"; done 2>/dev/null || true
}

stop_pids() {  # TERM, wait up to 10 s, then KILL
    local pids=("$@") end=$((SECONDS + 10)) alive
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    while [ $SECONDS -lt $end ]; do
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive -eq 0 ] && return 0
        sleep 0.2
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

job_pids() {  # what this cluster's jobs started: its SLURM_CONF and a SLURM_JOB_ID
    local f
    for f in $(grep -lzxF "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null); do
        grep -qz "^SLURM_JOB_ID=" "$f" 2>/dev/null && basename "$(dirname "$f")"
    done || true
}

stop() {
    if [ -f "$conf" ] && [ -s "$dir/slurmctld.pid" ]; then
        SLURM_CONF=$conf scancel --full --quiet --user=root 2>/dev/null || true
        SLURM_CONF=$conf scancel --quiet "$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null \
            | tr '\n' ' ')" 2>/dev/null || true
        local end=$((SECONDS + 15))
        while [ $SECONDS -lt $end ] && [ -n "$(SLURM_CONF=$conf squeue -h 2>/dev/null)" ]; do
            sleep 0.5
        done
    fi
    # shellcheck disable=SC2046
    stop_pids $(pids_of "$dir"/slurmd.*.pid)
    # shellcheck disable=SC2046
    stop_pids $(pids_of "$dir/slurmctld.pid")
    # shellcheck disable=SC2046
    stop_pids $(job_pids)
    # shellcheck disable=SC2046
    stop_pids $(pids_of "$dir/munge/munged.pid")
    rm -f "$dir"/slurmd.*.pid "$dir/slurmctld.pid"
    if grep -qF "$marker" /etc/hosts 2>/dev/null; then
        grep -vF "$marker" /etc/hosts > "$dir/hosts.new" || true
        cat "$dir/hosts.new" > /etc/hosts  # in place: /etc/hosts may be a mount
        rm -f "$dir/hosts.new"
    fi
}

fail() {  # say why, show the daemons' last log lines, stop what started
    echo "local_cluster.sh: $1 (logs: $dir/log, $dir/munge/munged.log)" >&2
    tail -n 5 "$dir"/log/*.log "$dir/munge/munged.log" >&2 2>/dev/null || true
    stop
    exit 4
}

start() {
    [ "$(id -u)" -eq 0 ] || { echo "local_cluster.sh: must run as root" >&2; exit 3; }
    for c in munged slurmctld slurmd sinfo sbatch unshare; do
        command -v "$c" >/dev/null || {
            echo "local_cluster.sh: $c not found: apt-get install slurmctld slurmd slurm-client munge" >&2
            exit 3; }
    done
    stop  # whatever a previous start in DIR left
    chmod 700 "$dir"
    local x=$((RANDOM % 200 + 20)) names=() i name
    for i in $(seq 1 "$nodes"); do names+=("c${x}n$i"); done

    # munge: a key and a daemon of this cluster's own
    mkdir -p "$dir/munge"
    chmod 700 "$dir/munge"
    [ -s "$dir/munge.key" ] || dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 2>/dev/null
    chmod 400 "$dir/munge.key"
    munged --force --key-file="$dir/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed" || fail "munged did not start"

    # names and addresses: one loopback address per node
    for i in $(seq 1 "$nodes"); do
        echo "127.0.$x.$i ${names[$((i - 1))]} $marker" >> /etc/hosts
    done

    rm -rf "$dir/ctld" "$dir/log" "$dir"/spool.*  # a fresh cluster: no state of another
    mkdir -p "$dir/ctld" "$dir/log"
    for name in "${names[@]}"; do mkdir -p "$dir/spool.$name"; done
    local port=$((20000 + x * 16))
    {
        echo "ClusterName=colocate$x"
        echo "SlurmctldHost=$(hostname)(127.0.0.1)"
        echo "SlurmctldPort=$port"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$dir/munge/munge.socket"
        echo "StateSaveLocation=$dir/ctld"
        echo "SlurmdSpoolDir=$dir/spool.%n"
        echo "SlurmctldPidFile=$dir/slurmctld.pid"
        echo "SlurmdPidFile=$dir/slurmd.%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd.%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "MpiDefault=none"
        echo "ReturnToService=1"  # a node set down stays down until RESUME
        echo "MinJobAge=2"
        echo "KillWait=5"
        echo "SlurmdTimeout=30"
        echo "InactiveLimit=0"
        echo "SchedulerType=sched/backfill"
        echo "JobCompType=jobcomp/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "FirstJobId=$((x * 1000 + 1))"
        for i in $(seq 1 "$nodes"); do
            echo "NodeName=${names[$((i - 1))]} NodeHostname=${names[$((i - 1))]}" \
                 "NodeAddr=127.0.$x.$i Port=$((port + i)) CPUs=2 RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
    } > "$conf"

    SLURM_CONF=$conf slurmctld -c || fail "slurmctld did not start"
    for name in "${names[@]}"; do
        SLURM_CONF=$conf unshare --uts sh -c "hostname $name && exec slurmd -N $name" \
            || fail "slurmd -N $name did not start (in a UTS namespace: unshare --uts)"
    done

    local end=$((SECONDS + 60)) idle
    while true; do
        idle=$(SLURM_CONF=$conf sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
        [ "$idle" -ge "$nodes" ] && break
        if [ $SECONDS -ge $end ]; then
            SLURM_CONF=$conf sinfo -N >&2 || true
            fail "only $idle of $nodes nodes idle after 60 s"
        fi
        sleep 0.3
    done
    echo "export SLURM_CONF=$conf"
}

case "$cmd" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop DIR [NODES]" >&2; exit 2 ;;
esac
