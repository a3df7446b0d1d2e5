#!/usr/bin/env bash
# Run a torchrun command and relay SIGUSR1 and SIGTERM to its training processes, exactly once per signal:
#
#   bash launch/relay_signals.sh torchrun --nnodes=2 ... -m fsdp_trainer.train --config configs/llama3_8b.toml
#
# slurm.sbatch runs it as the one Slurm task per node (and k8s.yaml as the container's command), because a
# signal sent to torchrun itself does not stop training cleanly (torch 2.13, torch/distributed/elastic):
#   - the agent handles only TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM,SIGINT,SIGHUP,SIGQUIT); SIGUSR1
#     keeps its default action and kills the agent, leaving the workers orphaned;
#   - on SIGTERM it runs os.killpg() on each worker's process group (workers start with start_new_session=True),
#     which also reaches the DataLoader worker processes in that group (they ignore it: see data.py), and it
#     SIGKILLs whatever is left after 30 s and exits 1, so a save that takes longer is lost.
# So this script signals only the training processes (torchrun's direct children, one per local rank) with
# kill(2), not killpg(2): the trainer finishes its step, saves, exits 0, and torchrun then exits 0 on its own.
# The trainer treats a second stop signal as "exit now", so each signal is relayed once and never
# re-sent; a SIGTERM after a SIGUSR1 (Slurm's final kill at the time limit) is a deliberate second signal.
#
# Exit status: torchrun's.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    echo "usage: $0 torchrun [torchrun flags] -m fsdp_trainer.train [trainer flags]" >&2
    exit 2
fi

"$@" &
launcher=$!

# The launcher's direct children, read from /proc (procps' pgrep is missing from many container images).
# shellcheck disable=SC2317  # reached through relay(), from the traps below
children() {
    local stat line rest ppid
    for stat in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null < "$stat" || continue   # the process may be gone already
        rest="${line##*) }"                               # after "pid (comm) ": comm may hold spaces
        ppid="${rest#* }"
        if [[ "${ppid%% *}" == "$launcher" ]]; then
            echo "${line%% *}"
        fi
    done
}

# shellcheck disable=SC2317  # reached through the traps below
relay() {
    local sig="$1" workers
    mapfile -t workers < <(children)
    if [[ ${#workers[@]} -eq 0 ]]; then
        # Before the rendezvous there is nothing to save; torchrun ends with the job.
        echo "[relay_signals ${HOSTNAME:-}] SIG$sig: no training processes (yet); not relayed" >&2
        return 0
    fi
    echo "[relay_signals ${HOSTNAME:-}] SIG$sig -> training processes ${workers[*]}" >&2
    kill -s "$sig" "${workers[@]}" 2>/dev/null || true
}
trap 'relay USR1' USR1
trap 'relay TERM' TERM

# `wait` returns early (status > 128) whenever a trapped signal arrives: keep waiting while torchrun lives,
# then collect its real exit status (bash keeps it for a reaped background job).
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher" || true
done
rc=0
wait "$launcher" || rc=$?
exit "$rc"
