#!/usr/bin/env bash
# Sharded initialisation, multi-process and multi-node checks on a lent GPU machine (one GPU, 16 cores), no
# network. Called from benchmarks/device_check.sh (which sets PYTHONPATH, caches and $OUT); runs alone too.
# One GPU cannot hold two NCCL ranks, so "multi-process" here means CPU ranks (gloo), which 16 cores run
# far faster than the 2-core CI machine; the GPU runs the sharded code paths in a process group of one.
# Prints its figures and writes them under $OUT/scale/. About 4 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/scale"
export PYTHONPATH=${PYTHONPATH:-platform} TUNELAB_CACHE=${TUNELAB_CACHE:-/tmp/tunelab-cache}
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -c "import deepspeed" 2>/dev/null || echo "deepspeed is not importable here: its checks will fail" | tee "$OUT/scale/missing.txt"

# 1. Per-rank memory of the 100.7M-parameter model built sharded (CPU ranks): one process, FSDP2 dp4,
#    ZeRO-3 dp4; losses, peaks, ratios, exp memory's prediction, and the tensor peaks (MemTracker).
timeout 900 python3 benchmarks/scale_memory.py --out /tmp/scale-cpu --tensors 2>"$OUT/scale/cpu.err" \
  | tee "$OUT/scale/cpu_ranks.md"

# 2. The same model on the GPU: whole, meta-device + per-shard fill, and zero.Init builds in a process group
#    of one (the sharded code paths on CUDA); losses must agree; peak allocated vs prediction.
timeout 600 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/device_scale_gpu.py \
  /tmp/scale-cpu/model 2>"$OUT/scale/gpu.err" | grep -v -i warn | tee "$OUT/scale/gpu.txt"

# 3. One-process cell of that model on the GPU under exp run: cuda max allocated vs exp memory.
timeout 600 python3 benchmarks/scale_memory.py --out /tmp/scale-gpu --device cuda 2>"$OUT/scale/gpu_cell.err" \
  | tee "$OUT/scale/gpu_cell.md"

# 4. The CI tests of this issue, on 16 cores: scale (losses, 0.45x, prediction), two nodes on loopback,
#    SLURM stand-in with a preemption. Their wall time is the figure to compare with the 2-core machine's.
timeout 1200 python3 -m pytest -q -p no:cacheprovider --durations=0 tests/test_parallel_scale.py \
  tests/test_multinode.py tests/test_slurm.py 2>&1 | tail -30 | tee "$OUT/scale/tests.txt"
