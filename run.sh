#!/usr/bin/env bash
# Train on every visible CUDA GPU: ./run.sh [--name=value ...]     Check that run first: ./run.sh --check [...]
#   TRACK=3                train_gpt_shampoo.py instead of train_gpt.py (Track 1)
#   NPROC=N                processes on this machine instead of the visible GPU count (CUDA_VISIBLE_DEVICES limits
#                          those); without a GPU, N gloo processes on the CPU: NPROC=1 ./run.sh --preset=smoke
#   NNODES=N               machines in the run, through torchrun's c10d rendezvous; every machine runs ./run.sh with
#   MASTER_ADDR, MASTER_PORT   the same NNODES and the rendezvous address (the first machine's, port 29500 by default),
#   RDZV_ENDPOINT          or host:port in one; NODE_RANK=0 marks the machine that hosts the rendezvous (others 1, 2, ...)
#   RDZV_ID                the run's name at the rendezvous (default: SLURM_JOB_ID, else nanogpt)
#   RDZV_TIMEOUT           seconds to wait at the rendezvous for the other machines (default 600); a machine with
#                          NODE_RANK 1, 2, ... first waits as long for NODE_RANK=0's to open the rendezvous. If the
#                          workers have not started 2 x RDZV_TIMEOUT + 10 s after torchrun did (3 x RDZV_TIMEOUT + 10 s
#                          without NODE_RANK, when torchrun's own connect may wait up to about 2 x RDZV_TIMEOUT for the
#                          host), run.sh stops torchrun: a program that accepts connections at the rendezvous's port but
#                          never answers as one holds torch's store client forever
# --check runs tools/doctor.py on exactly this run, after run.sh's own checks: it exits 0 exactly when run.sh
# would start. Ctrl-C, SIGTERM and SIGHUP reach the workers through torchrun; run.sh exits with their status.
set -euo pipefail
cd "$(dirname "$0")"

fail() { echo "run.sh: $*" >&2; exit 1; }
say() { echo "run.sh: $*" >&2 2>/dev/null || true; } # also after the terminal is gone

case "${TRACK:-1}" in
  1) script=train_gpt.py download="python data/cached_fineweb10B.py 9" ;;
  3) script=train_gpt_shampoo.py download="python data/cached_fineweb10B.py 22" ;;
  *) fail "TRACK must be 1 (train_gpt.py) or 3 (train_gpt_shampoo.py), got '$TRACK'" ;;
esac

check=0
if [[ "${1:-}" == "--check" ]]; then # the pre-flight check of this run: run.sh's checks below, then tools/doctor.py
  check=1
  shift
fi

count_visible_gpus() {
  local physical=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    physical=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    # CUDA_VISIBLE_DEVICES="" (or -1) hides every GPU; "0,2" shows two of them.
    local ids="${CUDA_VISIBLE_DEVICES// /}" visible=0
    [[ -n "$ids" && "$ids" != -1* ]] && visible=$(awk -F, '{ print NF }' <<<"$ids")
    ((visible < physical)) && physical=$visible
  fi
  echo "$physical"
}

# The scripts split their batch over a world size that divides 8.
largest_usable() { local n=8; while ((n > $1)); do n=$((n / 2)); done; echo "$n"; }

if [[ -n "${NPROC:-}" ]]; then
  [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive number of processes, got '$NPROC'"
  ((8 % NPROC == 0)) ||
    fail "NPROC=$NPROC: $script splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$NPROC")"
  nproc_per_node=$NPROC
else
  nproc_per_node=$(count_visible_gpus)
  ((nproc_per_node > 0)) ||
    fail "no CUDA GPU is visible; to train a tiny model on the CPU, run: python $script --preset=smoke (or NPROC=1 ./run.sh --preset=smoke)"
  ((8 % nproc_per_node == 0)) ||
    fail "$nproc_per_node GPUs are visible, but $script splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$nproc_per_node") (or CUDA_VISIBLE_DEVICES)"
fi

