#!/usr/bin/env bash
# One prepared run on a lent GPU machine (../shared/GPU.md): the CUDA tests first, then the
# whole suite, then the CUDA benchmark, then the examples on CUDA. Each step has its own
# timeout and log under $LOGS; one summary line per step goes to $LOGS/summary.txt, so a run
# cut short still returns what it did. The GPU image's torch is older than the pin and has
# no package index: remat is copied into place, optree comes as a wheel from .whl/.
#   device run: bash bench/gpu_check.sh [STEP...]   (carry .whl; logs to $OUT when set)
# The device runs one command for at most 600 s and lends a session 900 s in all, its
# start (1-2 min) included, so the four steps (1,050 s of timeouts) do not fit one call:
#   call 1: bash bench/gpu_check.sh cuda_tests suite        (correctness: at most 540 s)
#   call 2: bash bench/gpu_check.sh bench_cuda examples_cuda (measurements: at most 510 s)
# Without arguments every step runs, in that order.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-bench/gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
if ! python3 -c 'import optree' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
rm -rf /tmp/pkgs && mkdir -p /tmp/pkgs && cp -r remat /tmp/pkgs/remat && cp -r policies /tmp/pkgs/remat/policies
export PYTHONPATH=/tmp/pkgs${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch, remat; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")' | tee "$LOGS/summary.txt"

STEPS=${*:-cuda_tests suite bench_cuda examples_cuda}
step() {  # step NAME SECONDS COMMAND...: run under a timeout, log, and summarise (if selected)
  local name=$1 seconds=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS
  timeout "$seconds" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|wrote|Error" "$LOGS/$name.log" | tail -n 1)
  echo "$name: exit $rc in $((SECONDS - start)) s; $last" | tee -a "$LOGS/summary.txt"
}

PYTEST="python3 -P -m pytest -p no:cacheprovider -rf"
step cuda_tests 180 $PYTEST --junitxml="$LOGS/junit-cuda.xml" tests/contract/test_cuda.py tests/contract/test_layouts.py \
  tests/contract/test_exactness.py tests/contract/test_caching_and_errors.py -k "cuda or layout or attention or autocast"
step suite 360 $PYTEST --junitxml="$LOGS/junit-suite.xml" -m "not opinfo" --maxfail=20
step bench_cuda 420 python3 bench/bench_remat.py --size cuda --device cuda --repeats 3 --warmup 1 \
  --out "$LOGS/results-cuda.json"
step examples_cuda 90 python3 examples/gpt.py --device cuda --steps 20 --seq 256 --compare
cp "$LOGS/results-cuda.json" bench/results-cuda.json 2>/dev/null && \
  python3 bench/bench_remat.py --from-json bench/results-cpu.json bench/results-cuda.json --markdown "$LOGS/RESULTS.md" \
  >> "$LOGS/summary.txt" 2>&1
cat "$LOGS/summary.txt"
