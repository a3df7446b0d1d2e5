"""GPU-only paths, run on the GPU machine: `python -m pytest -m gpu tests/test_gpu.py` (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_trainer import distributed, train

from helpers import tiny_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def info():
    return distributed.init()


def _run(info, tmp_path, **sections):
    sections.setdefault("train", {})
    sections["train"] = {"output_dir": str(tmp_path), "steps": 30, **sections["train"]}
    sections.setdefault("parallel", {})
    sections["parallel"] = {"param_dtype": "auto", **sections["parallel"]}
    cfg = tiny_config(**sections)
    cfg.checkpoint.save_final = False
    return train.run(cfg, info)


def test_bfloat16_compute_fp32_master_weights_and_fused_adamw(info, tmp_path):
    result = _run(info, tmp_path)
    history, model, optimizer = result["history"], result["model"], result["optimizer"]
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    assert optimizer.defaults["fused"]
    assert history[-1]["mem_active_gib"] > 0


def test_float16_with_loss_scaling_trains(info, tmp_path):
    history = _run(info, tmp_path, parallel={"param_dtype": "float16"})["history"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5


@pytest.mark.slow  # inductor compiles in worker processes
def test_compiled_blocks_match_eager(info, tmp_path):
    eager = _run(info, tmp_path / "eager", train={"steps": 8}, parallel={"param_dtype": "float32"})["history"]
    compiled = _run(info, tmp_path / "compiled", train={"steps": 8},
                    parallel={"param_dtype": "float32", "compile": True}, ac={"mode": "op"})["history"]
    for a, b in zip(eager, compiled):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)


@pytest.mark.slow  # inductor compiles in worker processes
def test_compiled_loss_matches_eager_and_makes_no_float32_copy_of_the_logits():
    from fsdp_trainer.loss import compiled_cross_entropy, cross_entropy
    tokens, vocab = 4096, 32768
    logits_bytes = 2 * tokens * vocab
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    source = torch.randn(1, tokens, vocab, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, loss_of in (("eager", cross_entropy), ("compiled", compiled_cross_entropy)):
        for attempt in range(2):  # the first compiled call also compiles; measure the second
            logits = source.clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = loss_of(logits, labels)
            loss.backward()
            torch.cuda.synchronize()
            results[name] = (loss.detach(), logits.grad, torch.cuda.max_memory_allocated() - base)
    (eager_loss, eager_grad, eager_peak), (loss, grad, peak) = results["eager"], results["compiled"]
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, eager_grad, rtol=2e-2, atol=1e-6)
    # Beyond the logits: eager holds three float32 tensors of their size; compiled only their bfloat16 gradient.
    assert eager_peak > 5 * logits_bytes
    assert peak < 1.1 * logits_bytes, (peak / logits_bytes, eager_peak / logits_bytes)


def test_cpu_offload_trains(info, tmp_path):
    threads = max(torch.get_num_threads(), distributed.cores_per_rank())
    history = _run(info, tmp_path, parallel={"cpu_offload": True}, train={"steps": 10})["history"]
    assert torch.get_num_threads() == threads  # the host AdamW on this rank's cores
    assert history[-1]["loss"] < history[0]["loss"]


def test_memory_limit_caps_the_process(info, tmp_path):
    _run(info, tmp_path, memory={"limit_gib": 2.0}, train={"steps": 2})
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(3 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_nonfinite_update_is_skipped_on_the_device_by_fused_adamw(info, tmp_path):
    from fsdp_trainer.optim import NonFiniteGuard
    result = _run(info, tmp_path, train={"steps": 2})
    model, optimizer = result["model"], result["optimizer"]
    assert optimizer.defaults["fused"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    guard = NonFiniteGuard(torch.device("cuda"), "skip", 10, start_step=2)
    guard.step(optimizer, torch.tensor(float("nan"), device="cuda"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().full_tensor(), before[name].full_tensor()), name
    for state, moment in zip(optimizer.state.values(), moments):
        assert torch.equal(state["exp_avg"], moment)
    assert guard.check() == 1


def test_deterministic_mode_reproduces_losses_exactly(info, tmp_path):
    first = _run(info, tmp_path / "a", train={"steps": 5, "deterministic": True})["history"]
    second = _run(info, tmp_path / "b", train={"steps": 5, "deterministic": True})["history"]
    assert [r["loss"] for r in first] == [r["loss"] for r in second]


def test_a_resumed_run_continues_exactly(info, tmp_path):
    """Saved at step 3 from the GPU (async_pinned), resumed elsewhere: the sharded state and the GPU's RNG come back,
    and steps 4-6 log the uninterrupted run's losses."""
    settings = {"train": {"steps": 6, "deterministic": True}}
    whole = _run(info, tmp_path / "whole", **settings, checkpoint={"interval": 3})["history"]
    resumed = _run(info, tmp_path / "resumed", **settings,
                   checkpoint={"resume": str(tmp_path / "whole/checkpoints/step_00000003")})["history"]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]


