#!/usr/bin/env bash
# The round's GPU checks, one script for one lent GPU (the device tool's 15 minutes): the GPU
# tests, the 8B BAdam run against its plan, the planner against real CUDA steps, an FSDP2
# BAdam step, and the quick bench on CUDA. Each part writes under $OUT (or gradgate-out/gpu)
# and has its own time limit, so one slow part does not cost the others:
#
#     OUT=gradgate-out/gpu bash tools/gpu_checks.sh
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-gradgate-out/gpu}"
mkdir -p "$OUT"
part() {  # part NAME SECONDS COMMAND...: run it, log it, say how it ended and how long it took
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/summary.txt"
part badam_8b 200 python3 tools/badam_8b.py --out "$OUT/badam_8b.json"
part estimate_vs_cuda 200 python3 tools/estimate_vs_cuda.py --json "$OUT/estimate_vs_cuda.json"
part gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/test_audit.py tests/test_mixed.py tests/test_report.py -k "gpu or cuda"
part bench 150 python3 -m gradgate._bench --device cuda --amp bf16 --quick --no-progress \
    --no-plot --json "$OUT/bench.json"
