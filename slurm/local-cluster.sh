#!/usr/bin/env bash
# A real Slurm cluster of one or more nodes on 127.0.0.1 for development and CI (Debian 12, slurm-wlm 22.05).
#
#   slurm/local-cluster.sh start [--nodes N]  # install what is missing, write the config, start the daemons, wait
#                                             # until every node is idle (N: default 1)
#   slurm/local-cluster.sh status             # our daemons (one slurmd per node), sinfo, squeue
#   slurm/local-cluster.sh stop               # cancel the queued and running jobs, then stop the daemons this
#                                             # script started (by PID file), nothing else
#
# Daemons: munged, mariadbd + slurmdbd (so sacct works), slurmctld, and one slurmd per node. One node is named
# after this host (`hostname -s`); N > 1 nodes are afm-n1 .. afm-nN, each its own `slurmd -N afm-nI` listening on
# port SLURMD_PORT_BASE + I (default 6830 + I), with per-node spool, PID and log paths (`%n` in slurm.conf). The
# node names resolve through one line `127.0.0.1 afm-n1 ... # afm local-cluster` that start adds to /etc/hosts and
# stop removes (jobs take MASTER_ADDR from the first node's name). Partitions over all nodes: `debug` (default)
# and `high`, whose jobs preempt `debug` jobs by requeue; the preempted job gets its --signal (submitit: USR2) at
# once (SlurmctldParameters=preempt_send_user_signal) and 30 s of grace. A requeued job may start again after ~11 s
# (AuthInfo=cred_expire=10, sched/bf interval 2 s). Each node advertises SLURM_CPUS CPUs (default 8,
# over-subscribing the real cores through SlurmdParameters=config_overrides) so a few small jobs run at once.
# Settings: slurm.conf(5), https://slurm.schedmd.com/slurm.conf.html. Must run as root (it installs packages and
# starts daemons under their own users). State (job ids, spool, logs, PID files) persists in $AFM_SLURM_STATE
# (default /var/lib/afm-slurm) across stop/start, so job ids keep growing and sacct history stays consistent; the
# queue does not: stop cancels the jobs first, and start cancels those a killed controller left.
set -euo pipefail

STATE=${AFM_SLURM_STATE:-/var/lib/afm-slurm}
SLURM_CPUS=${SLURM_CPUS:-8}
SLURMD_PORT_BASE=${SLURMD_PORT_BASE:-6830}
NODE=$(hostname -s)          # the controller's host name
NODES_FILE=$STATE/nodes      # the node names of the last start, one a line (read by stop and status)
HOSTS=/etc/hosts
HOSTS_MARK="# afm local-cluster"
CONF_DIR=/etc/slurm
MARK="# Written by afm slurm/local-cluster.sh; rewritten on every start."
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
DB_PASS=slurmpw

log() { echo "[local-cluster] $*"; }
die() { echo "[local-cluster] error: $*" >&2; exit 1; }

# --- PID files: one per daemon this script started, under $STATE/run (or written there by the daemon) ---------
pid_file() {  # pid_file NAME [NODE]  (slurmd: one per node)
  case $1 in
    munged) echo "$STATE/run/munge/munged.pid" ;;
    mariadbd) echo "$STATE/run/mysql/mariadbd.pid" ;;
    slurmd) echo "$STATE/run/slurm/slurmd_$2.pid" ;;
    *) echo "$STATE/run/slurm/$1.pid" ;;
  esac
}

# The PID of our running daemon NAME (on NODE for slurmd), or nothing. The process name is checked so a reused PID
# is never taken, and the state so a killed daemon not yet reaped (a zombie) does not count as running.
our_pid() {
  local f pid stat
  f=$(pid_file "$1" "${2:-}")
  [ -s "$f" ] || return 0
  pid=$(tr -dc '0-9' <"$f")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$1" ] || return 0
  read -r _ _ stat _ 2>/dev/null <"/proc/$pid/stat" && [ "$stat" != Z ] && echo "$pid"
  return 0
}

# wait_for SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds, up to a deadline (a slow COMMAND, as sinfo
# retrying a controller that is gone, does not stretch it).
wait_for() {
  local secs=$1 what=$2
  shift 2
  wait_for_quiet "$secs" "$@" || die "timed out after ${secs}s waiting for $what (logs: $STATE/log, $STATE/run/*/)"
}