# OpenMP threads per worker where OMP_NUM_THREADS does not say: on CPU the scripts' own rule (cpu_threads: half the
# usable cores over this machine's processes, at least 1), which torchrun's default of 1 for several processes would
# otherwise override; on GPUs torchrun's 1, set here so that torchrun does not print its four-line notice of it.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  if (($(count_visible_gpus) > 0)); then
    ((nproc_per_node == 1)) || export OMP_NUM_THREADS=1
  else
    threads=$(($(nproc) / (2 * nproc_per_node)))
    export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
  fi
fi

# One machine: torchrun --standalone. Several (NNODES): torchrun's c10d rendezvous at RDZV_ENDPOINT or
# MASTER_ADDR:MASTER_PORT. c10d numbers the machines itself (the one whose host name sorts first gets rank 0 and
# writes the log); NODE_RANK only says which machine hosts the rendezvous store, for when host names do not
# match the address (containers, Slurm).
rendezvous=(--standalone)
nnodes=1
if [[ -n "${NNODES:-}" ]]; then
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "NNODES must be a positive number of machines, got '$NNODES'"
  nnodes=$NNODES
  world_size=$((NNODES * nproc_per_node))
  ((8 % world_size == 0)) ||
    fail "NNODES=$NNODES x $nproc_per_node processes = $world_size, but $script splits its batch over 1, 2, 4 or 8 processes in all; set NPROC (per machine) so that NNODES x NPROC is one of them"
  endpoint=${RDZV_ENDPOINT:-}
  if [[ -z "$endpoint" ]]; then
    if [[ -z "${MASTER_ADDR:-}" ]]; then
      ((NNODES == 1)) || fail "NNODES=$NNODES: set MASTER_ADDR to the first machine's address (reachable from every machine), or RDZV_ENDPOINT=host:port"
      MASTER_ADDR=127.0.0.1
    fi
    [[ "${MASTER_PORT:-29500}" =~ ^[1-9][0-9]{0,4}$ ]] && ((${MASTER_PORT:-29500} <= 65535)) ||
      fail "MASTER_PORT must be a port number, 1 .. 65535 (the same on every machine), got '$MASTER_PORT'"
    endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
    address_setting="MASTER_ADDR=$MASTER_ADDR" both_settings="MASTER_ADDR=$MASTER_ADDR and MASTER_PORT=${MASTER_PORT:-29500}"
    port_setting=MASTER_PORT
  else
    address_setting="RDZV_ENDPOINT=$endpoint" both_settings="RDZV_ENDPOINT=$endpoint" port_setting="port in RDZV_ENDPOINT"
  fi
  # The address and port, as torch's c10d backend splits the endpoint ([v6 address]:port, host:port, or host alone
  # for its port 29400).
  if [[ "$endpoint" =~ ^\[(.*)\]:([0-9]+)$ || "$endpoint" =~ ^([^:]*):([0-9]+)$ ]]; then
    rdzv_host=${BASH_REMATCH[1]} rdzv_port=${BASH_REMATCH[2]}
  else
    rdzv_host=${endpoint#[} rdzv_host=${rdzv_host%]} rdzv_port=29400
  fi
  rdzv_timeout=${RDZV_TIMEOUT:-600}
  [[ "$rdzv_timeout" =~ ^[1-9][0-9]*$ ]] || fail "RDZV_TIMEOUT must be a positive number of seconds, got '$rdzv_timeout'"
  rdzv_id=${RDZV_ID:-${SLURM_JOB_ID:-nanogpt}}
  # read_timeout bounds torchrun's connect to the rendezvous store (and the store's reads; torch's default is 60 s)
  rdzv_conf="join_timeout=$rdzv_timeout,read_timeout=$rdzv_timeout"
  if [[ -n "${NODE_RANK:-}" ]]; then
    [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && ((NODE_RANK < NNODES)) ||
      fail "NODE_RANK must be 0 .. $((NNODES - 1)) (NNODES=$NNODES), got '$NODE_RANK'"
    if ((NODE_RANK == 0)); then rdzv_conf+=",is_host=1"; else rdzv_conf+=",is_host=0"; fi
  fi
  rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id" --rdzv-conf="$rdzv_conf")
fi

command -v torchrun >/dev/null 2>&1 ||
  fail "torchrun is not on PATH; activate the environment torch is installed in (its bin/ holds torchrun)"

# The script reads the default shards unless told otherwise (the smoke preset writes its own);
# like the scripts, DATA_PATH is prefixed to the default paths.
missing_shard=""
if [[ " $* " != *" --train_files"* && " $* " != *" --val_files"* && " $* " != *" --preset=smoke "* ]]; then
  for shard in data/fineweb10B/fineweb_train_000001.bin data/fineweb10B/fineweb_val_000000.bin; do
    if [[ ! -f "${DATA_PATH:-.}/$shard" ]]; then
      missing_shard="${DATA_PATH:-.}/$shard is missing; download the FineWeb shards with: $download"
      break
    fi
  done
fi

if ((check)); then
  doctor=(python3 tools/doctor.py --track "${TRACK:-1}" --nproc "$nproc_per_node" --nnodes "$nnodes" --flags-as-given "$@")
  if [[ -n "$missing_shard" ]]; then # a fresh machine: the rest is worth checking before the download
    "${doctor[@]}" || true
    fail "$missing_shard"
  fi
  exec "${doctor[@]}"
fi
[[ -z "$missing_shard" ]] || fail "$missing_shard"

log_dir=logs # where the script writes its log: the last --log_dir given, as its parser takes it
for arg in "$@"; do [[ "$arg" == --log_dir=* ]] && log_dir=${arg#--log_dir=}; done

launcher_dir=$(mktemp -d "${TMPDIR:-/tmp}/run_sh.XXXXXX")
trap 'rm -rf "$launcher_dir"' EXIT

# The filters below outlive a closed terminal (no SIGPIPE, write errors ignored), so that the workers never
# write into a dead pipe, and leave signals to run.sh.

# stdout passes through; the script's `log: PATH` line (every machine's first process prints it; on the machines
# other than global rank 0's it names that machine) is noted for the last line.
watch_stdout() {
  trap '' INT TERM HUP PIPE
  local line
  while IFS= read -r line || [[ -n "$line" ]]; do
    printf '%s\n' "$line" 2>/dev/null || true
    [[ "$line" == "log: "* ]] && printf '%s\n' "${line#log: }" >>"$launcher_dir/log_path.txt"
  done
}

# A worker that stops on an error it reports (one line on stderr) also writes that line to torchrun's
# per-rank error file (TORCHELASTIC_ERROR_FILE, under --log-dir). torchrun adds its own log lines, traceback and
# failure table: those go to report.txt, from which the end of this script makes one line when no worker said why.
# So does all of stderr before the workers start (c10d's C++ errors and backtraces, a failed rendezvous's
# tracebacks); report.txt goes with the temporary folder. Everything else (the workers' own lines) passes through.
split_launcher_report() {
  trap '' INT TERM HUP PIPE
  local line held="" in_report=0 workers=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    if ((!workers)); then # until torchrun starts the workers (it makes their log folder, <run>/attempt_N), all of stderr is torchrun's
      if compgen -G "$launcher_dir/torchrun/*/*" >/dev/null; then
        workers=1
      else
        emit_stderr_line "$line" 1
        continue
      fi
    fi
    if [[ -n "$held" ]]; then # a traceback: torchrun's own when its first frame is torchrun's
      if [[ "$line" =~ /torchrun\",\ line|torch/distributed/run\.py ]]; then
        in_report=1
      fi
      emit_stderr_line "$held" "$in_report"
      held=""
    fi
    if [[ "$line" =~ torch/distributed/elastic/.*\]\ (failed\ \(exitcode|Received.*death\ signal) ]]; then
      in_report=1
    fi
    if ((!in_report)) && [[ "$line" == "Traceback (most recent call last):" ]]; then
      held=$line
      continue
    fi
    if [[ "$line" =~ ^[IWE][0-9]{4}\ .*torch/distributed/elastic/ ]]; then
      emit_stderr_line "$line" 1
    else
      emit_stderr_line "$line" "$in_report"
    fi
  done
  [[ -z "$held" ]] || emit_stderr_line "$held" "$in_report"
}

emit_stderr_line() { # line, into_report
  if (($2)); then
    printf '%s\n' "$1" >>"$launcher_dir/report.txt"
  else
    printf '%s\n' "$1" >&2 2>/dev/null || true
    printf '%s\n' "$1" >>"$launcher_dir/passed.txt"
  fi
}

# Until it accepts a connection, or until seconds have passed: the rendezvous's port. Prints "open", or why not:
# "refused", "silent" (no answer), "unreachable <reason>", "unresolved <reason>".
wait_for_rendezvous() { # host port seconds
  python3 - "$@" <<'EOF'
import os, signal, socket, sys, time
signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: no traceback
host, port, deadline, parent = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3]), os.getppid()
why = "silent"
while time.monotonic() < deadline and os.getppid() == parent:
    try:
        socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
        print("open")
        sys.exit(0)
    except socket.gaierror as error:
        why = f"unresolved {error.strerror}"
        if error.errno == socket.EAI_NONAME:
            break  # a name that does not resolve does not start to
    except ConnectionRefusedError:
        why = "refused"
    except TimeoutError:
        why = "silent"
    except OSError as error:
        why = f"unreachable {error.strerror}"
    time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
print(why)
EOF
}

unreached() { # wait_for_rendezvous's reason -> the line that says it, and what to do
  case "$1" in
    refused) echo "nothing listens at $endpoint (connection refused for $rdzv_timeout s): start ./run.sh with NODE_RANK=0 first on the machine at $rdzv_host (it hosts the rendezvous), or check $both_settings (RDZV_TIMEOUT waits longer)" ;;
    unresolved*) echo "$address_setting: this machine cannot resolve $rdzv_host (${1#unresolved }); give the NODE_RANK=0 machine's IP address, or a name this machine resolves" ;;
    unreachable*) echo "$endpoint is unreachable from this machine (${1#unreachable }, for $rdzv_timeout s): check $address_setting (the NODE_RANK=0 machine's address, as this machine reaches it) and the network between the machines" ;;
    *) echo "$endpoint did not answer for $rdzv_timeout s (no machine at that address, or a firewall drops the port): check $address_setting (the NODE_RANK=0 machine's address, as this machine reaches it) and that port $rdzv_port is open between the machines" ;;
  esac
}

