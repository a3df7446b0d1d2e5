#!/usr/bin/env bash
# The GPU checks, in parts of under 10 minutes each on 4 H200s, for any CUDA host:
#   bash benchmarks/gpu_check.sh NGPU PART [PART ...]
# PART:
#   tests        GPU-marked tests and the SDPA backends
#   collectives  the doctor's bandwidth table beside a bare NCCL all_reduce, on 2 GPUs and on NGPU (on 1 if NGPU=1)
#   small        Llama 3.2 1B: throughput (eager/compiled, AC modes), FSDP vs DDP, weak scaling 1..NGPU
#   8b           Llama 3 8B at seq 8192, the speed targets' settings: eager/compiled per-op AC (compiled also keeping
#                every block gathered), compiled full AC, compiled no AC, compiled per-op AC micro-batch 2
#   levers       8B, each open speed lever beside its own baseline in one sweep: Python's automatic garbage
#                collection instead of train.gc_every (compiled per-op AC), no resharding after forward (compiled
#                per-op, no and full AC), the caching allocator without expandable segments (the launchers' default
#                has them). Levers measured before (prefetch, chunked loss, NCCL CTAs) are in the results' commands.
#   keep         8B compiled: no AC within a 71 GiB allocator cap (torchtitan v0.2.2's published reserved peak), alone
#                and keeping the last 8 or 16 blocks gathered (parallel.keep_gathered); per-op and full AC keeping
#                all 32
#   card         one GPU, the 8B's shape cut to 8 blocks at seq 8192: eager and compiled per-op AC, compiled no and
#                full AC. Run with NGPU=1 on each card type, it compares the cards on the same work (H100 against H200)
#   evaluation   one GPU, the 8B's shape cut to 8 blocks: held-out evaluation's tokens/s beside training's (compiled
#                per-op AC, eager per-op AC, compiled with eval micro-batch 4), and the peak with evaluations on
#   pool         8B compiled, no/per-op/full AC: the sharded gradients in the compute stream's memory pool (the
#                default, parallel.grads_in_compute_pool) beside FSDP2's own allocation on its reduce-scatter stream
#   autotune     8B compiled per-op AC: Inductor's GEMM autotuning, and its coordinate-descent tuning of the fused
#                kernels, each beside the baseline (long compiles: a part of its own)
#   copy_engines 8B, eager and compiled per-op AC, compiled full and no AC, micro-batch 2: the all-gathers on the
#                copy engines (the default, parallel.copy_engine_all_gather) beside FSDP2's own all-gather
#   clocks       8B compiled, no/per-op/full AC: SM clock and power of every GPU, sampled by nvidia-smi every 100 ms
#                while it is busy, beside each run's rate (results/.../clocks_llama3_8b.txt): is the step power-bound?
#   profile      8B per-op AC, eager and compiled: the profiler's per-step breakdown (matmul, attention,
#                communication and how much of it is exposed, optimizer, idle), and the heaviest kernels of both,
#                in results/.../profile_llama3_8b.log. PROFILE_RUNS="compile:none compile:full" profiles other
#                COMPILE:AC pairs instead (into profile_llama3_8b_compile-none_compile-full.log)
#   checkpoint   8B checkpoint save/load, one save after 15 steps then a resume: async_pinned, then sync
#                (CHECKPOINT_MODES overrides the modes, CHECKPOINT_CHECKSUMS="on off" compares checksums on and off;
#                the disk needs room for one 12 bytes/param checkpoint)
#   plan         the memory planner against measured peaks over a 1B/8B matrix on 1, 2 and 4 GPUs (those present)
#   heldout      the memory planner on 16 configurations none of its constants was fitted to, on one GPU, 3 steps
#                each: plan_heldout.json, one table of the fitted and held-out rows and the error band they set
#   capped       the 8.5B model that OOMs under DDP on 47.4 GiB cards: its plan, then training it uncapped and
#                capped at 47.4 GiB (same speed and no allocator retries when the plan's "fits" holds)
# Tables go to stdout; JSON (and PNG) to benchmarks/results/<date>-<gpu>x<count>/. With BENCH_RESULTS_DIR=DIR they go to
# DIR/<date>-<gpu>x<count>/ instead, with this script's log beside them: a job's output folder, say, so that a job
# stopped at its time limit keeps both.
# A failed command does not stop the checks: the parts after it run, and the script exits 1 naming what failed.
set -Euo pipefail  # -E: the ERR trap below fires inside functions too
failed=()
trap 'failed+=("${PART:-setup} (line $LINENO)")' ERR
NGPU=${1:?usage: gpu_check.sh NGPU PART [PART ...]}
shift
[ $# -gt 0 ] || { echo "usage: gpu_check.sh NGPU PART [PART ...]"; exit 2; }
PARTS="tests collectives small 8b levers keep card evaluation pool autotune copy_engines clocks profile checkpoint plan heldout capped"
for part in "$@"; do  # all before any: a typo in the last part must not wait for the GPU time of the others
  [[ " $PARTS " == *" $part "* ]] || { echo "unknown part: $part (the parts: $PARTS)"; exit 2; }
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ -n "${BENCH_RESULTS_DIR:-}" ]; then
  mkdir -p "$BENCH_RESULTS_DIR" && export BENCH_RESULTS_DIR
  exec > >(tee "$BENCH_RESULTS_DIR/gpu_check_$(IFS=_; echo "$*").log") 2>&1
