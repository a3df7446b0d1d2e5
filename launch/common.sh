# shellcheck shell=bash
# Shared by run.sh, multinode.sh and slurm.sbatch (sourced, never run on its own): environment defaults,
# GPU count, rendezvous endpoint, rank-0 log filtering, and printing/running the final command.

# Ranks per node: the GPUs this process may use (CUDA_VISIBLE_DEVICES, as Slurm sets it, else nvidia-smi -L),
# or one CPU process (gloo) when there is no GPU. CUDA_VISIBLE_DEVICES set to "", -1 or NoDevFiles (Slurm's value
# for a job without GPUs) hides every GPU: one CPU process then, not one per GPU that nvidia-smi still lists.
default_ngpu() {
    local n=0 devices
    if [[ -v CUDA_VISIBLE_DEVICES ]]; then
        case "$CUDA_VISIBLE_DEVICES" in
            "" | -1 | NoDevFiles) ;;
            *) IFS=, read -r -a devices <<< "$CUDA_VISIBLE_DEVICES"
               n=${#devices[@]} ;;
        esac
    elif command -v nvidia-smi >/dev/null 2>&1; then
        # `|| true`: nvidia-smi exits non-zero on a machine with the tool but no working driver.
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    fi
    if [[ "$n" -gt 0 ]]; then echo "$n"; else echo 1; fi
}

# Defaults that are safe on any cluster; each is kept if the user already set it.
set_env_defaults() {
    # Fewer fragmentation OOMs when sequence lengths or batch shapes vary; the allocator maps pages
    # instead of carving fixed blocks. torch >= 2.9 also reads PYTORCH_ALLOC_CONF: respect either.
    if [[ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" && -z "${PYTORCH_ALLOC_CONF:-}" ]]; then
        export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    fi
    # NCCL prints nothing by default, so a failed init or a dead link shows up only as a timeout.
    # WARN adds a line with the reason on errors and nothing on a healthy run.
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    # torchrun >= 2.5 lets the training processes reuse its rendezvous TCPStore, and keeps that store across
    # restarts: after a restart, process-group set-up can read the previous attempt's addresses and fail with
    # "Connection refused" (pytorch/pytorch#135712; seen with torch 2.13 when one rank is killed). A fresh
    # store per attempt, hosted by rank 0, is the behaviour of torch <= 2.4.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
    # Interface, IB and topology settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) depend on the
    # cluster: set them in the environment; this script passes the environment through untouched.
}

# torchrun flags that choose which local ranks reach the console. Rank 0 only by default: eight copies of
# every line help nobody. The flag exists since torch 2.3. It hides other ranks' tracebacks too, so
# LOG_DIR=<dir> keeps every rank's stdout/stderr in files (torchrun --log-dir with --tee). With LOG_RANKS=all and
# no LOG_DIR there are none: callers expand them as ${logging[@]+"${logging[@]}"}, since bash before 4.4 (CentOS 7)
# takes an empty array for an unset variable under set -u.
log_flags() {
    local ranks="${LOG_RANKS:-0}"
    if [[ "$ranks" != "all" ]]; then
        printf '%s\n' "--local-ranks-filter=$ranks"
    fi
    if [[ -n "${LOG_DIR:-}" ]]; then
        printf '%s\n' "--log-dir=$LOG_DIR" "--tee=3"
    fi
}

# Print the exact command, shell-quoted so it can be pasted; with DRY_RUN=1 stop there.
print_and_run() {
    local quoted
    quoted="$(printf '%q ' "$@")"
    echo "+ ${quoted% }"
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        exit 0
    fi
    exec "$@"
}

# A rendezvous endpoint: host[:port] as given, the port defaulting to $2. Prints host:port.
endpoint() {
    if [[ "$1" == *:* ]]; then
        echo "$1"
    else
        echo "$1:$2"
    fi
}

# The launcher, as words: TORCHRUN="python -m torch.distributed.run" works where torchrun is not on PATH.
torchrun_words() {
    local words
    read -r -a words <<< "${TORCHRUN:-torchrun}"
    printf '%s\n' "${words[@]}"
}