if ((nnodes > 1)); then
  others=$((nnodes - 1))
  machines="$others more machine"
  ((others == 1)) || machines+=s
  if [[ -n "${NODE_RANK:-}" ]] && ((NODE_RANK > 0)); then
    # torchrun's own connect would give up after read_timeout plus a retry delay it draws at random (about as long
    # again), in tracebacks: this machine first waits for the port itself, up to RDZV_TIMEOUT, and says why it gave up.
    workers_within=$((2 * rdzv_timeout + 10))
    say "waiting for the machine with NODE_RANK=0 to open the rendezvous at $endpoint (id $rdzv_id), then there for $machines to start ./run.sh with NNODES=$nnodes and this address; each wait gives up after $rdzv_timeout s, and run.sh stops torchrun if the workers have not started $workers_within s after it"
    reached=$(wait_for_rendezvous "$rdzv_host" "$rdzv_port" "$rdzv_timeout")
    [[ "$reached" == open ]] || fail "$(unreached "$reached")"
  else
    # With NODE_RANK=0 this machine hosts the store; without NODE_RANK torchrun's own connect may wait for the host up to
    # read_timeout plus a random retry delay (measured: up to about 1.7 x) before the join's own RDZV_TIMEOUT.
    if [[ -n "${NODE_RANK:-}" ]]; then workers_within=$((2 * rdzv_timeout + 10)); else workers_within=$((3 * rdzv_timeout + 10)); fi
    say "waiting at the rendezvous $endpoint (id $rdzv_id) for $machines to start ./run.sh with NNODES=$nnodes and this address; torchrun gives up after $rdzv_timeout s, and run.sh stops it if the workers have not started $workers_within s after it"
  fi
