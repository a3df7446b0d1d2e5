#!/usr/bin/env bash
# The GPU checks, in parts that each fit one 10-minute call on the lent GPU machine (or run on any CUDA host):
#   bash benchmarks/gpu_check.sh NGPU PART
# PART:
#   tests       GPU-marked tests, SDPA backends, the doctor's bandwidth beside bare NCCL (NGPU > 1)
#   small       Llama 3.2 1B: throughput (eager/compiled, AC modes), FSDP vs DDP, weak scaling 1..NGPU
#   8b          Llama 3 8B at seq 8192: eager and compiled with per-op AC, compiled full AC and no AC
#   checkpoint  8B checkpoint save/load per async mode
#   plan        the memory planner against measured peaks; with NGPU >= 4, the 8.5B model capped at 47.4 GiB
# Tables go to stdout; JSON (and PNG) to benchmarks/results/<date>-<gpu>x<count>/, copied to $OUT when set.
set -uo pipefail
NGPU=${1:?usage: gpu_check.sh NGPU PART}
PART=${2:?usage: gpu_check.sh NGPU PART}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ -d .whl ]; then  # the lent machine lacks torchdata and tyro: install the carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
throughput() { python3 benchmarks/throughput.py --nproc "$NGPU" "$@"; }
case "$PART" in
  tests)
    python3 -m pytest -q -m gpu tests/test_gpu.py -p no:warnings 2>&1 | tail -60
    python3 benchmarks/attention.py
    if [ "$NGPU" -gt 1 ]; then python3 benchmarks/collectives.py --nproc "$NGPU"; fi ;;
  small)
    throughput --config configs/llama3_1b.toml --steps 30 --name llama3_1b \
      --variant "eager noAC=--ac.mode none --parallel.no_compile" \
      --variant "compiled noAC=--ac.mode none" \
      --variant "compiled opAC=--ac.mode op"
    python3 benchmarks/fsdp_vs_ddp.py --config configs/llama3_1b.toml --nproc "$NGPU" -- --ac.mode none
    python3 benchmarks/scaling.py --config configs/llama3_1b.toml --gpus 1 2 4 8 --steps 25 ;;
  8b)
    throughput --config configs/llama3_8b.toml --steps 20 --name llama3_8b \
      --variant "eager opAC=--ac.mode op --parallel.no_compile" \
      --variant "compiled opAC=--ac.mode op" \
      --variant "compiled fullAC=--ac.mode full" \
      --variant "compiled noAC=--ac.mode none" ;;
  checkpoint)
    python3 benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc "$NGPU" --steps 8 --interval 4 \
      -- --parallel.no_compile ;;
  plan)
    python3 benchmarks/plan_accuracy.py --nproc "$NGPU"
    if [ "$NGPU" -ge 4 ]; then  # the 8.5B model that OOMs under DDP on 47.4 GiB cards, as the planner sizes it
      python3 -m fsdp_trainer.plan --config configs/llama3_8b.toml --model.n_layers 34 --ac.mode full \
        --gpus "$NGPU" --gpu-memory 47.4GiB
      throughput --config configs/llama3_8b.toml --steps 50 --name llama_8.5b_capped_47GiB \
        --variant "8.5B fullAC 47.4GiB=--model.n_layers 34 --ac.mode full --memory.limit_gib 47.4"
    fi ;;
  *) echo "unknown part: $PART"; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then cp -r benchmarks/results/. "$OUT"/; fi
