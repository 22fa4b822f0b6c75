# Shared helpers for tests/kapisrv/*.sh (sourced, not run).
# shellcheck disable=SC2034,SC2016  # vars used by the sourcing scripts; sh -c bodies are single-quoted on purpose

KAPISRV_CACHE=${KAPISRV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kapisrv}
KAPISRV_BIN=${KAPISRV_BIN:-$KAPISRV_CACHE/bin}   # where build.sh puts, and up.sh finds, kapisrv and etcd
ETCD_PREFIX=/registry-kapisrv   # must match etcdPrefix in main.go

die() { echo "kapisrv: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { echo "$(date +%s.%N) $1" | awk '{printf "%.2f", $1 - $2}'; }

need_binaries() {
  [ -x "$KAPISRV_BIN/kapisrv" ] && [ -x "$KAPISRV_BIN/etcd" ] ||
    die "no binaries in $KAPISRV_BIN; run $(dirname "${BASH_SOURCE[0]}")/build.sh first"
}

# ns CMD...: run CMD inside $NETNS if set, else directly.
ns() {
  if [ -n "${NETNS:-}" ]; then ip netns exec "$NETNS" "$@"; else "$@"; fi
}

# load_dir DIR: set DIR (absolute) and the settings up.sh saved in DIR/env.
load_dir() {
  [ -n "${1:-}" ] || die "missing DIR argument"
  [ -f "$1/env" ] || die "$1/env not found (was DIR started with up.sh?)"
  DIR=$(cd "$1" && pwd)
  # shellcheck disable=SC1091
  . "$DIR/env"
}

# ours PID: true if PID is alive (not a zombie) and its command line mentions $DIR/
# (guards against killing a recycled PID).
ours() {
  local pid=$1 state
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$state" != Z ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$DIR/"
}

# gone PID: true once PID has fully exited. A killed Go process's leader thread turns zombie
# before its other threads (which still hold the listening sockets) are gone.
gone() {
  [ -d "/proc/$1" ] || return 0
  [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ] && [ "$(ls "/proc/$1/task" 2>/dev/null | wc -l)" -le 1 ]
}

# kill_wait PID: SIGKILL PID if it is ours, wait until it is gone (sockets released).
kill_wait() {
  local pid=$1 i
  ours "$pid" || return 0
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 400); do gone "$pid" && return 0; sleep 0.025; done
  die "pid $pid did not die"
}

# spawn PIDFILE LOG CMD...: start CMD detached (own session, in $NETNS if set),
# with stdout/stderr appended to LOG; its PID is written to PIDFILE.
spawn() {
  local pidf=$1 log=$2 i pre=()
  shift 2
  rm -f "$pidf"
  [ -z "${NETNS:-}" ] || pre=(ip netns exec "$NETNS")
  # sh writes its own PID, then execs (ip netns exec execs too), so the PID stays the same.
  setsid -f sh -c 'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$pidf" "${pre[@]}" "$@" \
    </dev/null >>"$log" 2>&1
  for i in $(seq 200); do [ -s "$pidf" ] && return 0; sleep 0.01; done
  die "could not start $*"
}

# wait_for SECONDS WHAT PIDFILE LOG CMD...: poll CMD until it succeeds; fail early if the
# process in PIDFILE dies.
wait_for() {
  local limit=$1 what=$2 pidf=$3 log=$4 t0
  shift 4
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if ! ours "$(cat "$pidf")"; then
      tail -n 20 "$log" >&2
      die "$what exited during startup (log: $log)"
    fi
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
      tail -n 20 "$log" >&2
      die "$what not ready after ${limit}s (log: $log)"
    fi
    sleep 0.05
  done
}

etcd_url() { echo "http://127.0.0.1:$ETCD_PORT"; }

etcd_healthy() { ns curl -sf --max-time 2 "$(etcd_url)/health" | grep -q '"health":"true"'; }

kapisrv_ready() {
  [ "$(ns curl -sf --max-time 2 --cacert "$DIR/certs/ca.crt" "https://127.0.0.1:$PORT/readyz")" = ok ]
}

# etcd_call PATH JSON: POST to etcd's v3 JSON gateway (no etcdctl needed).
etcd_call() { ns curl -sf --max-time 10 -X POST "$(etcd_url)$1" -d "$2"; }
b64() { printf '%s' "$1" | base64 -w0; }
json_revision() { sed -n 's/.*"revision":"\{0,1\}\([0-9]*\).*/\1/p' | head -n 1; }

start_etcd() {
  local p=http://127.0.0.1:$PEER_PORT c=http://127.0.0.1:$ETCD_PORT
  spawn "$DIR/etcd.pid" "$DIR/etcd.log" "$KAPISRV_BIN/etcd" --name kapisrv --data-dir "$DIR/etcd" \
    --listen-client-urls "$c" --advertise-client-urls "$c" \
    --listen-peer-urls "$p" --initial-advertise-peer-urls "$p" --initial-cluster "kapisrv=$p" \
    --unsafe-no-fsync --log-level warn --heartbeat-interval 10 --election-timeout 100
  wait_for 30 etcd "$DIR/etcd.pid" "$DIR/etcd.log" etcd_healthy
}

start_kapisrv() {
  # shellcheck disable=SC2086  # KAPISRV_EXTRA_ARGS is word-split on purpose
  spawn "$DIR/kapisrv.pid" "$DIR/kapisrv.log" "$KAPISRV_BIN/kapisrv" --etcd "$(etcd_url)" \
    --port "$PORT" --cert-dir "$DIR/certs" ${KAPISRV_EXTRA_ARGS:-}
  wait_for 60 kapisrv "$DIR/kapisrv.pid" "$DIR/kapisrv.log" kapisrv_ready
}

write_pids() { cat "$DIR/etcd.pid" "$DIR/kapisrv.pid" > "$DIR/pids"; }

# The Debian mirror this machine's apt already uses (first ".../debian" URI in its sources).
debian_mirror() {
  { { cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}'
    { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
      awk '/^deb / {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; break}}'
  } | awk '/\/debian\/?$/ {sub(/\/$/, ""); print; exit}' || true
}
