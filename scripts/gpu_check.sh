#!/usr/bin/env bash
# The GPU check in one command (docs/reproduction.md, "GPU reproduction"):
#
#   bash scripts/gpu_check.sh [--out DIR]
#
# on the GPU machine, in a checkout with gpu-kit/ in it (`make gpu-kit` beforehand; git
# ignores gpu-kit/, so whatever copies the checkout there must take it along). It checks the
# kit's digests, installs its wheels into a target folder (pip --no-index --no-deps) put on
# PYTHONPATH, prints the machine, then runs experiments.gpu_check: the CUDA tests, the TTFT
# rows (OPT-6.7B, 13B, then 30B) and the planner's GPU cells, every step ended by 8 min 45 s
# after this script started, results written to DIR as they land (gpu_check.json,
# gpu_check.md, gpu_repro.png, planner_gpu.png, and everything printed in gpu_check.log).
# DIR: --out, else $OUT when set, else results/gpu_check.
#
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh [--out DIR]
#
# proves that it starts, on any CPU machine: the same script in a fresh venv holding only the
# image's packages (scripts/gpu_image.txt), the kit installed beside them the same way, every
# step run with tiny models (DIR default: build/gpu_check_dry). GPU_CHECK_VENV=DIR keeps and
# reuses that venv; GPU_KIT=DIR names another kit; GPU_CHECK_WORK=DIR the scratch folder
# (default build/gpu_check: the installed wheels, caches, and the stores, removed at the end).
# Exit status 0 when every step finished and no test failed (on the GPU a step stopped at
# its time limit also counts: its rows stand).
set -uo pipefail

START=$(date +%s)
LIMIT_S=540                      # nothing runs past 9 minutes after START
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
KIT=${GPU_KIT:-$ROOT/gpu-kit}
DRY=${GPU_CHECK_DRY:-0}
WORK=${GPU_CHECK_WORK:-$ROOT/build/gpu_check}   # the wheels installed, caches, the stores

out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a directory" >&2; exit 2; }
           out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (usage: bash scripts/gpu_check.sh [--out DIR])" >&2
       exit 2 ;;
  esac
done
if [ -z "$out" ]; then
  if [ "$DRY" = 1 ]; then out=$ROOT/build/gpu_check_dry; else out=${OUT:-$ROOT/results/gpu_check}; fi
fi
if [ ! -f "$KIT/SHA256SUMS" ]; then
  echo "gpu_check.sh: no kit in $KIT: run 'make gpu-kit' first (and carry gpu-kit/ to the device)" >&2
  exit 2
fi

# The dry run: a venv of the image's packages, then this script again inside it.
if [ "$DRY" = 1 ] && [ -z "${GPU_CHECK_PYTHON:-}" ]; then
  venv=${GPU_CHECK_VENV:-}
  keep=1
  if [ -z "$venv" ]; then
    venv=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-venv.XXXXXX") || exit 1
    keep=0
  fi
  trap '[ "$keep" = 1 ] || rm -rf "$venv"' EXIT
  t0=$(date +%s)
  if [ ! -x "$venv/bin/python" ] || ! cmp -s scripts/gpu_image.txt "$venv/.gpu_image.txt"; then
    echo "gpu_check.sh (dry): building a venv of the image's packages in $venv"
    python3 -m venv --clear "$venv" || exit 1
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -r scripts/gpu_image.txt 2>&1 | grep -v "is ignored: it is neither a file"
    [ "${PIPESTATUS[0]}" = 0 ] ||
      { echo "gpu_check.sh: cannot install the image's packages in $venv" >&2; exit 1; }
    cp scripts/gpu_image.txt "$venv/.gpu_image.txt"
  fi
  if "$venv/bin/python" -c "import flexgen" 2>/dev/null; then
    echo "gpu_check.sh: $venv holds flexgen: not the image's packages alone" >&2
    exit 1
  fi
  echo "gpu_check.sh (dry): the image's venv ready in $(( $(date +%s) - t0 )) s"
  GPU_CHECK_PYTHON=$venv/bin/python bash "$0" --out "$out"
  exit $?
fi
PY=${GPU_CHECK_PYTHON:-python3}

check() {
  echo "== kit: $KIT ($(du -sk "$KIT" | cut -f1) KiB)"
  (cd "$KIT" && sha256sum --quiet -c SHA256SUMS) ||
    { echo "gpu_check.sh: the kit does not match its SHA256SUMS: run 'make gpu-kit' again" >&2; return 2; }
  local site=$WORK/site
  rm -rf "$site"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$site" "$KIT"/wheels/*.whl ||
    { echo "gpu_check.sh: cannot install the kit's wheels" >&2; return 1; }
  export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export IMPRESS_FLEXGEN_TOKENIZER=$KIT/tokenizer
  export IMPRESS_FLEXGEN_CACHE=$WORK/cache
  export PYTHONUNBUFFERED=1

  echo "== machine ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: none here"; fi
  "$PY" -c 'import sys, torch; print("Python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| CUDA available:", torch.cuda.is_available())'
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //') x $(nproc)"
  free -g 2>/dev/null | head -2
  mkdir -p "$WORK" && df -h "$WORK" | tail -1

  local left=$(( LIMIT_S - ($(date +%s) - START) ))
  local dry=()
  [ "$DRY" = 1 ] && dry=(--dry)
  # The check ends its steps by itself (8 min 45 s); this is the backstop.
  timeout -k 15 "$left" "$PY" -m experiments.gpu_check --out "$out" --kit "$KIT" \
      --work "$WORK/run" --started-at "$START" "${dry[@]}"
}

mkdir -p "$out" || exit 2
check 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
