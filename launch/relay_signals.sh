#!/usr/bin/env bash
# Run a torchrun command and relay the first SIGUSR1, and each SIGTERM, to its training processes, once:
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
# The trainer treats a second stop signal as "exit now", so each signal is relayed once and never re-sent, and
# only the first SIGUSR1 is relayed at all: slurm.sbatch may send it again through scancel, for a step that had
# no task yet. A SIGTERM after a SIGUSR1 (Slurm's final kill at the time limit) is a deliberate second signal.
#
# RELAY_PID_DIR (set by slurm.sbatch): once the traps are set, write this script's pid to
# $RELAY_PID_DIR/$(uname -n), removed on exit.
# Exit status: torchrun's.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    echo "usage: $0 torchrun [torchrun flags] -m fsdp_trainer.train [trainer flags]" >&2
    exit 2
fi

# uname, not $HOSTNAME: bash keeps a HOSTNAME exported from the submitting host, the same on every node.
node="$(uname -n)"
launcher=""   # torchrun's pid, once started
pending=()    # signals received that no training process could take yet, in order
usr1=""       # 1 once a SIGUSR1 came, 2 once another was dropped

# The launcher's direct children, read from /proc (procps' pgrep is missing from many container images).
# shellcheck disable=SC2317  # reached through deliver(), from the traps below
children() {
    local stat line rest ppid
    [[ -n "$launcher" ]] || return 0
    for stat in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null < "$stat" || continue   # the process may be gone already
        rest="${line##*) }"                               # after "pid (comm) ": comm may hold spaces
        ppid="${rest#* }"
        if [[ "${ppid%% *}" == "$launcher" ]]; then
            echo "${line%% *}"
        fi
    done
}

# Whether process $1 has a handler for signal number $2 (the SigCgt mask of /proc/PID/status): a rank still
# importing torch has none yet, and SIGTERM's default action would kill it.
# shellcheck disable=SC2317
catches() {
    local mask
    mask="$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null)" || return 1
    [[ -n "$mask" ]] && (( (16#$mask >> ($2 - 1)) & 1 ))
}

# Relay the pending signals once every training process catches them; until then they stay pending (a
# signal before the rendezvous, or while the ranks start, is kept, not lost).
# shellcheck disable=SC2317
deliver() {
    local workers worker sig
    [[ ${#pending[@]} -gt 0 ]] || return 0
    mapfile -t workers < <(children)
    [[ ${#workers[@]} -gt 0 ]] || return 0
    for worker in "${workers[@]}"; do
        for sig in "${pending[@]}"; do
            catches "$worker" "$(kill -l "$sig")" || return 0
        done
    done
    for sig in "${pending[@]}"; do
        echo "[relay_signals $node] SIG$sig -> training processes ${workers[*]}" >&2
        kill -s "$sig" "${workers[@]}" 2>/dev/null || true
    done
    pending=()
}
# shellcheck disable=SC2317,SC2329  # run by the traps below
receive() {
    if [[ "$1" == USR1 ]]; then
        if [[ -n "$usr1" ]]; then
            # said once: slurm.sbatch may send it every 10 s through scancel until the job ends
            if [[ "$usr1" == 1 ]]; then
                echo "[relay_signals $node] SIGUSR1 again: not relayed (the ranks would take it as \"exit now\")" >&2
                usr1=2
            fi
            return 0
        fi
        usr1=1
    fi
    pending+=("$1")
    deliver
    if [[ ${#pending[@]} -gt 0 ]]; then
        echo "[relay_signals $node] SIG$1: no training process handles it yet; relaying it once they do" >&2
    fi
}
# Set before torchrun starts: a signal in between would otherwise kill this script and orphan torchrun.
trap 'receive USR1' USR1
trap 'receive TERM' TERM
# Only now may it be signalled: slurm.sbatch waits for the file of its own node before it sends SIGUSR1 here.
# Removed on exit: the batch shell would otherwise signal whatever process takes this pid next.
if [[ -n "${RELAY_PID_DIR:-}" ]] && { echo "$$" > "$RELAY_PID_DIR/$node"; } 2>/dev/null; then
    trap 'rm -f "$RELAY_PID_DIR/$node"' EXIT
fi

# torchrun and its ranks start with SIGUSR1 ignored (a disposition that exec and fork keep): the trainer installs
# its handler early, but an early SIGUSR1 (one sent to the whole job, say) would otherwise kill torchrun, or a
# rank still starting.
( trap '' USR1; exec "$@" ) &
launcher=$!

# `wait` returns early (status > 128) whenever a trapped signal arrives: keep waiting while torchrun lives,
# then collect its real exit status (bash keeps it for a reaped background job).
# While signals are pending, look every second for training processes that can take them.
while kill -0 "$launcher" 2>/dev/null; do
    if [[ ${#pending[@]} -gt 0 ]]; then
        sleep 1 & wait $! || true
        deliver
    else
        wait "$launcher" || true
    fi
done
rc=0
wait "$launcher" || rc=$?
exit "$rc"