fi
if [ -d .whl ]; then  # for GPU hosts without network access: tyro and its dependencies as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
throughput() { python3 benchmarks/throughput.py --nproc "$NGPU" "$@"; }
results_file() { echo "$(python3 benchmarks/results.py dir "$NGPU")/$1"; }
# The first line of a results file this script writes itself, given the command that made it: what results.py
# records in its JSON files (date, GPUs, torch and CUDA, the commit, the environment exported above).
results_header() { python3 benchmarks/results.py header "$NGPU" "$@"; }
EAGER_OP="eager opAC=--ac.mode op --parallel.no_compile"
COMPILED_OP="compiled opAC=--ac.mode op"
COMPILED_NONE="compiled noAC=--ac.mode none"
COMPILED_FULL="compiled fullAC=--ac.mode full"
COMPILED_MB2="compiled opAC mb2=--ac.mode op --train.micro_batch_size 2"
lever() { echo "${1%%=*} $2=${1#*=} $3"; }  # lever "NAME=FLAGS" "what" "--its.flag value": the variant plus one lever
env_lever() { echo "${1%%=*} $2=$3 ${1#*=}"; }  # env_lever "NAME=FLAGS" "what" "VAR=value": the same, set in its environment
ERRORS="Error|error:|out of memory"  # the lines kept from a training run's output besides its results: why it failed
for PART in "$@"; do
  echo "== $PART"
  case "$PART" in
    tests)
      python3 -m pytest -q -m gpu tests/test_gpu.py -p no:warnings --tb=short
      python3 benchmarks/attention.py ;;
    collectives)  # on 2 GPUs (or the one), then on all of them
      for n in $(printf '%s\n' "$((NGPU < 2 ? NGPU : 2))" "$NGPU" | sort -un); do
        python3 benchmarks/collectives.py --nproc "$n"
      done ;;
    small)
      throughput --config configs/llama3_1b.toml --steps 30 --name llama3_1b \
        --variant "eager noAC=--ac.mode none --parallel.no_compile" \
        --variant "compiled noAC=--ac.mode none" \
        --variant "compiled opAC=--ac.mode op"
      python3 benchmarks/fsdp_vs_ddp.py --config configs/llama3_1b.toml --nproc "$NGPU" -- --ac.mode none
      counts=()  # 1, 2, 4, 8 up to NGPU, and NGPU (the +: bash before 4.4 calls an empty array unbound under set -u)
      for n in 1 2 4 8; do if [ "$n" -lt "$NGPU" ]; then counts+=("$n"); fi; done
      python3 benchmarks/scaling.py --config configs/llama3_1b.toml --gpus ${counts[@]+"${counts[@]}"} "$NGPU" --steps 25 ;;
    8b)
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b \
        --variant "$EAGER_OP" --variant "$COMPILED_OP" \
        --variant "$(lever "$COMPILED_OP" "keep 32" "--parallel.keep_gathered 32")" --variant "$COMPILED_FULL" \
        --variant "$COMPILED_NONE" --variant "$COMPILED_MB2" ;;
    levers)
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b_levers \
        --variant "$COMPILED_OP" --variant "$(lever "$COMPILED_OP" "automatic gc" "--train.gc_every 0")" \
        --variant "$(lever "$COMPILED_OP" "reshard never" "--parallel.reshard_after_forward never")" \
        --variant "$(env_lever "$COMPILED_OP" "no expandable segments" "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")" \
        --variant "$COMPILED_NONE" --variant "$(lever "$COMPILED_NONE" "reshard never" "--parallel.reshard_after_forward never")" \
        --variant "$COMPILED_FULL" --variant "$(lever "$COMPILED_FULL" "reshard never" "--parallel.reshard_after_forward never")" ;;
    keep)
      cap="--memory.limit_gib 71 --memory.ignore_plan"  # the plan counts the CUDA context against the cap too
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b_keep \
        --variant "$COMPILED_NONE" --variant "$(lever "$COMPILED_NONE" "71GiB" "$cap")" \
        --variant "$(lever "$COMPILED_NONE" "71GiB keep 8" "$cap --parallel.keep_gathered 8")" \
        --variant "$(lever "$COMPILED_NONE" "71GiB keep 16" "$cap --parallel.keep_gathered 16")" \
        --variant "$(lever "$COMPILED_OP" "keep 32" "--parallel.keep_gathered 32")" \
        --variant "$(lever "$COMPILED_FULL" "keep 32" "--parallel.keep_gathered 32")" ;;
    card)
      throughput --config configs/llama3_8b.toml --steps 24 --log-every 4 --warmup 12 --name llama3_8b_8layers \
        --variant "$EAGER_OP --model.n_layers 8" --variant "$COMPILED_OP --model.n_layers 8" \
        --variant "$COMPILED_NONE --model.n_layers 8" --variant "$COMPILED_FULL --model.n_layers 8" ;;
    evaluation)
      evals="--model.n_layers 8 --eval.every 8 --eval.samples 32"
      throughput --config configs/llama3_8b.toml --steps 24 --log-every 4 --warmup 12 --name eval_8b_8layers \
        --variant "$COMPILED_OP $evals" --variant "$EAGER_OP $evals" \
        --variant "$(lever "$COMPILED_OP" "eval mb4" "$evals --eval.micro_batch_size 4")" ;;
    pool)
      apart="--parallel.no_grads_in_compute_pool"
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b_grads_pool \
        --variant "$COMPILED_NONE" --variant "$(lever "$COMPILED_NONE" "grads apart" "$apart")" \
        --variant "$COMPILED_OP" --variant "$(lever "$COMPILED_OP" "grads apart" "$apart")" \
        --variant "$COMPILED_FULL" --variant "$(lever "$COMPILED_FULL" "grads apart" "$apart")" ;;
    autotune)
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b_autotune \
        --variant "$COMPILED_OP" \
        --variant "$(env_lever "$COMPILED_OP" "GEMM autotuning" "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1")" \
        --variant "$(env_lever "$COMPILED_OP" "coordinate descent" "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1")" ;;
    copy_engines)
      fsdp2="--parallel.no_copy_engine_all_gather"
      variants=()
      for v in "$EAGER_OP" "$COMPILED_OP" "$COMPILED_FULL" "$COMPILED_NONE" "$COMPILED_MB2"; do
        variants+=(--variant "$v" --variant "$(lever "$v" "FSDP2 all-gather" "$fsdp2")")
      done
      throughput --config configs/llama3_8b.toml --steps 16 --log-every 4 --warmup 8 --name llama3_8b_copy_engines \
        "${variants[@]}" ;;
    clocks)
      log=$(results_file clocks_llama3_8b.txt)
      { results_header bash benchmarks/gpu_check.sh "$NGPU" clocks
        nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv; } | tee "$log"
      for ac in none op full; do
        nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 100 \
          > "/tmp/clocks_$ac.csv" &
        sampler=$!
        cmd=(python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m fsdp_trainer.train
          --config configs/llama3_8b.toml --ac.mode "$ac" --train.steps 24 --train.log_every 8
          --train.output_dir "/tmp/clocks_$ac" --checkpoint.interval 0 --checkpoint.resume none
          --checkpoint.no_save_final --metrics.no_tensorboard)
        echo "\$ ${cmd[*]}" | tee -a "$log"
        "${cmd[@]}" 2>&1 | grep -E "step (16|24)/|$ERRORS" | tee -a "$log"
        kill "$sampler"
        python3 - "/tmp/clocks_$ac.csv" "$ac" <<'PY' | tee -a "$log"
