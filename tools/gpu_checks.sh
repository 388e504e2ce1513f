#!/usr/bin/env bash
# The round's GPU checks as one script for one lent GPU (the device tool's 15 minutes): the 8B
# BAdam run against its plan, the planner against real CUDA steps, an FSDP2 BAdam step, the GPU
# tests, then the quick bench on CUDA. The memory checks run side by side (each process's
# torch.cuda peak is its own); the bench, which times steps, runs alone after them. Each part
# logs under $OUT with its own time limit, so one slow part costs the others nothing:
#
#     OUT=gradgate-out/gpu bash tools/gpu_checks.sh          # on the GPU machine
#     TINY=1 OUT=gradgate-out/gpu bash tools/gpu_checks.sh   # the same parts, tiny, on a CPU
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-gradgate-out/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
part() {  # part NAME SECONDS COMMAND...: run it, log it, say how it ended and how long it took
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s" >>"$OUT/summary.txt"
}
if [ -n "${TINY:-}" ]; then
    badam=(--tiny) estimate=(--device cpu --small) fsdp=(--tiny) bench=(--tiny --device cpu)
    cache=(--tiny --device cpu)
    tests=(-k "not gpu and not cuda" tests/test_mixed.py)
else
    badam=() estimate=() fsdp=(--checkpointing) bench=(--quick --device cuda --amp bf16)
    cache=(--quick --device cuda)
    tests=(-k "gpu or cuda" tests/test_audit.py tests/test_mixed.py tests/test_report.py)
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/summary.txt"
part badam_8b 330 "$PY" tools/badam_8b.py "${badam[@]}" --out "$OUT/badam_8b.json" &
part estimate_vs_cuda 330 "$PY" tools/estimate_vs_cuda.py "${estimate[@]}" --json "$OUT/estimate_vs_cuda.json" &
part fsdp2_step 240 "$PY" tools/fsdp2_badam_step.py "${fsdp[@]}" &
part gpu_tests 240 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" &
wait
part bench 150 "$PY" -m gradgate._bench "${bench[@]}" --no-progress --no-plot --json "$OUT/bench.json"
part prefix_cache 90 "$PY" -m gradgate._bench.sections.prefix_cache "${cache[@]}"
cat "$OUT/summary.txt"
for log in "$OUT"/*.log; do echo "---- $log"; tail -n 30 "$log"; done
