#!/usr/bin/env bash
# One node: every visible GPU (or one CPU process when there is none), config and flags passed through.
#
#   bash launch/run.sh --config configs/llama3_8b.toml                     # all GPUs of this machine
#   NGPU=4 bash launch/run.sh --config configs/llama3_1b.toml --train.steps 50 --parallel.no_compile
#   LOG_RANKS=all bash launch/run.sh --config configs/debug.toml           # every rank's output, not rank 0's only
#   DRY_RUN=1 bash launch/run.sh --config configs/llama3_8b.toml           # print the torchrun command, run nothing
#
# Environment:
#   NGPU       processes on this node (default: the GPUs in CUDA_VISIBLE_DEVICES, else those nvidia-smi -L lists,
#              else 1 CPU process)
#   MAX_RESTARTS  times torchrun restarts the processes after one dies, each resuming from the newest complete
#              checkpoint (default 0)
#   LOG_RANKS  local ranks shown on the console: a list such as 0,3, or "all" (default 0)
#   LOG_DIR    also keep every rank's stdout/stderr in files under this folder (torchrun --log-dir --tee 3)
#   TORCHRUN   the launcher command (default torchrun; e.g. "python -m torch.distributed.run")
#   DRY_RUN=1  print the command and exit 0
# Anything else in the environment (NCCL_*, CUDA_VISIBLE_DEVICES, ...) reaches the training processes unchanged.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/common.sh
source "$here/common.sh"

ngpu="${NGPU:-$(default_ngpu)}"
set_env_defaults

mapfile -t launcher < <(torchrun_words)
mapfile -t logging < <(log_flags)
# --standalone: a private c10d rendezvous on a free local port, so two jobs on one machine never collide.
cmd=("${launcher[@]}" --standalone --nnodes=1 "--nproc-per-node=$ngpu" "--max-restarts=${MAX_RESTARTS:-0}"
     ${logging[@]+"${logging[@]}"}
     -m fsdp_trainer.train "$@")
print_and_run "${cmd[@]}"
