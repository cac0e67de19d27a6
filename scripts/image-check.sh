#!/usr/bin/env bash
# Build draftlab's CPU image with podman and prove it, on a fresh clone of HEAD (docs/container.md):
#   - the build runs with --network none: the base is Debian made with mmdebstrap (cached), the
#     wheels come from a wheelhouse the host's pip downloads from requirements/cpu.txt and uv.txt
#     (cached), installed by uv;
#   - `dvc repro` of the tiny default in the image, on a clone mounted at /workspace as a non-root
#     uid that is not the image's default, exits 0 with the host venv's reports/metrics.json; a
#     second `dvc repro` runs nothing; every file in the clone
#     belongs to that uid; MLflow's git.commit is HEAD and git.dirty false;
#   - `mlflow ui` from the image answers /health on a published port and lists the run over REST;
#   - `draftlab sweep` of sweep-tiny.yaml's space completes its calibration and a search trial and
#     leaves no process;
#   - `scripts/gpu-check.sh` in the image skips every step with its reason and leaves its JSON;
#   - it prints the cold and warm build times, the image size and in-container / host `dvc repro`.
#
#   scripts/image-check.sh [--target cpu] [--base IMAGE] [--wheelhouse DIR] [--uid N] [--no-cold-build]
#
# --no-cold-build: where the layer cache already holds the image's layers, build from it only,
# without the --no-cache build that measures the cold figure (about 100 s of CPU on 2 cores;
# .ci/run passes it: on a new host the first build is the cold one either way).
#
# Needs root (or rootful podman), podman, runc and mmdebstrap (Debian: apt-get install podman runc
# mmdebstrap), the host venv (.venv, scripts/install.sh) and about 5 min on 2 cores. Caches live
# in DRAFTLAB_IMAGE_CACHE (default /var/cache/draftlab-image). Nothing in this checkout is written.
# Exit 0: proved; 1: a check failed; 2: bad input; 3: podman or mmdebstrap missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

TARGET=cpu BASE="" WHEELHOUSE="" CHECK_UID=4242 COLD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --target) TARGET="${2:-}"; shift 2 ;;
    --base) BASE="${2:-}"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="${2:-}"; shift 2 ;;
    --uid) CHECK_UID="${2:-}"; shift 2 ;;
    --no-cold-build) COLD=0; shift ;;
    *) echo "image-check: unknown argument $1 (use --target cpu, --base IMAGE, --wheelhouse DIR, --uid N, --no-cold-build)" >&2; exit 2 ;;
  esac
done
say() { echo "image-check: $*"; }
fail() { echo "image-check: FAIL: $*" >&2; exit 1; }
case "$TARGET" in
  cpu) ;;
  gpu) echo "image-check: --target gpu needs a CUDA base from a registry and a GPU host; this check builds --target cpu (docs/container.md)" >&2; exit 2 ;;
  *) echo "image-check: unknown target '$TARGET' (this check builds the cpu image)" >&2; exit 2 ;;
esac
if ! [[ "$CHECK_UID" =~ ^[0-9]+$ ]] || [ "$CHECK_UID" -eq 0 ] || [ "$CHECK_UID" -eq 1000 ]; then
  echo "image-check: --uid $CHECK_UID must be a number other than 0 and the image's default 1000" >&2; exit 2
fi
if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  echo "image-check: podman and runc not found; install them (Debian 12: apt-get install podman runc mmdebstrap)" >&2; exit 3
fi
HOST_PY="$ROOT/.venv/bin/python"
if [ ! -x "$HOST_PY" ]; then echo "image-check: no host venv at .venv; run scripts/install.sh first" >&2; exit 2; fi

CACHE="${DRAFTLAB_IMAGE_CACHE:-/var/cache/draftlab-image}"
export CONTAINERS_CONF="$ROOT/scripts/containers.conf"
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
TAG="localhost/draftlab-cpu:check"
mkdir -p "$CACHE"
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

if [ -n "$BASE" ] && ! "${PODMAN[@]}" image exists "$BASE"; then
  echo "image-check: --base $BASE is not an image podman has (podman images lists them)" >&2; exit 2
fi

