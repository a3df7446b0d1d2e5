#!/usr/bin/env bash
# Any number of nodes without a scheduler: run the SAME command on every node; they find each other through
# a c10d rendezvous hosted by the torchrun agent on the HEAD node, and c10d assigns the node ranks.
#
#   # on each of the 2 nodes (node0 is any one of them, reachable from the others on PORT):
#   NNODES=2 HEAD=node0:29500 JOB_ID=llama8b-run1 bash launch/multinode.sh --config configs/llama3_8b.toml
#   # an elastic range: start once 2 nodes joined, accept up to 4 (the trainer resumes on any world size)
#   NNODES=2:4 HEAD=node0:29500 JOB_ID=run1 bash launch/multinode.sh --config configs/llama3_8b.toml
#   DRY_RUN=1 NNODES=2 HEAD=node0:29500 bash launch/multinode.sh --config configs/llama3_8b.toml
#
# Environment:
#   NNODES        number of nodes, or MIN:MAX for an elastic job (required)
#   HEAD          rendezvous endpoint host:port; the host must be one of the nodes (required; port default 29500)
#   JOB_ID        rendezvous id, the same on every node and new for every job (default fsdp-trainer).
#                 Reusing a live id joins that job's rendezvous.
#   NGPU          processes per node (default: the GPUs in CUDA_VISIBLE_DEVICES, else nvidia-smi -L, else 1 CPU)
#   MAX_RESTARTS  times torchrun restarts the whole group after a process dies (default 3). Every restart
#                 resumes from the newest complete checkpoint (checkpoint.resume=auto), so it costs the
#                 steps since that checkpoint plus start-up.
#   LOG_RANKS, LOG_DIR, TORCHRUN, DRY_RUN: as in run.sh.
#
# Stopping: SIGUSR1 or SIGTERM to the training processes (torchrun's children) saves a checkpoint and exits 0 on
# every node; one node is enough, the ranks agree. Not to torchrun itself: it dies on SIGUSR1, and on SIGTERM it
# signals each rank's whole process group, then SIGKILLs the ranks 30 s later, so a longer save is lost. Under a
# supervisor that stops with SIGTERM (docker stop), start it as
# `bash launch/relay_signals.sh bash launch/multinode.sh ...`: the relay passes the signal to the ranks. Under
# systemd, also set KillMode=mixed and TimeoutStopSec longer than a save: its default (control-group) sends SIGTERM
# to every process of the unit at once, torchrun included, and the ranks take the second signal as "exit now".
# Firewalls: the nodes must accept each other's TCP connections on any port, not only HEAD's: torchrun puts the
# process group's store on a free port of the node that gets rank 0, and NCCL and gloo (the checkpoint's groups)
# listen on ports of their own. NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME choose the interface they use.
# That store's address is the fully qualified host name of the node that gets rank 0: where `hostname --fqdn` does
# not resolve from the other nodes (localhost on some cloud images), give each node its own reachable address,
# TORCHRUN="torchrun --local-addr=<this node's IP>".
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/common.sh
source "$here/common.sh"

: "${NNODES:?set NNODES (number of nodes, or MIN:MAX)}"
: "${HEAD:?set HEAD to host:port of one node, e.g. HEAD=node0:29500}"
head="$(endpoint "$HEAD" 29500)"
ngpu="${NGPU:-$(default_ngpu)}"
set_env_defaults

mapfile -t launcher < <(torchrun_words)
mapfile -t logging < <(log_flags)
cmd=("${launcher[@]}" "--nnodes=$NNODES" "--nproc-per-node=$ngpu"
     --rdzv-backend=c10d "--rdzv-endpoint=$head" "--rdzv-id=${JOB_ID:-fsdp-trainer}"
     "--max-restarts=${MAX_RESTARTS:-3}" ${logging[@]+"${logging[@]}"}
     -m fsdp_trainer.train "$@")
print_and_run "${cmd[@]}"
