#!/usr/bin/env bash
# The whole GPU check in one command, for the lent GPU machine (or any CUDA host):
#   bash benchmarks/gpu_check.sh [NGPU] [--8b]
# Runs the GPU-marked tests, the attention backend comparison, and the throughput of the configs that fit,
# writing tables and JSON to benchmarks/results/<date>-<gpu>x<count>/ (copied to $OUT when set).
set -uo pipefail
NGPU=${1:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the lent machine lacks torchdata and tyro: install the carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
if [[ " $* " != *" --8b "* ]]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:warnings 2>&1 | tail -60
  python3 benchmarks/attention.py
  if [ "$NGPU" -gt 1 ]; then python3 benchmarks/collectives.py --nproc "$NGPU"; fi
  python3 benchmarks/plan_accuracy.py --nproc "$NGPU"
  python3 benchmarks/throughput.py --config configs/llama3_1b.toml --nproc "$NGPU" --steps 30 --name llama3_1b \
    --variant "eager noAC=--ac.mode none --parallel.no_compile" \
    --variant "compiled noAC=--ac.mode none" \
    --variant "compiled opAC=--ac.mode op"
else
  python3 benchmarks/throughput.py --config configs/llama3_8b.toml --nproc "$NGPU" --steps 20 --name llama3_8b \
    --variant "eager opAC=--ac.mode op --parallel.no_compile" \
    --variant "compiled opAC=--ac.mode op"
  python3 benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc "$NGPU" --steps 8 --interval 4 \
    -- --parallel.no_compile
fi
if [ -n "${OUT:-}" ]; then cp -r benchmarks/results/. "$OUT"/; fi