# ---- the wheelhouse: every file of requirements/cpu.txt, by the host's pip, hash-checked ----------
if [ -z "$WHEELHOUSE" ]; then
  WHEELHOUSE="$CACHE/wheelhouse-cp311"
  mkdir -p "$WHEELHOUSE"
  # the host venv's Python is the image's (3.11 on x86_64 glibc), so its pip picks the image's files
  "$HOST_PY" -c 'import sys, platform; sys.exit(sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64")' \
    || { echo "image-check: the host venv is not CPython 3.11 on x86_64; pass --wheelhouse DIR made for it" >&2; exit 2; }
  "$HOST_PY" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/cpu.txt -r requirements/uv.txt -d "$WHEELHOUSE" 2>&1 | grep -v "^WARNING: Location" >&2 || true
elif [ ! -d "$WHEELHOUSE" ]; then
  echo "image-check: --wheelhouse $WHEELHOUSE is not a folder" >&2; exit 2
fi
missing="$("$HOST_PY" - "$WHEELHOUSE" requirements/cpu.txt requirements/uv.txt <<'PY'
import re, sys
from pathlib import Path
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = set()
for f in Path(sys.argv[1]).iterdir():
    if f.name.endswith(".whl"):  # name-version-python-abi-platform.whl
        name, version = f.name.split("-")[:2]
    else:  # an sdist: name-version.tar.gz
        name, _, version = re.sub(r"\.(tar\.gz|zip)$", "", f.name).rpartition("-")
    have.add((norm(name), version))
for lock in sys.argv[2:]:
    for name, version in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", Path(lock).read_text(), re.M):
        if (norm(name), version) not in have:
            print(f"{name}=={version}")
PY
)"
if [ -n "$missing" ]; then
  echo "image-check: the wheelhouse $WHEELHOUSE lacks $(echo "$missing" | head -n 3 | paste -sd, -)$( [ "$(echo "$missing" | wc -l)" -gt 3 ] && echo " and $(($(echo "$missing" | wc -l) - 3)) more"), pinned in requirements/cpu.txt or uv.txt (pip download -r requirements/cpu.txt -r requirements/uv.txt -d DIR)" >&2
  exit 2
fi
say "wheelhouse $WHEELHOUSE ($(ls "$WHEELHOUSE" | wc -l) files)"

# ---- the base: Debian 12 from mmdebstrap, cached as a tarball and as a podman image ------------
# (made after the wheelhouse: bad input is refused before minutes go into a base)
PACKAGES="ca-certificates,git,python3,python3-venv"
if [ -z "$BASE" ]; then  # no --base: the cached Debian base
  key="$(printf 'bookworm %s' "$PACKAGES" | sha256sum | cut -c1-12)"
  BASE="localhost/draftlab-base:bookworm-$key"
  tarball="$CACHE/base-bookworm-$key.tar"
  if ! "${PODMAN[@]}" image exists "$BASE"; then
    # a cached base that is not a tarball (a directory an earlier version of this script made) is remade
    [ -f "$tarball" ] || rm -rf "$tarball"
    if [ ! -s "$tarball" ]; then
      command -v mmdebstrap >/dev/null || { echo "image-check: mmdebstrap not found; install it (apt-get install mmdebstrap) or pass --base IMAGE" >&2; exit 3; }
      say "making the Debian 12 base with mmdebstrap (cached in $tarball)"
      # --format=tar: mmdebstrap picks the format from the name, and "*.tmp" would make a directory
      rm -rf "$tarball.tmp"
      mmdebstrap --quiet --format=tar --variant=apt --include="$PACKAGES" bookworm "$tarball.tmp" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
      mv "$tarball.tmp" "$tarball"
    fi
    "${PODMAN[@]}" import --quiet "$tarball" "$BASE" >/dev/null
  fi
fi
say "base $BASE"