import sys
rows = [[float(x) for x in line.split(",")] for line in open(sys.argv[1]) if line.count(",") == 2]
busy = [r for r in rows if r[2] >= 90]
mean = lambda i: sum(r[i] for r in busy) / max(len(busy), 1)
print(f"ac {sys.argv[2]}: {len(busy)} GPU samples at >= 90% utilization, mean SM {mean(0):.0f} MHz, mean {mean(1):.0f} W")
PY
      done ;;
    profile)  # where each step's GPU time goes (the trace files stay on the machine)
      runs=${PROFILE_RUNS:-no_compile:op compile:op}
      suffix=${PROFILE_RUNS:+_$(echo "$runs" | tr ' :' '_-')}
      log=$(results_file "profile_llama3_8b$suffix.log")
      # A new file, as clocks writes: appended to, a rerun's log would start with the earlier run's header and tables.
      results_header PROFILE_RUNS="$runs" bash benchmarks/gpu_check.sh "$NGPU" profile | tee "$log"
      traces=()
      for run in $runs; do
        compile=${run%%:*} ac=${run#*:}
        cmd=(python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m fsdp_trainer.train
          --config configs/llama3_8b.toml --ac.mode "$ac" "--parallel.$compile" --train.steps 14 --train.log_every 7
          --profile.steps 12:13 --train.output_dir "/tmp/profile_${compile}_$ac" --checkpoint.interval 0
          --checkpoint.resume none --checkpoint.no_save_final --metrics.no_tensorboard)
        echo "\$ ${cmd[*]}" | tee -a "$log"
        rm -rf "/tmp/profile_${compile}_$ac"  # a run that fails must leave kernel_table.py no earlier run's trace
        "${cmd[@]}" 2>&1 | grep -E "profile of steps|step 14/|$ERRORS" | tee -a "$log"
        traces+=("/tmp/profile_${compile}_$ac/profile/trace_rank0_steps12-13.json")
      done
      python3 benchmarks/kernel_table.py "${traces[@]}" --steps 2 >> "$log" ;;
    checkpoint)
      df -h /tmp | tail -1
      read -ra modes <<< "${CHECKPOINT_MODES:-async_pinned none}"
      read -ra checksums <<< "${CHECKPOINT_CHECKSUMS:-on}"
      python3 benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc "$NGPU" --steps 16 --interval 15 \
        --modes "${modes[@]}" --checksums "${checksums[@]}" -- --parallel.no_compile --checkpoint.no_save_final ;;
    plan)
      python3 benchmarks/plan_accuracy.py ;;
    heldout)
      python3 benchmarks/plan_accuracy.py --heldout ;;
    capped)
      python3 -m fsdp_trainer.tools.plan --config configs/llama3_8b.toml --model.n_layers 34 --ac.mode full \
        --gpus 8 --gpu-memory 47.4GiB
      python3 -m fsdp_trainer.tools.plan --config configs/llama3_8b.toml --model.n_layers 34 --ac.mode full \
        --gpus "$NGPU" --gpu-memory 47.4GiB
      throughput --config configs/llama3_8b.toml --steps 30 --name llama_8.5b_capped_47GiB \
        --variant "8.5B fullAC=--model.n_layers 34 --ac.mode full" \
        --variant "8.5B fullAC 47.4GiB=--model.n_layers 34 --ac.mode full --memory.limit_gib 47.4" ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