fi

# The watchdog of a multi-machine launch: torch's store client waits forever for a program that accepts connections at
# the rendezvous's port but never answers as a store would (a web server, say), deaf to signals meanwhile. Until the
# workers start (torchrun makes their log folder), it stops torchrun's process group, SIGTERM then SIGKILL: after
# workers_within seconds (noted in watchdog_fired), or a few seconds after run.sh passed on a signal that torchrun
# did not act on.
watch_rendezvous() {
  trap '' INT TERM HUP PIPE
  local deadline=$((SECONDS + workers_within)) grace_until=""
  while kill -0 "$launcher_pid" 2>/dev/null && ! compgen -G "$launcher_dir/torchrun/*/*" >/dev/null; do
    if [[ -z "$grace_until" && -e "$launcher_dir/signal_passed_on" ]]; then
      grace_until=$((SECONDS + 5))
    fi
    if ((SECONDS > deadline)) || { [[ -n "$grace_until" ]] && ((SECONDS > grace_until)); }; then
      ((SECONDS <= deadline)) || : >"$launcher_dir/watchdog_fired" # (SECONDS counts whole seconds: never early)
      kill -TERM -- "-$launcher_pid" 2>/dev/null || true
      local tries=0
      while kill -0 -- "-$launcher_pid" 2>/dev/null && ((tries++ < 30)); do sleep 0.1; done
      kill -KILL -- "-$launcher_pid" 2>/dev/null || true
      return 0
    fi
    sleep 0.2
  done
}

