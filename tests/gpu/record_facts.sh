#!/usr/bin/env bash
# Record probe facts on a machine with one NVIDIA GPU, for tests/fixtures/facts/.
#
#   OUT=/path/for/files bash tests/gpu/record_facts.sh        (any working directory)
#   PYTHON=.venv/bin/python OUT=$(mktemp -d) bash tests/gpu/record_facts.sh   (dry run, no GPU)
#
# Writes at most 4 files to $OUT:
#   h200_1rank.json            every probe, 1 rank (healthy single GPU)
#   h200_2ranks_one_gpu.json   launch_env, devices, set_device_order, backend with
#                              2 ranks on the one GPU (CUDA_VISIBLE_DEVICES=0): what
#                              NCCL does with two ranks on one device, per variant
#   nvidia_smi.txt             nvidia-smi, topo -m and the head of -q
#   summary.txt                every cause's verdict per scenario, expectations checked
# Every step has its own timeout (SIGINT first, so the runner kills its torchrun
# processes); the whole script ends within 5 minutes. Without a GPU the probes
# report "not applicable" and the files are still written.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:?set OUT to the folder for the recorded files}
mkdir -p "$OUT"
export PYTHONPATH=.

step() {  # step SECONDS COMMAND...: run with a time limit, report, never abort the script
    local limit=$1
    shift
    echo "== $(date +%T) (limit ${limit}s) $*"
    timeout -s INT -k 15 "$limit" "$@"
    echo "   exit code $?"
}

started=$(date +%s)

step 125 "$PY" tests/gpu/record_facts.py record --scenario h200_1rank --nproc 1 \
    --timeout 60 --probe-timeout 30 --out "$OUT/h200_1rank.json" \
    --description "One NVIDIA H200, 1 rank, torch from the machine's python3: every probe"

step 145 "$PY" tests/gpu/record_facts.py record --scenario h200_2ranks_one_gpu --nproc 2 \
    --visible 0 --timeout 45 --probe-timeout 20 \
    --names launch_env devices set_device_order backend \
    --out "$OUT/h200_2ranks_one_gpu.json" \
    --description "One NVIDIA H200, 2 ranks forced onto it (CUDA_VISIBLE_DEVICES=0): NCCL's answer per set_device variant"

{
    if command -v nvidia-smi >/dev/null; then
        timeout 15 nvidia-smi
        echo "----- nvidia-smi topo -m"
        timeout 15 nvidia-smi topo -m
        echo "----- nvidia-smi -q (head)"
        timeout 20 nvidia-smi -q | head -n 200
    else
        echo "nvidia-smi not found"
    fi
} > "$OUT/nvidia_smi.txt" 2>&1

step 30 "$PY" tests/gpu/record_facts.py summary "$OUT/h200_1rank.json" "$OUT/h200_2ranks_one_gpu.json" \
    --expect h200_2ranks_one_gpu:duplicate-gpu-per-rank=confirmed \
             h200_2ranks_one_gpu:world-size-exceeds-devices=confirmed \
             h200_1rank:no-cuda-visible=ruled_out \
             h200_1rank:nccl-version-mismatch=ruled_out \
    2>&1 | tee "$OUT/summary.txt"

echo "done in $(( $(date +%s) - started )) s; files in $OUT:"
ls -la "$OUT"
