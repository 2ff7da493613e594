#!/usr/bin/env bash
# Set up (once) and run semoe from a fresh clone.
#   bash tools/run.sh demo [ARGS]   the main job on its embedded default
#   bash tools/run.sh test [ARGS]   the test suite (pytest ARGS); under CI=true the slow tests first,
#                                   which fail the run if they fail or outlast SEMOE_SLOW_BUDGET_S seconds
#   bash tools/run.sh semoe ARGS    any semoe command
# The virtual environment lives in .venv (override with SEMOE_VENV); the package is reinstalled
# (and its CPU kernels rebuilt) when setup.py, semoe/kernels/variants.py or semoe/kernels/* change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SEMOE_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "semoe: creating virtual environment in $venv" >&2
  "$py" -m venv "$venv"
fi
# rebuilt when setup.py or the compiled kernels' sources change
stamp="$venv/.semoe-setup-$(cat "$root/setup.py" "$root/semoe/kernels/variants.py" "$root"/semoe/kernels/*.[ch] \
  | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "semoe: installing torch==2.13.0 and the package (first run only)" >&2
  log="$venv/semoe-install.log"
  if ! { "$venv/bin/python" -m pip install --disable-pip-version-check "torch==2.13.0" &&
         # -v: the package's build says in one line whether its compiled kernels are off, and why
         "$venv/bin/python" -m pip install -v --disable-pip-version-check -e "$root[test]" &&
         # fairscale is unmaintained: a test reference for gating only, installed without its dependencies
         "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps "fairscale==0.4.13"; } >"$log" 2>&1
  then
    tail -n 30 "$log" >&2
    echo "semoe: the install failed; its whole log is $log" >&2
    exit 1
  fi
  grep -o "semoe: \(compiled CPU kernels are off\|the semoe\.kernels\._kernels.* kernels were not built\).*" "$log" >&2 || true
  rm -f "$venv"/.semoe-setup-*
  touch "$stamp"
fi

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo) exec "$venv/bin/semoe" demo "$@" ;;
  test)
    cd "$root"
    if [ $# -gt 0 ] || [ "${CI:-}" != "true" ]; then
      exec "$venv/bin/python" -m pytest "$@"
    fi
    # CI: the slow-marked runs within a time budget, then the default suite (whose summary
    # closes the log)
    slow=0
    timeout "${SEMOE_SLOW_BUDGET_S:-3600}" "$venv/bin/python" -m pytest -m slow || slow=$?
    case $slow in
      0|5) slow=0 ;;  # 5: no slow tests collected
      124) echo "semoe: slow tests did not finish within ${SEMOE_SLOW_BUDGET_S:-3600} s: a failure" >&2 ;;
    esac
    "$venv/bin/python" -m pytest
    exit $slow
    ;;
  semoe) exec "$venv/bin/semoe" "$@" ;;
  *) echo "usage: bash tools/run.sh demo|test|semoe [ARGS]" >&2; exit 2 ;;
esac