exec {watched_stdout}> >(watch_stdout)
stdout_filter=$!
exec {filtered_stderr}> >(split_launcher_report)
stderr_filter=$!
# torchrun gets a process group of its own (set -m), so a terminal's Ctrl-C reaches run.sh alone, which passes it
# on once: torchrun stops the workers on its first signal, and a second one arriving meanwhile would cut that short.
set -m
torchrun "${rendezvous[@]}" --nproc_per_node="$nproc_per_node" --log-dir="$launcher_dir/torchrun" "$script" "$@" \
  >&"$watched_stdout" 2>&"$filtered_stderr" &
launcher_pid=$!
set +m
watchdog_pid=""
if ((nnodes > 1)); then
  watch_rendezvous &
  watchdog_pid=$!
fi
received=""
forward() { received=$1; kill -"$1" "$launcher_pid" 2>/dev/null || true; : >"$launcher_dir/signal_passed_on"; }
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward HUP' HUP
while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid" || true; done
status=0
wait "$launcher_pid" 2>/dev/null || status=$? # (bash would name a killed torchrun on stderr)
exec {watched_stdout}>&- {filtered_stderr}>&-
wait "$stdout_filter" "$stderr_filter" || true
if [[ -n "$watchdog_pid" ]]; then
  kill "$watchdog_pid" 2>/dev/null || true # torchrun is gone: nothing left to watch
  wait "$watchdog_pid" 2>/dev/null || true
fi

signal_status() { # a signal's number or name -> 128 + its number
  local number=$1
  [[ "$number" =~ ^[0-9]+$ ]] || number=$(kill -l "${number#Signals.}" 2>/dev/null) || return 1
  echo $((128 + number))
}