# ---- fresh clones of HEAD: one for the build context and the host run, one for the container ----
WORK="$(mktemp -d /tmp/draftlab-image-check.XXXXXX)"
CONTAINERS=()
HOST_PID=""
cleanup() {
  if [ -n "$HOST_PID" ]; then kill -- "-$HOST_PID" 2>/dev/null || true; fi
  for c in "${CONTAINERS[@]}"; do "${PODMAN[@]}" rm -f "$c" >/dev/null 2>&1 || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
HEAD="$(git rev-parse HEAD)"
[ -z "$(git status --porcelain --untracked-files=no)" ] || say "note: uncommitted changes here are not checked; the clones are HEAD $HEAD"
git clone --quiet "$ROOT" "$WORK/host"
git clone --quiet "$ROOT" "$WORK/ctr"

# ---- build: cold (no layer cache), then again with the warm layer cache ----------------------------
build() {  # build [ARGS...]: sets CACHED, how many steps came from the layer cache
  "${PODMAN[@]}" build --format docker --network none --volume "$WHEELHOUSE:/wheelhouse:ro" \
    --build-arg IMAGE=cpu --build-arg CPU_BASE="$BASE" -t "$TAG" "$@" "$WORK/host" >"$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; fail "podman build failed (log above)"; }
  CACHED="$(grep -c '^--> Using cache' "$WORK/build.log" || true)"
  STEPS="$(grep -E 'STEP [0-9]+/[0-9]+: ' "$WORK/build.log" | grep -vcE 'STEP [0-9]+/[0-9]+: FROM ' || true)"
}
# A cold and a warm build. podman 4's `build --no-cache` commits no layers a later build can reuse,
# so where no layer is cached yet (a new host, CI) the first plain build is the cold one and the
# warm one reuses it; where layers are cached, the warm build comes first and a --no-cache build
# gives the cold figure (and is the image checked below).
say "building $TAG"
t0="$(now)"; build; t1="$(now)"
if [ "$CACHED" -eq 0 ]; then
  COLD_TEXT="$(secs "$t0" "$t1") s cold"
  t0="$(now)"; build; t1="$(now)"; BUILD_WARM="$(secs "$t0" "$t1")"
else
  [ "$CACHED" -eq "$STEPS" ] || { t0="$(now)"; build; t1="$(now)"; }  # some steps ran: now none does
  BUILD_WARM="$(secs "$t0" "$t1")"
  if [ "$COLD" = 1 ]; then
    t0="$(now)"; build --no-cache; t1="$(now)"; COLD_TEXT="$(secs "$t0" "$t1") s cold"
  else
    COLD_TEXT="cold not measured (layers cached, --no-cold-build)"
  fi
fi
SIZE_MB="$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$TAG" | awk '{ printf "%.0f", $1 / 1e6 }')"
say "built: ${COLD_TEXT}, ${BUILD_WARM} s warm; ${SIZE_MB} MB"

run() {  # run NAME ARGS...: the image as CHECK_UID on the container clone, no network
  local name="draftlab-check-$$-$1"; shift
  CONTAINERS+=("$name")
  "${PODMAN[@]}" run --name "$name" --network none --user "$CHECK_UID:$CHECK_UID" \
    -v "$WORK/ctr:/workspace" "$TAG" "$@"
}

# ---- dvc repro: host venv and container, side by side, same commit -------------------------------
# Side by side: each run is mostly one process at a time, so on 2 cores the two together take about
# one run's time instead of two, and their ratio compares runs that shared the host equally.
chown -R "$CHECK_UID:$CHECK_UID" "$WORK/ctr"
touch "$WORK/start-marker"
say "dvc repro on the host (venv) and in the image as uid $CHECK_UID, side by side"
t0="$(now)"
# in a session of its own, so that an interrupted check stops the whole run (cleanup)
(cd "$WORK/host" && exec setsid -w env -u MLFLOW_TRACKING_URI PATH="$ROOT/.venv/bin:$PATH" \
   PYTHONPATH="$WORK/host/src" HF_HUB_OFFLINE=1 WORK="$WORK" \
   bash -c 'dvc repro >"$WORK/host-repro.log" 2>&1; rc=$?; date +%s.%N >"$WORK/host-repro.end"; exit $rc') &
