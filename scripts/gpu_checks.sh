#!/usr/bin/env bash
# What to run on a CUDA machine (CI has none): the `gpu`-marked tests, then issue 21's decode benchmark with
# its profile, then every geometry at its defaults (the families' compiled steps, two 7B layers). Each part has
# its own time limit, so a slow part cannot keep the others from printing; every log and record goes to $OUT.
#
#   scripts/gpu_checks.sh [PYTHON]          # PYTHON: default .venv/bin/python if present, else python3
#
# PYTHON needs torch with CUDA: `scripts/setup.sh`'s venv, or an image's own python (the GPU image's python3 holds
# the tests' imports: pytest, numpy, safetensors, tokenizers, transformers, peft, triton). Where the project is not
# installed, the script puts this tree on PYTHONPATH itself.
#
# OUT (default results/gpu) receives tests.log, bench_fast_7b.{json,png,profile.txt,log}, bench_fast_steps.*,
# bench_serve.*. TESTS_S, BENCH_S, STEPS_S, SERVE_S: the parts' limits in seconds (defaults 180, 300, 100, 300).
# GPU_TESTS: the test paths / -k expression for the tests part (default: tests, every `gpu` case; on an H200 with
# torch 2.11 each compiled-session case compiles its own graphs, ~45 s apiece, so the whole set outruns 180 s).
# SERVE_ARGS: more bench_serve.py arguments (e.g. "--compile default": a third server, compiled sessions one robot at
# a time, beside the eager batched one; "--clients 1 8" replaces the default counts). With "--compile reduce-overhead"
# the robots' sessions alternate over shared CUDA graphs whose static inputs (their caches) change: torch re-records.
# BENCH_ARGS: more bench_fast.py arguments for the 7B part (e.g. "--quantized": bf16 and fused rows, no int8/int4: ~130 s less).
# PARTS: which parts, in order (default "tests bench_fast_7b bench_fast_steps": under 10 minutes, one device call;
# "serve" is issue 19's load benchmark on the GPU, for a second call). The 7B bench compiles three 32-layer
# variants (bf16, int8, int4): about 230 s on 16 cores with torch 2.11. Test modules whose imports the machine
# lacks (a GPU image without the ROS or serve extras) are reported and skipped. The serve part installs
# openpi-client, websockets and msgpack from wheels in .device/wheels (carried; `pip download` them here) when
# the image lacks them.
set -uo pipefail

cd "$(dirname "$0")/.."
python=${1:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_checks: torch sees no CUDA device')" || exit 2
if ! "$python" -c "import vla_runtime, vla_kernels, vla_finetune" 2>/dev/null; then  # not installed: the tree itself
    site=$(mktemp -d)  # pyproject maps vla_kernels to kernels/vla_kernels/ and vla_finetune to finetune/
    ln -s "$PWD/kernels/vla_kernels" "$site/vla_kernels" && ln -s "$PWD/finetune" "$site/vla_finetune"
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"

part() {  # part NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S, log to $OUT/NAME.log, print its tail and status
    local name=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "gpu_checks: $name exited $rc after $(( $(date +%s) - start )) s (limit $limit s)"
}

serve_deps() {  # openpi's client and the server's wire, from the carried wheels when the image lacks them
    "$python" -c "import openpi_client, websockets, msgpack" 2>/dev/null \
        || "$python" -m pip install -q --no-deps --no-index .device/wheels/*.whl
}

for name in ${PARTS:-tests bench_fast_7b bench_fast_steps}; do
    case $name in
    tests) part tests "${TESTS_S:-180}" "$python" -m pytest -m gpu -rA -p no:cacheprovider --continue-on-collection-errors ${GPU_TESTS:-tests} ;;
    bench_fast_7b) part bench_fast_7b "${BENCH_S:-300}" "$python" benchmarks/bench_fast.py --device cuda --geometry 7b-layer \
        --layers 32 --context 290 --repeats 50 --profile 20 ${BENCH_ARGS:-} --out "$OUT/bench_fast_7b" ;;
    bench_fast_steps) part bench_fast_steps "${STEPS_S:-100}" "$python" benchmarks/bench_fast.py --device cuda --geometry all \
        --repeats 50 --out "$OUT/bench_fast_steps" ;;
    serve) serve_deps && part bench_serve "${SERVE_S:-300}" "$python" benchmarks/bench_serve.py --device cuda --repeats 3 \
        --clients 1 2 4 8 ${SERVE_ARGS:-} --out "$OUT/bench_serve.json" ;;
    *) echo "gpu_checks: unknown part '$name' (tests, bench_fast_7b, bench_fast_steps, serve)" >&2; exit 2 ;;
    esac
done
