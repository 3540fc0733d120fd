#!/usr/bin/env bash
# One prepared run on a lent GPU machine (../shared/GPU.md), in one device call: the CUDA
# tests beside the rest of the suite (CPU-bound, on the other cores), then the CUDA benchmark
# alone (its times must not share the machine), then the example on CUDA. Each step has its
# own timeout and log under $LOGS; one summary line per step goes to $LOGS/summary.txt, so a
# run cut short still returns what it did (the benchmark writes its JSON after each workload).
# The GPU image's torch is older than the pin and has no package index: remat is copied into
# place, optree comes as a wheel from .whl/ (carry it).
#   device run: bash bench/gpu_check.sh [STEP...]   (timeout_s 500; logs to $OUT when set)
# Steps: cuda_tests and suite (side by side), bench_cuda, examples_cuda; without arguments
# all of them, in that order (at most 150 + 250 + 40 s of timeouts). The suite needs torch
# 2.13 (the image's 2.11 cannot run replayed regions); the CUDA tests and the benchmark run on 2.11.
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
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$LOGS/summary.txt" 2>&1

STEPS=${*:-cuda_tests suite bench_cuda examples_cuda}
selected() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
step() {  # step NAME SECONDS COMMAND...: run under a timeout, log, and summarise
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|wrote|Error" "$LOGS/$name.log" | tail -n 1)
  echo "$name: exit $rc in $((SECONDS - start)) s; $last" | tee -a "$LOGS/summary.txt"
}

PYTEST="python3 -P -m pytest -p no:cacheprovider -rfs"
# The CUDA tests (4 workers share the GPU) and beside them, when selected, the rest of the
# default set on 10 CPU workers; the suite leaves out the CUDA-only file.
if selected cuda_tests; then
  step cuda_tests 150 $PYTEST -n 4 --junitxml="$LOGS/junit-cuda.xml" tests/contract/test_cuda.py \
    tests/contract/test_offload.py tests/contract/test_layouts.py tests/contract/test_exactness.py \
    tests/contract/test_caching_and_errors.py -k "cuda or offload or layout or attention or autocast" &
fi
if selected suite; then
  step suite 150 $PYTEST -n 10 --junitxml="$LOGS/junit-suite.xml" --ignore=tests/contract/test_cuda.py &
fi
wait
if selected bench_cuda; then
  step bench_cuda 250 python3 bench/bench_remat.py --size cuda --device cuda --repeats 5 --warmup 1 \
    --workloads gpt_sdpa gpt_matmul mlp --out "$LOGS/results-cuda.json"
fi
if selected examples_cuda; then
  step examples_cuda 40 python3 examples/gpt.py --device cuda --steps 20 --seq 256 --compare
fi
cat "$LOGS/summary.txt"