HOST_PID=$!
ctr_rc=0; run repro >"$WORK/ctr-repro.log" 2>&1 || ctr_rc=$?
t1="$(now)"; CTR_S="$(secs "$t0" "$t1")"
host_rc=0; wait "$HOST_PID" || host_rc=$?; HOST_PID=""
[ "$host_rc" -eq 0 ] || { tail -n 20 "$WORK/host-repro.log" >&2; fail "dvc repro on the host failed"; }
[ "$ctr_rc" -eq 0 ] || { tail -n 20 "$WORK/ctr-repro.log" >&2; fail "dvc repro in the image failed"; }
HOST_S="$(secs "$t0" "$(cat "$WORK/host-repro.end")")"
say "dvc repro: ${CTR_S} s in the image, ${HOST_S} s on the host, side by side"
# Every figure must be equal; the run's MLflow id and wall-clock times cannot be.
"$HOST_PY" - "$WORK/host/reports/metrics.json" "$WORK/ctr/reports/metrics.json" <<'PY' || fail "metrics differ"
import json, sys
host, ctr = (json.load(open(p)) for p in sys.argv[1:3])
own = lambda k: k == "run_id" or k.endswith("wall_clock_s")
keys = sorted(k for k in set(host) | set(ctr) if not own(k))
diff = {k: (host.get(k), ctr.get(k)) for k in keys if host.get(k) != ctr.get(k)}
if diff:
    sys.exit(f"image-check: FAIL: reports/metrics.json differs from the host's: {diff}")
shown = ", ".join(f"{k} {host[k]:.4g}" for k in keys if k.endswith("acc_len") and isinstance(host[k], float))
print(f"image-check: reports/metrics.json equals the host's in all {len(keys)} figures ({shown}; run_id and wall-clock aside)")
PY
# Nothing lands in the checkout that the host's run does not write (a HOME in /workspace would).
# --no-optional-locks: a root `git status` would otherwise refresh the clone's .git/index and own it
untracked() { git --no-optional-locks -c safe.directory='*' -C "$1" status --porcelain --untracked-files=all | sed -n 's/^?? //p' | sort; }
stray="$(comm -13 <(untracked "$WORK/host") <(untracked "$WORK/ctr") | head -n 5)"
[ -z "$stray" ] || fail "the image left files in the checkout that the host's run does not: $stray"
run repro2 dvc repro >"$WORK/ctr-repro2.log" 2>&1 || { tail -n 20 "$WORK/ctr-repro2.log" >&2; fail "the second dvc repro failed"; }
ran="$(sed -n "s/^Running stage '\([^']*\)'.*/\1/p" "$WORK/ctr-repro2.log" | paste -sd' ' -)"
[ -z "${ran// /}" ] || fail "the second dvc repro ran stages: $ran"
grep -q "Data and pipelines are up to date" "$WORK/ctr-repro2.log" || fail "the second dvc repro did not say the pipeline is up to date"
say "second dvc repro ran nothing: data and pipelines are up to date"

# ---- mlflow ui from the image, from the host: /health, and the run with its git tags --------------
port="$("$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
ui="draftlab-check-$$-ui"; CONTAINERS+=("$ui")
"${PODMAN[@]}" run -d --name "$ui" --user "$CHECK_UID:$CHECK_UID" -p "127.0.0.1:$port:5000" \
  -v "$WORK/ctr:/workspace" "$TAG" \
  mlflow ui --host 0.0.0.0 --port 5000 --backend-store-uri sqlite:////workspace/mlflow.db >/dev/null
"$HOST_PY" - "http://127.0.0.1:$port" "$HEAD" <<'PY' || { "${PODMAN[@]}" logs "$ui" 2>&1 | tail -n 15 >&2; fail "mlflow ui"; }
import json, sys, time, urllib.request
base, head = sys.argv[1:3]
deadline = time.monotonic() + 180
while True:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("image-check: FAIL: mlflow ui did not answer /health within 180 s")
    time.sleep(2)
def post(path, body):
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)
exps = [e["experiment_id"] for e in post("experiments/search", {"max_results": 100}).get("experiments", [])]
runs = post("runs/search", {"experiment_ids": exps, "max_results": 1000}).get("runs", [])
tagged = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
tagged = [t for t in tagged if "git.commit" in t]
if not tagged:
    sys.exit(f"image-check: FAIL: REST lists {len(runs)} run(s), none tagged git.commit")
