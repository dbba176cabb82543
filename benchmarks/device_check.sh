#!/usr/bin/env bash
# The GPU checks in one call, for a lent GPU machine that has torch/transformers/peft but no network:
# the missing pure-Python packages travel as wheels in .whl/ (see benchmarks/README.md). Writes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:platform TUNELAB_CACHE=/tmp/tunelab-cache WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# 1. LOMO / AdaLomo on CUDA, fp32 and bf16, against lomo-optim.
python3 -m pytest -q -p no:cacheprovider tests/test_optim_lomo.py -k cuda 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt"
# 2. Throughput: tunelab (padded, then packed) vs Trainer on a SmolLM2-135M-shaped model, bf16.
model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_check import model_source; print(model_source(Path('/tmp/m'))[0])")
for mode in "" "--pack"; do
  python3 benchmarks/train_throughput.py --model "$model" --warmup 2 --batch 64 --max-length 512 $mode \
    --out "$OUT/throughput${mode//-/_}.json" 2>&1 | grep -v -i warn | tail -4 | tee -a "$OUT/throughput.txt"
done
# 3. The decoding engine: batch-size independence on CPU and CUDA, greedy parity with model.generate, speed.
tiny=$(python3 -c "from tunelab.models.loading import resolve; print(resolve('tiny-random-llama'))")
timeout 300 python3 benchmarks/eval_gpu_check.py --tiny "$tiny" --out "$OUT/eval_gpu.json" 2>&1 | tail -20 \
  | tee "$OUT/eval_gpu.txt"
# 4. Four adapters of a random ~1B Llama evaluated one at a time vs together on the quick suite's shapes (~2 min).
timeout 420 python3 benchmarks/together_eval_gpu.py --tiny "$tiny" --out "$OUT/together_eval_gpu.json" 2>&1 | tail -4 \
  | tee "$OUT/together_eval_gpu.txt"
# 5. A together-group's training step, exact (members in turn) against batched (one pass), 4 LoRA members of a
#    random ~1B Llama, bf16 autocast, 4 rows of up to 512 tokens each (~2 min).
timeout 300 python3 benchmarks/together_step.py --model random-1b --members 4 --batch 4 --length 512 \
  --precision bf16 --steps 5 --repeats 3 --out "$OUT/together_step_gpu.json" 2>&1 | grep -v -i warn | tail -8 \
  | tee "$OUT/together_step_gpu.txt"
# 6. Sharded initialisation, multi-process and multi-node (about 4 minutes; writes $OUT/scale/).
bash benchmarks/device_scale_check.sh
