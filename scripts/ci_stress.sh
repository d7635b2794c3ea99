#!/usr/bin/env bash
# Run the README's test command N times, each in a fresh clone of this checkout's HEAD, optionally beside K
# CPU-burning processes, and print one line per run: pass/fail, wall time, the failed tests.
#
#   scripts/ci_stress.sh N [--load K] [--fresh-venv] [--keep] [-- PYTEST_ARGS...]
#
# --load K       K busy-looping processes run beside each test run (a loaded CI runner)
# --fresh-venv   set up every clone from scratch (default: the first run sets up .venv, later clones reuse it
#                at the same path, so each run tests the sources of a fresh clone, not pip's download speed)
# --keep         keep the work directory (logs of every run) instead of only the failed runs' logs
# -- ARGS        run `.venv/bin/python -m pytest ARGS` instead of `make test` (e.g. one test folder, looped)
#
# Exit status: 0 when every run passed. Logs: $STRESS_DIR (default a new directory under /tmp).
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
runs=$1; shift
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "ci_stress: N must be a positive integer, got '$runs'" >&2; exit 2; }
load=0 fresh=0 keep=0 pytest_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --load) [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "ci_stress: --load needs a number of processes" >&2; exit 2; }
                load=$2; shift 2 ;;
        --fresh-venv) fresh=1; shift ;;
        --keep) keep=1; shift ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "ci_stress: unknown option '$1'" >&2; usage ;;
    esac
done

src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
head=$(git -C "$src" rev-parse --short HEAD)
work=${STRESS_DIR:-$(mktemp -d /tmp/ci-stress.XXXXXX)}
mkdir -p "$work"
clone="$work/repo"  # every run clones here: a reused .venv's editable install points at this path
burners=()
stop_load() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done; burners=(); }
trap 'stop_load' EXIT

if [ ${#pytest_args[@]} -gt 0 ]; then what="pytest ${pytest_args[*]}"; else what="make test"; fi
echo "ci_stress: $runs run(s) of '$what' at $head, load $load, logs in $work"
passed=0
min_free_gb=${STRESS_MIN_FREE_GB:-6}  # a run's clone, test temp files and (first run) the .venv
for i in $(seq 1 "$runs"); do
    free_gb=$(df -Pk "$work" | awk 'NR == 2 { print int($4 / 1048576) }')
    if [ "$free_gb" -lt "$min_free_gb" ]; then  # a full disk fails tests for no reason of theirs
        echo "ci_stress: only $free_gb GB free under $work (a run needs about $min_free_gb); stopping before run $i" >&2
        break
    fi
    if [ -d "$clone/.venv" ] && [ $fresh = 0 ]; then mv "$clone/.venv" "$work/venv.keep"; fi
    rm -rf "$clone"
    git clone -q "$src" "$clone"
    git -C "$clone" checkout -q "$head"
    if [ -d "$work/venv.keep" ]; then mv "$work/venv.keep" "$clone/.venv"; fi
    for _ in $(seq 1 "$load"); do (while :; do :; done) & burners+=($!); done
    log="$work/run-$i.log"
    start=$(date +%s)
    set +e
    if [ ${#pytest_args[@]} -gt 0 ]; then
        (cd "$clone" && make -s setup && CI=true .venv/bin/python -m pytest -q -p no:cacheprovider "${pytest_args[@]}") >"$log" 2>&1
    else
        (cd "$clone" && CI=true make test) >"$log" 2>&1
    fi
    code=$?
    set -e
    stop_load
    seconds=$(( $(date +%s) - start ))
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$log" | tail -n 1 | tr -d '=' | xargs)
    if [ $code = 0 ]; then
        passed=$((passed + 1))
        printf 'run %d/%d: PASS  %4d s  %s\n' "$i" "$runs" "$seconds" "$summary"
        [ $keep = 1 ] || rm -f "$log"
    else
        failed=$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' | sort -u | tr '\n' ' ')
        printf 'run %d/%d: FAIL  %4d s  %s  exit %d  failed: %s (log %s)\n' "$i" "$runs" "$seconds" "$summary" "$code" \
            "${failed:-none listed}" "$log"
    fi
done
echo "ci_stress: $passed of $runs runs passed"
[ $keep = 1 ] || [ $passed != "$runs" ] || rm -rf "$work"
[ $passed = "$runs" ]
