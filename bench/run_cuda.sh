#!/usr/bin/env bash
# Run the CUDA-size benchmark on one large GPU (80+ GiB) and regenerate bench/RESULTS.md
# from every result file present. Needs a CUDA build of torch 2.13 in .venv (see README,
# "Installing with CUDA"). Extra arguments go to the benchmark, e.g. --repeats 5.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "run_cuda.sh: no CUDA device visible to torch")'
"$PY" bench/bench_remat.py --size cuda --device cuda --out bench/results-cuda.json "$@"
jsons=(bench/results-cpu.json bench/results-cuda.json)
existing=()
for f in "${jsons[@]}"; do [[ -f $f ]] && existing+=("$f"); done
"$PY" bench/bench_remat.py --from-json "${existing[@]}" --markdown bench/RESULTS.md
echo "wrote bench/results-cuda.json and bench/RESULTS.md"