def _train_cli(tmp_path, *flags):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "fsdp_trainer.train", "--train.output_dir", str(tmp_path),
                           "--data.source", "synthetic", "--checkpoint.no_save_final", *flags],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_the_plan_rejects_stops_before_allocating(tmp_path):
    proc = _train_cli(tmp_path, "--model.name", "70b", "--train.seq_len", "8192", "--train.micro_batch_size", "1")
    assert proc.returncode == 2
    assert proc.stderr.count("DOES NOT FIT") == 1 and "--memory.ignore_plan" in proc.stderr
    assert "error: [rank 0] memory plan: " in proc.stderr


@pytest.mark.slow
def test_cuda_oom_names_rank_phase_and_plan(tmp_path):
    proc = _train_cli(tmp_path, "--model.name", "1b", "--train.seq_len", "4096", "--train.micro_batch_size", "4",
                      "--memory.limit_gib", "20", "--memory.ignore_plan", "--memory.oom_snapshot")
    assert proc.returncode != 0
    assert "rank 0: CUDA out of memory during" in proc.stderr
    assert "the memory plan predicted" in proc.stderr and "memory snapshot" in proc.stderr
    assert "suggestion: " in proc.stderr  # the plan said it would not fit: its cheapest change that does


def _gradient_streams(model) -> set[int]:
    """The allocator streams whose segments hold the model's sharded gradients."""
    torch.cuda.synchronize()
    addresses = {p.grad.to_local().data_ptr() for p in model.parameters()}
    return {s["stream"] for s in torch.cuda.memory_snapshot() for a in addresses
            if s["address"] <= a < s["address"] + s["total_size"]}


def test_gradients_in_the_compute_pool_train_identically_and_live_on_the_compute_stream(info, tmp_path):
    """parallel.grads_in_compute_pool: the same losses, bit for bit, with the sharded gradients in memory the
    allocator lends to the compute (default) stream instead of FSDP2's reduce-scatter stream."""
    def streams_and_losses(pool: bool):
        result = _run(info, tmp_path / str(pool), train={"steps": 6, "deterministic": True},
                      parallel={"grads_in_compute_pool": pool})
        model = result["model"]  # the run ended with zero_grad: one more backward makes gradients to look at
        model(torch.randint(0, 320, (2, 32), device="cuda")).float().logsumexp(-1).mean().backward()
        return _gradient_streams(model), [r["loss"] for r in result["history"]]

    default_stream = torch.cuda.default_stream().cuda_stream
    pooled_streams, pooled = streams_and_losses(True)
    side_streams, reference = streams_and_losses(False)
    assert pooled == reference
    assert pooled_streams == {default_stream} and default_stream not in side_streams