# The log's path, last, on every machine (the scripts print it on each); a script that printed none (it stopped
# before its log) leaves the folder's name.
finish() { # exit status
  if [[ -s "$launcher_dir/log_path.txt" ]]; then
    say "log: $(tail -n 1 "$launcher_dir/log_path.txt")"
  elif ((nnodes > 1 && $1 == 0)); then # rank 0's folder may be another clone than this one: a relative --log_dir is under its run.sh
    local where="$log_dir/<run id>.txt"
    [[ "$log_dir" == /* ]] || where+=" under the folder of ./run.sh"
    say "the log is $where on the machine that ran global rank 0 (its ./run.sh printed the full path), not on this one"
  fi
  exit "$1"
}

report=$(cat "$launcher_dir/report.txt" 2>/dev/null || true)
if ((status == 0)); then
  [[ -z "$report" ]] || printf '%s\n' "$report" >&2
  finish 0
fi

# Why it stopped, in one line unless a worker already said it.
error_files=$(find "$launcher_dir/torchrun" -name error.json 2>/dev/null | sort || true)
if [[ -e "$launcher_dir/watchdog_fired" ]]; then # torchrun held by something at the port that is not a rendezvous
  say "torchrun did not start the workers within $workers_within s and was stopped: something answers at $endpoint but is not the rendezvous (another program holds port $rdzv_port there?): check $both_settings against the NODE_RANK=0 machine's, or pick another $port_setting on every machine"
  finish 1
elif [[ -n "$error_files" ]]; then # a worker explained itself: rank 0's line (printed already, unless it went elsewhere)
  rank0_file=$(grep -m1 '/0/error.json$' <<<"$error_files" || head -n1 <<<"$error_files")
  message=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["message"])' "$rank0_file" 2>/dev/null || true)
  if [[ -n "$message" ]] && ! grep -qxF -- "$message" "$launcher_dir/passed.txt" 2>/dev/null; then
    printf '%s\n' "$message" >&2
  fi
elif [[ -n "$received" ]]; then
  : # run.sh's own signal stopped the workers: nothing else to say
elif grep -q '^Root Cause' <<<"$report"; then # torchrun's failure table: its first failure, in one line
  cause=$(sed -n '/^Root Cause/,$p' <<<"$report")
  rank=$(sed -n 's/^ *rank *: *\([0-9]*\) (local_rank: \([0-9]*\)).*/rank \1 (local rank \2)/p' <<<"$cause" | head -n1)
  host=$(sed -n 's/^ *host *: *\(.*\)$/\1/p' <<<"$cause" | head -n1)
  code=$(sed -n 's/^ *exitcode *: *\(-\{0,1\}[0-9]*\).*/\1/p' <<<"$cause" | head -n1)
  if [[ "$code" == -* ]]; then
    how="was killed by SIG$(kill -l "${code#-}" 2>/dev/null || echo "NAL ${code#-}")"
  else
    how="exited with status $code (its own output, if any, is above)"
  fi
  say "${rank:-a worker} on ${host:-this machine} $how; torchrun stopped the others"
elif grep -q 'RendezvousTimeoutError' <<<"$report"; then
  say "no rendezvous at $endpoint (id $rdzv_id) within $rdzv_timeout s: start ./run.sh with NNODES=$nnodes, the same address and RDZV_ID on every machine (RDZV_TIMEOUT waits longer)"
elif [[ -n "${endpoint:-}" ]] && grep -q 'EADDRINUSE' <<<"$report"; then # this machine hosts the store, and its port is taken
  say "cannot host the rendezvous at $endpoint: port $rdzv_port is already in use on this machine; pick another $port_setting (the same on every machine), or stop what holds it"
elif [[ -n "${endpoint:-}" ]] && grep -q 'RendezvousConnectionError' <<<"$report"; then # torchrun could not reach the store: ask the port why
  if grep -q '^torch\.distributed\.DistNetworkError: Ping failed' <<<"$report"; then
    say "$endpoint answers, but not as a rendezvous (another program holds port $rdzv_port there?): check $both_settings against the NODE_RANK=0 machine's, or pick another $port_setting on every machine"
  else
    reached=$(wait_for_rendezvous "$rdzv_host" "$rdzv_port" 3)
    if [[ "$reached" == open ]]; then
      say "torchrun could not connect to the rendezvous at $endpoint within $rdzv_timeout s, which answers now: start ./run.sh again"
    else
      say "$(unreached "$reached")"
    fi
  fi
elif grep -q '^Traceback' <<<"$report"; then # torchrun itself failed: its exception's last line
  say "torchrun stopped: $(grep -v '^ ' <<<"$report" | grep -v '^[IWE][0-9]\{4\} ' | tail -n 1)"
elif [[ -n "$report" ]]; then
  printf '%s\n' "$report" >&2
fi

# The workers' status: 128 + the signal that stopped them, else the first failure's exit code.
if [[ -n "$received" ]]; then
  finish "$(signal_status "$received")"
fi
died_of=$(sed -n 's/.*Received \([^ ]*\) death signal.*/\1/p' <<<"$report" | head -n1)
if [[ -n "$died_of" ]] && code=$(signal_status "$died_of"); then
  finish "$code"
fi
worker_status=$(sed -n 's/.*failed (exitcode: \(-\{0,1\}[0-9]*\)).*/\1/p' <<<"$report" | head -n1)
if [[ "$worker_status" == -* ]]; then
  finish $((128 + ${worker_status#-}))
fi
finish "${worker_status:-$status}"