bad = [t for t in tagged if t["git.commit"] != head or t.get("git.dirty") != "false"]
if bad:
    sys.exit(f"image-check: FAIL: runs tagged {[(t['git.commit'][:12], t.get('git.dirty')) for t in bad]}, want {head[:12]} / false")
print(f"image-check: mlflow ui /health ok; REST lists {len(runs)} run(s), {len(tagged)} tagged git.commit {head[:12]}, git.dirty false")
PY
"${PODMAN[@]}" rm -f "$ui" >/dev/null

# ---- a sweep in the image: a completed trial, and nothing left running ---------------------------
# experiments/sweep-tiny.yaml as users run it, at the shortest budget its calibration admits, ended
# after its two calibration trials and one search trial (the budget's own end is the suite's test)
SWEEP="draftlab sweep experiments/sweep-tiny.yaml --budget 3m --n-trials 3"
say "$SWEEP in the image"
run sweep bash -c "$SWEEP"'; rc=$?
  python - <<"PY"
import os
left = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
for p in left:
    print("left running:", open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
PY
  exit $rc' >"$WORK/sweep.log" 2>&1 || { tail -n 20 "$WORK/sweep.log" >&2; fail "the sweep in the image failed"; }
! grep -q '^left running:' "$WORK/sweep.log" || fail "processes left in the container: $(grep '^left running:' "$WORK/sweep.log" | head -n 3)"
! pgrep -f "$WORK/ctr" >/dev/null || fail "processes left on the host: $(pgrep -af "$WORK/ctr" | head -n 3)"
completed="$("$HOST_PY" - "$WORK/ctr/runs/sweeps" <<'PY'
import sys
from pathlib import Path
import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
optuna.logging.set_verbosity(optuna.logging.WARNING)
n = 0
for journal in Path(sys.argv[1]).glob("*/journal.log"):
    storage = JournalStorage(JournalFileBackend(str(journal)))
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        n += sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
print(n)
PY
)"
[ "${completed:-0}" -ge 1 ] || { tail -n 20 "$WORK/sweep.log" >&2; fail "the sweep completed no trial"; }
say "sweep: $completed completed trial(s); no process left in the container or on the host"

# ---- gpu-check in the image, on a host without a GPU --------------------------------------------
rc=0; run gpucheck scripts/gpu-check.sh --out reports/gpu-check.json >"$WORK/gpu-check.log" 2>&1 || rc=$?
[ "$rc" -eq 4 ] || { tail -n 20 "$WORK/gpu-check.log" >&2; fail "gpu-check.sh exited $rc, not 4 (no CUDA device)"; }
"$HOST_PY" - "$WORK/ctr/reports/gpu-check.json" <<'PY' || fail "gpu-check JSON"
import json, sys
steps = json.load(open(sys.argv[1]))["steps"]
bad = [s["name"] for s in steps if s["status"] != "skip" or not s["reason"]]
if not steps or bad:
    sys.exit(f"image-check: FAIL: gpu-check steps not skipped with a reason: {bad or 'none listed'}")
print(f"image-check: gpu-check skipped all {len(steps)} steps with reasons ({steps[0]['name']}: {steps[0]['reason']})")
PY

# ---- every file in the clone belongs to the uid --------------------------------------------------
foreign="$(find "$WORK/ctr" \( ! -uid "$CHECK_UID" -o ! -gid "$CHECK_UID" \) -print | head -n 5)"
[ -z "$foreign" ] || fail "files in the checkout not owned by $CHECK_UID:$CHECK_UID: $foreign"
written="$(find "$WORK/ctr" -newer "$WORK/start-marker" -type f | wc -l)"
say "all files in the checkout ($written written by the image) belong to $CHECK_UID:$CHECK_UID"

ratio="$(awk -v c="$CTR_S" -v h="$HOST_S" 'BEGIN { printf "%.2f", c / h }')"
say "PASS: build ${COLD_TEXT} / ${BUILD_WARM} s warm, image ${SIZE_MB} MB, dvc repro side by side ${CTR_S} s in the image / ${HOST_S} s on the host = ${ratio} (load $(cut -d' ' -f1-3 /proc/loadavg))"
