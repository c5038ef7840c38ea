#!/usr/bin/env bash
# Issue 31's GPU goals in one go on a lent GPU machine (about 6-8 minutes on an H200):
#   1. the GPU tests (CUDA provider, bound buffers, CUDA graphs), skipped parts named;
#   2. l(b) of ResNet50 fp32 and fp16 in each CUDA mode (iobinding, bound, graph, TensorRT where
#      ONNX Runtime offers it), every answer checked against the CPU provider (gpu_modes.py);
#   3. live one-GPU clusters (`zserve demo`: answers checked against the CPU provider, then the
#      goodput search): ResNet50 fp32 at a 50 ms SLO, fp16 at 50 ms, fp32 at 15 ms (MLPerf's
#      server bound), uint8 inputs at 50 ms; GPU busy sampled by nvidia-smi meanwhile.
# Everything lands in $OUT (or ./gpu-check-out): summary.txt, modes-*.json, live-*.txt, gpu-*.csv.
# A smoke run of the script's own steps on a CPU host: DEVICE=cpu (the built-in cnn stands in for
# ResNet50, its float16-input rewrite for the fp16 model; no figure of it means anything).
#
# Run from the repository root, on the device machine:
#   run(command="bash backends/bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# The image there has PyTorch, torchvision, onnx and CuPy but not onnxruntime-gpu, pyzmq,
# msgspec, httptools or highspy: put their wheels in .whl first (docs/performance.md, "On a
# GPU", says how); they are installed into /tmp/site ahead of the image's CPU onnxruntime.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/zserve-gpu-check.XXXXXX)
SUMMARY="$OUT/summary.txt"
GOODPUT_S=${GOODPUT_S:-12}
LIVE_IO=${LIVE_IO:-iobinding}  # [backends] onnx_io of the live clusters (after the modes: the best)
DEVICE=${DEVICE:-cuda}
EXEC_DEVICE=$([[ $DEVICE == cpu ]] && echo cpu || echo cuda:0)
# Every step's timeout is cut to what is left of this, so the whole script ends within it.
BUDGET_S=${BUDGET_S:-470}
export PYTHONUNBUFFERED=1 ZSERVE_CACHE_DIR="$WORK/cache"
log() { echo "[$(date +%T)] $*" | tee -a "$SUMMARY"; }
within() {  # SECONDS_WANTED: prints min(wanted, left); fails when under 20 s are left
  local left=$((BUDGET_S - SECONDS)) want=$1
  ((left < 20)) && { log "out of time: skipped"; return 1; }
  echo $((want < left ? want : left))
}