def _two_gpu_run(out, flag: str) -> tuple[list[float], str]:
    """8 deterministic steps of a 4-block 1B on two GPUs with one --parallel flag: the losses and the log."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
                           "fsdp_trainer.train", "--model.name", "1b", "--model.n_layers", "4",
                           "--train.seq_len", "2048", "--train.micro_batch_size", "2", "--train.steps", "8",
                           "--train.log_every", "1", "--train.deterministic", "--data.source", "synthetic", "--train.output_dir", str(out),
                           "--checkpoint.interval", "0", "--checkpoint.no_save_final", "--metrics.no_tensorboard",
                           "--eval.every", "0", f"--parallel.{flag}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gradients_in_the_compute_pool_train_identically_on_two_gpus(tmp_path):
    """The same, sharded over two GPUs with NCCL, on blocks large enough for the CPU to run ahead of the GPU:
    a gradient block lent out again before the reduce-scatter wrote it would change the losses."""
    pooled, _ = _two_gpu_run(tmp_path / "pooled", "grads_in_compute_pool")
    assert len(pooled) == 8 and pooled == _two_gpu_run(tmp_path / "apart", "no_grads_in_compute_pool")[0]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_all_gathers_on_the_copy_engines_train_identically_on_two_gpus(tmp_path):
    """parallel.copy_engine_all_gather: the all-gathers into NCCL symmetric memory under NCCL's zero-CTA policy
    give FSDP2's own all-gather's losses, bit for bit."""
    engines, log = _two_gpu_run(tmp_path / "engines", "copy_engine_all_gather")
    assert "all-gathers in NCCL symmetric memory, NCCL_CTA_POLICY=2" in log
    kernels, log = _two_gpu_run(tmp_path / "kernels", "no_copy_engine_all_gather")
    assert "symmetric memory" not in log
    assert len(engines) == 8 and engines == kernels


def test_gradients_in_the_compute_pool_refuse_accumulation_with_sync_on_every_micro_batch(info):
    """A second backward before zero_grad makes FSDP2 add into the pooled gradients on its reduce-scatter stream:
    refused, naming the fixes, instead of racing the compute stream."""
    from fsdp_trainer.models.llama import TransformerBlock, build, model_args_from_config
    from fsdp_trainer.parallelize import apply_fsdp, init_weights

    model = build(model_args_from_config(tiny_config().model), device="meta")
    apply_fsdp(model, distributed.build_mesh("cuda", 1, info.world_size), block_types=(TransformerBlock,),
               grads_in_compute_pool=True)
    init_weights(model, torch.device("cuda"))
    tokens = torch.randint(0, 320, (2, 32), device="cuda")
    model(tokens).float().logsumexp(-1).mean().backward()
    with pytest.raises(RuntimeError, match="would add into gradients that already exist"):
        model(tokens).float().logsumexp(-1).mean().backward()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cpu_offload_trains_on_two_gpus(tmp_path):
    """With the gradients in host memory, the global gradient norm is all-reduced over gloo beside NCCL, and each
    rank's host AdamW runs on its half of the cores, not the one thread torchrun gives it."""
    import os
    import subprocess
    import sys

    out = tmp_path / "offload"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
                          "fsdp_trainer.train", "--model.name", "debug", "--train.steps", "4", "--train.log_every",
                          "1", "--data.source", "synthetic", "--parallel.cpu_offload", "--parallel.no_compile",
                          "--train.output_dir", str(out), "--checkpoint.interval", "0", "--checkpoint.no_save_final",
                          "--metrics.no_tensorboard", "--eval.every", "0"], check=True, timeout=300, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["grad_norm"] > 0 for row in rows)
    assert f"host AdamW on {max(1, len(os.sched_getaffinity(0)) // 2)} threads" in run.stderr