wait_for_quiet() {  # wait_for_quiet SECONDS COMMAND...: as wait_for, but returns 1 at the deadline
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# --- install ------------------------------------------------------------------------------------------------------
install_missing() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  # No init system here: keep package scripts from starting daemons (we start them by hand, below).
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && own_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ $own_policy -eq 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# --- nodes ----------------------------------------------------------------------------------------------------------
node_names() {  # node_names N: this host's name for one node, afm-n1 .. afm-nN for more
  if [ "$1" -eq 1 ]; then echo "$NODE"; else seq -f 'afm-n%g' 1 "$1"; fi
}

started_nodes() {  # the nodes of the last start (none before the first)
  [ -s "$NODES_FILE" ] && cat "$NODES_FILE"
  return 0
}

# /etc/hosts is often a bind mount (containers): rewrite it in place, never by rename.
hosts_remove() {
  grep -qF "$HOSTS_MARK" "$HOSTS" 2>/dev/null || return 0
  local kept
  kept=$(grep -vF "$HOSTS_MARK" "$HOSTS")
  printf '%s\n' "$kept" >"$HOSTS"
}

hosts_add() {  # hosts_add NODE...: one marked line mapping the node names to 127.0.0.1
  hosts_remove
  printf '127.0.0.1 %s %s\n' "$*" "$HOSTS_MARK" >>"$HOSTS"
}

# --- configuration ------------------------------------------------------------------------------------------------
write_config() {  # write_config NODE...
  local conf=$CONF_DIR/slurm.conf real_cpus mem_mb overrides="" node_lines="" i=0 n node_list
  if [ -e "$conf" ] && ! grep -qF "$MARK" "$conf"; then
    die "$conf exists and was not written by this script; refusing to replace it"
  fi
  real_cpus=$(nproc)
  [ "$SLURM_CPUS" != "$real_cpus" ] && overrides="SlurmdParameters=config_overrides"
  # The host's memory is split between the nodes (85% of it in all).
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 85 / 100 / 1024 / $# ))
  for n in "$@"; do
    i=$((i + 1))
    node_lines+="NodeName=$n NodeAddr=127.0.0.1"
    [ $# -gt 1 ] && node_lines+=" Port=$((SLURMD_PORT_BASE + i))"
    node_lines+=" CPUs=$SLURM_CPUS RealMemory=$mem_mb State=UNKNOWN"$'\n'
  done
  node_list=$(IFS=,; echo "$*")
  mkdir -p "$CONF_DIR"
  cat >"$conf.tmp" <<EOF
$MARK
ClusterName=localcluster
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire + 1 s before it may start again (default 120).
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
StateSaveLocation=$STATE/ctld
# Per-node paths (%n: the node name), so several slurmd run side by side on this host.
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$(pid_file slurmctld)
SlurmdPidFile=$(pid_file slurmd %n)
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd_%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job that asks for no memory takes the whole node.
DefMemPerCPU=1000
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Slurm 22.05 name; newer releases call it PreemptParameters=send_user_signal.
SlurmctldParameters=preempt_send_user_signal
MinJobAge=3600
KillWait=5
InactiveLimit=0
Waittime=0
MessageTimeout=10
$overrides
${node_lines}PartitionName=debug Nodes=$node_list Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=high Nodes=$node_list Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
  mv "$conf.tmp" "$conf"

  local dbd=$CONF_DIR/slurmdbd.conf
  if [ -e "$dbd" ] && ! grep -qF "$MARK" "$dbd"; then
    die "$dbd exists and was not written by this script; refusing to replace it"
  fi
  cat >"$dbd.tmp" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
PidFile=$(pid_file slurmdbd)
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  chown slurm:slurm "$dbd.tmp" && chmod 600 "$dbd.tmp"  # slurmdbd refuses any other owner or mode
  mv "$dbd.tmp" "$dbd"
}

make_dirs() {
  local fresh=0
  [ -d "$STATE/ctld" ] || fresh=1
  mkdir -p "$STATE"/{ctld,spool,log,run/slurm,run/munge,run/mysql}
  chown slurm:slurm "$STATE"/{ctld,log,run/slurm}
  chown munge:munge "$STATE/run/munge"
  chown mysql:mysql "$STATE/run/mysql"
  mkdir -p /run/munge /run/mysqld
  chown munge:munge /run/munge && chmod 755 /run/munge
  chown mysql:mysql /run/mysqld
  echo $fresh
}

# --- start ----------------------------------------------------------------------------------------------------------
start_munged() {
  [ -n "$(our_pid munged)" ] && return 0
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged is already running (not started by this script); using it"
    return 0
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged --pid-file="$(pid_file munged)" --log-file="$STATE/run/munge/munged.log"
  wait_for 10 "munged" bash -c 'munge -n | unmunge'
}

start_mariadbd() {
  if [ -z "$(our_pid mariadbd)" ]; then
    if mariadb -e 'SELECT 1' >/dev/null 2>&1; then
      log "MariaDB is already running (not started by this script); using it"
    else
      [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
      nohup /usr/sbin/mariadbd --user=mysql --pid-file="$(pid_file mariadbd)" \
        --log-error="$STATE/run/mysql/mariadb.err" >/dev/null 2>&1 &
      wait_for 30 "MariaDB" mariadb -e 'SELECT 1'
    fi
  fi
  local fresh=$1
  # A fresh Slurm state restarts job ids at 1: drop the old accounting rows so sacct never mixes two job 1s.
  [ "$fresh" = 1 ] && mariadb -e 'DROP DATABASE IF EXISTS slurm_acct_db'
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
}

# cancel_jobs WHY: cancel every job in the queue (WHY goes into the log line) and wait until none is left.
cancel_jobs() {
  local jobs
  jobs=$(squeue -h -o %F | sort -un | tr '\n' ' ')
  [ -n "$jobs" ] || return 0
  log "cancelling job(s) $1: $jobs"
  # shellcheck disable=SC2086  # one argument per job id
  scancel $jobs
  wait_for 60 "the cancelled jobs to end" bash -c '[ -z "$(squeue -h -o %i)" ]'
}

node_idle() { sinfo -h -n "$1" -o %t | grep -qx idle; }  # idle and responding ("idle*": not responding)

registered() {  # registered NODE EPOCH: NODE's slurmd, started at or after EPOCH, has registered with slurmctld
  local t
  t=$(scontrol -o show node "$1" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
  [ -n "$t" ] && [ "$t" != None ] && [ "$(date -d "$t" +%s)" -ge "$2" ]
}

start_slurm_daemons() {  # start_slurm_daemons NODE...
  local n since recovered=""
  if [ -z "$(our_pid slurmdbd)" ]; then
    /usr/sbin/slurmdbd
    wait_for 30 "slurmdbd on port 6819" port_open 6819
  fi
  if [ -z "$(our_pid slurmctld)" ]; then
    scontrol ping 2>/dev/null | grep -q UP && die "a slurmctld not started by this script answers; leaving it alone"
    /usr/sbin/slurmctld -i
    wait_for 30 "slurmctld" bash -c 'scontrol ping | grep -q UP'
    recovered=1
  fi
  since=$(date +%s)
  for n in "$@"; do
    mkdir -p "$STATE/spool/$n"
    [ -n "$(our_pid slurmd "$n")" ] && continue
    /usr/sbin/slurmd -N "$n"
    # Until it registers, the controller's node state is the saved one, and what it sends the node is retried
    # only minutes later.
    wait_for 60 "slurmd on $n to register" registered "$n" "$since"
  done
  for n in "$@"; do
    wait_for 60 "node $n to be up" bash -c "sinfo -h -n $n -o %t | grep -qE '^(idle|mix|alloc)'"
  done
  if [ -n "$recovered" ]; then
    # A controller started on the saved state recovers the jobs its predecessor had queued or running, though their
    # processes did not outlive that cluster (killed with the machine's session): their nodes stayed allocated and
    # later jobs pended behind them until their time limits. So they are cancelled (sacct records CANCELLED).
    cancel_jobs "left from the previous controller"
    for n in "$@"; do
      wait_for_quiet 10 node_idle "$n" && continue
      # A node mostly turns idle at once. When a recovered job's slurmd had restarted, slurmctld sometimes held its
      # CPUs (the job COMPLETING) for ~300 s or more (one CI start timed out after 330 s). Setting the node DOWN ends
      # what slurmctld still holds there (Slurm's troubleshooting guide, "Jobs stuck in completing state"); with
      # ReturnToService=2 a registered node then comes back by itself, else RESUME brings it back.
      log "node $n is $(sinfo -h -n "$n" -o %T) 10 s after the cancel; setting it DOWN and back to release the jobs' CPUs"
      scontrol update NodeName="$n" State=DOWN Reason="afm local-cluster: jobs left by the previous controller"
      # (RESUME is refused, harmlessly, by a node that came back between the two checks.)
      wait_for_quiet 5 node_idle "$n" || scontrol update NodeName="$n" State=RESUME || true
      wait_for 60 "node $n to be idle" node_idle "$n"
    done
  fi
}

cmd_start() {  # cmd_start N
  [ "$(id -u)" -eq 0 ] || die "run as root (it installs Debian packages and starts daemons)"
  [[ "$1" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '$1'"
  local fresh nodes running
  mapfile -t nodes < <(node_names "$1")
  running=$(started_nodes)
  if [ -n "$(our_pid slurmctld)" ] && [ "$running" != "$(printf '%s\n' "${nodes[@]}")" ]; then
    die "the cluster runs with node(s) $(echo $running); stop it before starting it with $1 node(s)"
  fi
  install_missing
  fresh=$(make_dirs)
  write_config "${nodes[@]}"
  printf '%s\n' "${nodes[@]}" >"$NODES_FILE"
  if [ "$1" -gt 1 ]; then hosts_add "${nodes[@]}"; else hosts_remove; fi
  start_munged
  start_mariadbd "$fresh"
  start_slurm_daemons "${nodes[@]}"
  log "up: $1 node(s) $(sinfo -h -N -o %N | sort -u | tr '\n' ' ')with $SLURM_CPUS CPUs each;" \
    "partitions $(sinfo -h -o %P | tr '\n' ' ')"
}

# --- stop / status ----------------------------------------------------------------------------------------------
stop_daemon() {  # stop_daemon NAME [NODE]
  local pid label=$1${2:+ on $2}
  pid=$(our_pid "$1" "${2:-}")
  if [ -n "$pid" ]; then
    kill -TERM "$pid"
    for _ in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
    if [ -d "/proc/$pid" ]; then
      log "$label ($pid) still running after 20 s; killing it"
      kill -KILL "$pid"
    fi
    log "stopped $label ($pid)"
  fi
  rm -f "$(pid_file "$1" "${2:-}")"
}

cmd_stop() {
  local name n
  if [ -n "$(our_pid slurmctld)" ]; then
    # A stopped cluster keeps no jobs: a job whose processes outlived slurmd would be recovered by the next start
    # without them. Cancelled here, while every slurmd still runs, their nodes are released at once.
    cancel_jobs "still queued or running"
    for n in $(started_nodes); do wait_for_quiet 30 node_idle "$n" || log "node $n not idle after 30 s"; done
  fi
  for n in $(started_nodes); do stop_daemon slurmd "$n"; done
  for name in slurmctld slurmdbd mariadbd munged; do stop_daemon "$name"; done
  hosts_remove
}

cmd_status() {
  local name pid up=1 n nodes
  nodes=$(started_nodes)
  [ -n "$nodes" ] || up=0
  for name in munged mariadbd slurmdbd slurmctld; do
    pid=$(our_pid "$name")
    if [ -n "$pid" ]; then echo "$name: running (pid $pid)"; else echo "$name: not running"; up=0; fi
  done
  for n in $nodes; do
    pid=$(our_pid slurmd "$n")
    if [ -n "$pid" ]; then echo "slurmd $n: running (pid $pid)"; else echo "slurmd $n: not running"; up=0; fi
  done
  if [ $up -eq 1 ]; then
    sinfo
    squeue
  fi
  [ $up -eq 1 ]
}

usage() { echo "usage: $0 start [--nodes N] | stop | status" >&2; exit 2; }

case ${1:-} in
  start)
    nodes=1
    shift
    while [ $# -gt 0 ]; do
      case $1 in
        --nodes) [ $# -ge 2 ] || usage; nodes=$2; shift 2 ;;
        --nodes=*) nodes=${1#--nodes=}; shift ;;
        *) usage ;;
      esac
    done
    cmd_start "$nodes" ;;
  stop) [ $# -eq 1 ] || usage; cmd_stop ;;
  status) [ $# -eq 1 ] || usage; cmd_status ;;
  *) usage ;;
esac