# -- Python: carried wheels first, then the repository laid out as the installed package.
if compgen -G ".whl/*.whl" >/dev/null; then  # (still in the repository root)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
LAYOUT="$WORK/layout"
mkdir -p "$LAYOUT/zserve"
for f in "$PWD"/zserve/*; do ln -s "$f" "$LAYOUT/zserve/$(basename "$f")"; done
for d in transport scheduler backends loadgen; do ln -s "$PWD/$d" "$LAYOUT/zserve/$d"; done
export PYTHONPATH="$LAYOUT${PYTHONPATH:+:$PYTHONPATH}"
ZSERVE=(python3 -m zserve.cli)
# Python runs from $WORK: in the repository root its zserve/ folder would shadow the layout.
REPO=$PWD
cd "$WORK" || exit 1

log "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null || echo "no nvidia-smi") $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import onnxruntime as ort, zmq, msgspec
print("onnxruntime", ort.__version__, ort.get_available_providers(), "pyzmq", zmq.__version__)
try:
    import cupy; print("cupy", cupy.__version__, cupy.cuda.runtime.getDeviceCount(), "device(s)")
except Exception as exc: print("cupy: none", exc)
EOF
[[ $DEVICE == cpu ]] \
  || python3 -c 'import onnxruntime as o; assert "CUDAExecutionProvider" in o.get_available_providers()' \
  || { log "no CUDAExecutionProvider: carry onnxruntime-gpu in .whl"; exit 1; }

# -- 1. the GPU tests
log "GPU tests"
t=$(within 100) && timeout "$t" python3 -P -m pytest -q -p no:cacheprovider -o addopts="" \
  "$REPO/tests/unit/test_backend_gpu.py" "$REPO/tests/unit/test_backend_onnx_binding.py" 2>&1 \
  | tail -5 | tee -a "$SUMMARY"

# -- 2. ResNet50 (torchvision, random weights, dynamic batch) as fp32, fp16 and uint8 inputs
log "exporting ResNet50"
if [[ $DEVICE == cpu ]]; then
  cp "$("${ZSERVE[@]}" models path cnn)" "$WORK/r50.onnx"
  "${ZSERVE[@]}" models narrow "$WORK/r50.onnx" "$WORK/r50-f16.onnx" --input float16 >/dev/null
else python3 - "$WORK" <<'EOF' 2>&1 | tail -3 | tee -a "$SUMMARY"
import sys, torch, torchvision
work = sys.argv[1]
def export(model, x, path):
    kwargs = dict(input_names=["input"], output_names=["logits"], opset_version=17,
                  dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}})
    try:
        torch.onnx.export(model, x, path, dynamo=False, **kwargs)
    except TypeError:  # a torch without the dynamo switch
        torch.onnx.export(model, x, path, **kwargs)
torch.manual_seed(0)
model = torchvision.models.resnet50(weights=None).eval()
export(model, torch.randn(1, 3, 224, 224), f"{work}/r50.onnx")
export(model.half().cuda(), torch.randn(1, 3, 224, 224).half().cuda(), f"{work}/r50-f16.onnx")
print("exported", work)
EOF
fi
"${ZSERVE[@]}" models narrow "$WORK/r50.onnx" "$WORK/r50-u8.onnx" --input uint8 >/dev/null \
  || log "narrow failed"

log "l(b) per CUDA mode (ms; error: fraction of the CPU provider allowance, <= 1 passes)"
t=$(within 100) && timeout "$t" python3 -m zserve.backends.bench.gpu_modes "$WORK/r50.onnx" --repeats 20 \
  --device "$EXEC_DEVICE" > "$OUT/modes-fp32.json" 2>>"$OUT/modes.err"
t=$(within 100) && timeout "$t" python3 -m zserve.backends.bench.gpu_modes "$WORK/r50-f16.onnx" \
  --reference "$WORK/r50.onnx" --repeats 20 --modes iobinding,bound,graph,tensorrt \
  --device "$EXEC_DEVICE" \
  > "$OUT/modes-fp16.json" 2>>"$OUT/modes.err"
python3 - "$OUT" <<'EOF' | tee -a "$SUMMARY"
import json, sys
for name in ("fp32", "fp16"):
    try:
        data = json.load(open(f"{sys.argv[1]}/modes-{name}.json"))
    except Exception as exc:
        print(name, "no result:", exc); continue
    for mode, row in data.items():
        if isinstance(row, dict):
            print(f"{name:5} {mode:10}", row.get("error") or
                  "  ".join(f"b{b}: {v['ms']} ms (err {v['error']})" for b, v in row.items()))
EOF

# -- 3. live clusters on the GPU: one backend, one frontend
cluster() {  # NAME ONNX SLO_MS D_DATA_MS
  cat > "$WORK/$1.toml" <<EOF
[cluster]
name = "$1"
drain_s = 5.0
[scheduler]
shards = 0
policy = "deferred"
jitter_ms = 1.0
d_ctrl_ms = 2.0
[frontends]
count = 1
reply_allowance_ms = 3.0
[backends]
count = 1
device = "$DEVICE"
onnx_io = "$LIVE_IO"
[[models]]
name = "r50"
onnx = "$2"
slo_ms = $3
max_batch = 32
d_data_ms = $4
EOF
  echo "$WORK/$1.toml"
}
live() {  # NAME ONNX SLO_MS D_DATA_MS
  local toml t; toml=$(cluster "$@")
  t=$(within 100) || return
  nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 500 \
    > "$OUT/gpu-$1.csv" 2>/dev/null & local smi=$!
  timeout "$t" "${ZSERVE[@]}" demo --config "$toml" --requests 200 --goodput-s "$GOODPUT_S" \
    --stats > "$OUT/live-$1.txt" 2>&1
  local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  local busy; busy=$(awk -F', ' '{gsub(/ %/,"",$2); if ($2 > 0) {s += $2; n++}}
                     END {if (n) printf "%.2f", s / n / 100; else print "?"}' "$OUT/gpu-$1.csv")
  log "live $1, onnx_io $LIVE_IO (exit $rc; nvidia-smi busy while serving: $busy):"
  grep -E "^zserve demo: (goodput|FAIL|[0-9]+ lone|burst)|^ +at that rate" \
    "$OUT/live-$1.txt" | tail -6 \
    | tee -a "$SUMMARY"
}
live r50-fp32-slo50 "$WORK/r50.onnx" 50 0.5
live r50-fp16-slo50 "$WORK/r50-f16.onnx" 50 0.3
live r50-fp32-slo15 "$WORK/r50.onnx" 15 0.5
live r50-u8-slo50 "$WORK/r50-u8.onnx" 50 0.15
log "done; files in $OUT"