def test_a_profiled_memory_snapshot_leaves_the_oom_history_recording(info, tmp_path):
    """memory.oom_snapshot records the allocator's history for the whole run, for the snapshot an OOM writes; a
    profile's memory snapshot in between must leave it recording."""
    torch.cuda.memory._record_memory_history(enabled=None)
    try:
        _run(info, tmp_path, train={"steps": 4}, profile={"steps": "2:3", "memory_snapshot": True},
             memory={"oom_snapshot": True})
        assert list((tmp_path / "profile").glob("memory_rank0_steps2-3.pickle"))
        marker = torch.empty(12345, dtype=torch.uint8, device="cuda")
        traces = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        assert any(t["action"] == "alloc" and t["size"] >= 12345 and t["addr"] == marker.data_ptr()
                   for t in traces[-50:])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _faulty_job(tmp_path, fault: str, timeout_s: int, *model_flags: str):
    """A 2-GPU NCCL job (the tiny model unless `model_flags` say otherwise) whose rank 1 suffers `fault` at its 4th
    step; returns the finished process and the seconds it took."""
    from helpers import TINY_FLAGS, launch_fault
    return launch_fault(fault, "1", 4, *(model_flags or TINY_FLAGS), "--data.source", "synthetic", "--train.steps",
                        "8", "--train.output_dir", str(tmp_path), "--dist.timeout_s", str(timeout_s),
                        "--checkpoint.interval", "0", "--checkpoint.no_save_final", timeout=300, torchrun=True)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_crash_under_nccl_ends_the_job_at_once_naming_the_rank(tmp_path):
    """The crashed rank aborts its NCCL groups: a graceful teardown would wait for the peer it left inside a
    collective until that peer's watchdog fired (dist.timeout_s, 90 s here), and the job would blame the peer."""
    proc, elapsed = _faulty_job(tmp_path, "crash", 90)
    assert proc.returncode != 0 and "injected crash" in proc.stderr
    assert "rank      : 1" in proc.stderr and "no progress" not in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, elapsed


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_hung_rank_under_nccl_is_the_only_suspect(tmp_path):
    """Rank 1 hangs outside any collective at its 4th step. With a model whose steps fill the GPU (Llama 3.2 1B,
    eager), rank 0's CPU then stops inside that step too, in the autograd engine or on a full launch queue, while
    its GPU waits in a collective: the watchdog must count rank 0 as waiting, not as busy."""
    proc, _ = _faulty_job(tmp_path, "hang", 10, "--config", "configs/llama3_1b.toml", "--parallel.no_compile",
                          "--data.num_workers", "0")
    verdicts = sorted({line.split("suspect rank(s): ", 1)[1] for line in proc.stderr.splitlines()
                       if "suspect rank(s): " in line})
    assert proc.returncode != 0 and verdicts, proc.stderr[-3000:]
    assert all(v.startswith("1 (") and "; 0 (" not in v for v in verdicts), verdicts
    # Rank 0's flight recorder, dumped by its watchdog, holds the collectives it last ran (its buffer is on).
    import pickle
    dump = tmp_path.resolve() / "flight_recorder" / "watchdog_rank0"
    assert f"flight recorder trace written to {dump}" in proc.stderr
    assert pickle.loads(dump.read_bytes())["entries"], "an empty flight recorder"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("rank,untried", [(0, "1 -> 0"), (1, "")])
def test_a_dead_link_under_nccl_is_named_alone(rank, untried):
    """Under NCCL a rank's sends and receives share one stream: the doctor names the one link that never delivered,
    not also the link that waited behind it (tests/test_doctor.py checks the same on gloo)."""
    from test_doctor import timed_out_check
    proc, failed = timed_out_check(f"drop:rank={rank}", nproc=2, deadline=10)
    assert json.loads(proc.stdout)["environment"]["backend"] == "nccl"
    assert failed["name"] == "send_recv_ring" and failed["links"] == [[rank, 1 - rank]], failed["error"]
    assert f"no data arrived over {rank} -> {1 - rank} (within " in failed["error"]
    assert "NCCL_P2P_DISABLE=1" in failed["error"]
    assert (f"; {untried} untried" in failed["error"]) if untried else ("untried" not in failed["error"])


def test_generate_on_one_gpu_gives_the_cpu_s_tokens(tmp_path):
    """`tools.generate --device cuda`: the same greedy tokens as on the CPU, for a model imported by convert."""
    transformers = pytest.importorskip("transformers")
    from fsdp_trainer.tools import convert, generate, weights
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, rope_theta=500000.0,
                                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "checkpoints")])
    prompt = [72, 105, 33, 10, 300, 7]
    tokens = [generate.greedy(weights.load_model(str(tmp_path / "checkpoints"), device), prompt, 32)
              for device in ("cpu", "cuda")]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 32
