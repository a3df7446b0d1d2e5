"""The doctor as users run it: real gloo groups under torchrun, healthy and with injected faults.

Every run is a subprocess with its own timeout, so a doctor that hangs fails its test instead of the suite.
"""

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_trainer.tools import doctor
from fsdp_trainer.tools.doctor import FAULT_VAR, DoctorArgs, bus_factor, parse_sizes

from helpers import TORCHRUN, checkout_env, node_name, side_by_side

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv_ring"]


def run_doctor(*args: str, nproc: int = 0, fault: str = "", timeout: float = 120, path: str = "",
               pythonpath: str = ""):
    """(completed process, seconds) of `python -m fsdp_trainer.tools.doctor`, under torchrun when nproc > 0, with `path`
    searched first for programs and `pythonpath` for modules."""
    launcher = [*TORCHRUN, f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    env = {k: v for k, v in checkout_env().items() if k != FAULT_VAR}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env["PYTHONPATH"]]))
    if path:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    if fault:
        env[FAULT_VAR] = fault
    start = time.monotonic()
    proc = subprocess.run([*launcher, "-m", "fsdp_trainer.tools.doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def timed_out_check(fault: str, nproc: int, deadline: int = 5):
    """(completed process, the failed check) of a doctor run with `fault`, which must end within its deadline
    (plus start-up of the ranks) and fail: before the group's own timeout, 30 s after the deadline, could end it."""
    proc, seconds = run_doctor("--json", "--deadline-s", str(deadline), nproc=nproc, fault=fault)
    assert proc.returncode != 0 and seconds < deadline + 30, f"took {seconds:.1f} s"
    return proc, json.loads(proc.stdout)["checks"][-1]


def test_available_memory_counts_the_page_cache_linux_can_drop(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:   12000000 kB\n")
    assert doctor._available_memory_bytes(str(meminfo)) == 12000000 * 1024
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")  # without /proc: free memory, roughly
    assert abs(doctor._available_memory_bytes(str(tmp_path / "absent")) - free) < 2**30


def test_sizes_and_bus_bandwidth_factors():
    assert parse_sizes("1K..1M") == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert parse_sizes("64KiB") == [1024, 4096, 16384, 65536]
    assert parse_sizes("0") == []
    for nothing in ("-4K", "0..1M", "1M..1K", "nan", "abc"):  # each would measure nothing, or is a typo
        with pytest.raises(ValueError):
            parse_sizes(nothing)
    # nccl-tests: all_reduce moves 2(n-1)/n of the buffer per rank, all_gather and reduce_scatter (n-1)/n.
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 3 / 4


def test_the_report_is_found_among_other_output():
    report = {"ok": True, "checks": []}
    stdout = "\n".join(["node1:12:12 [0] NCCL INFO Bootstrap : Using eth0", json.dumps(report),
                        "node1:13:13 [1] NCCL INFO comm 0x1 rank 1 nRanks 2 - Destroy COMPLETE", "{not json"])
    assert doctor.last_report(stdout) == report
    assert doctor.last_report("Traceback (most recent call last):") is None


def test_the_report_leaves_in_one_write_for_other_threads_output_not_to_land_inside(tmp_path, monkeypatch):
    """NCCL_DEBUG writes to the same streams from threads of its own: the text report and the JSON, each well over
    PIPE_BUF (4 KiB), each reach their file in one write() (Python's streams would write line by line, or per 8 KiB)."""
    stdout, stderr = open(tmp_path / "stdout", "w"), open(tmp_path / "stderr", "w", buffering=1)  # as Python's own
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    writes, real_write = [], os.write

    def write(fd, data):
        writes.append((fd, bytes(data)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    run = doctor.Doctor(DoctorArgs(json=True), [], None)
    error = "rank 1 raised OutOfMemoryError: " + "CUDA out of memory. " * 5
    run.report["checks"] = [{"name": f"bandwidth all_reduce {i} MiB", "ok": False, "ranks": [1], "error": error}
                            for i in range(64)]
    run._emit(1)
    for stream in (stdout, stderr):
        fd = stream.fileno()
        stream.close()
        whole = Path(stream.name).read_bytes()
        assert len(whole) > 4096 and [data for to, data in writes if to == fd] == [whole], stream.name


def test_the_doctor_waits_for_its_gpu_before_it_reports_a_collective_or_a_time(monkeypatch):
    """GPU work is queued, not done, when the host goes on. The entry key waits for this rank's own queued work (a
    wedged GPU must read as never having entered the collective, not as a transport that hangs), a ring receive's key
    for the data (NCCL's wait() only orders the stream; a ring send's alike), and a bandwidth time for its end
    event."""
    events = []

    class Stream:
        def synchronize(self):
            events.append("GPU sync")

    class Store:
        def set(self, key, value):
            events.append(f"set {key}")

    class Event:  # as CUDA's: no time until the end event is done
        def __init__(self, enable_timing):
            self.done = False

        def record(self):
            pass

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            if not end.done:
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return 4.0

    real_ones = torch.ones
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "ones", lambda size, device: real_ones(size))  # no GPU here
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: None)
    monkeypatch.setattr(dist, "irecv", lambda tensor, src: SimpleNamespace(wait=lambda: events.append(f"from {src}")))
    run = doctor.Doctor(DoctorArgs(iters=2), [], None)
    run.device, run.rank, run.n, run.step, run.store = torch.device("cuda"), 1, 2, "all_reduce", Store()
    run._entering()
    run._receive(torch.zeros(1), 0, 8, 1)
    assert events == ["GPU sync", "set doctor/all_reduce/entered/1", "from 0", "GPU sync",
                      "set doctor/ring/1/8/received/1"]
    assert run._time("all_reduce", 8) == {"seconds": 4.0 / 1e3 / 2}


def test_try_fixes_offers_no_loopback_or_bridge(monkeypatch):
    # They pass on one node, so the fix found would break the first run across nodes.
    names = ["lo", "eno1", "docker0", "veth3a1f", "virbr0", "br-5e2c1a", "cni0", "ib0"]
    monkeypatch.setattr(doctor.socket, "if_nameindex", lambda: list(enumerate(names, 1)))
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    assert [v for k, v in doctor._candidates(nccl=True) if k == "NCCL_SOCKET_IFNAME"] == ["eno1", "ib0"]
    assert doctor._candidates(nccl=False) == [("GLOO_SOCKET_IFNAME", "eno1"), ("GLOO_SOCKET_IFNAME", "ib0")]


def test_link_verdict_tells_a_host_s_transport_from_the_network():
    facts = {r: {"host": "a" if r < 2 else "b"} for r in range(4)}
    within = doctor._link_verdict([[0, 1]], facts, nccl=True)
    assert "0 -> 1 (within a)" in within and "NCCL_P2P_DISABLE=1" in within and "Between hosts" not in within
    between = doctor._link_verdict([[1, 2]], facts, nccl=True)
    assert "1 -> 2 (a -> b)" in between and "NCCL_IB_DISABLE=1" in between and "Within a host" not in between


@pytest.mark.slow
def test_failed_run_exits_without_waiting_on_the_group_teardown():
    # Stand-in for NCCL's teardown after a failed collective, which can block for good.
    script = ("import threading\n"
              "from fsdp_trainer import distributed\nfrom fsdp_trainer.tools import doctor\n"
              "distributed.shutdown = threading.Event().wait\n"
              "doctor.main(['--sizes', '0'])\n")
    env = checkout_env(**{FAULT_VAR: "wrong:rank=0"})
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "== result: FAIL ==" in proc.stdout, proc.stdout + proc.stderr


# The refused arguments' cases: the flags, the fault variable, and the error they get.
REFUSED = {
    "iters": (["--iters", "0"], "", "--iters 0: the bandwidth table needs at least one timed run per size"),
    "deadline": (["--deadline-s", "0"], "", "--deadline-s 0: must be above 0"),
    "nproc": (["--nproc", "-1"], "", "--nproc -1: must be 0"),
    "sizes-abc": (["--sizes", "abc"], "", "--sizes abc: abc is not a size of 1 byte or more; expected sizes of 1 byte "
                                          "or more: a range (1K..1G), a top (64M"),
    "sizes-negative": (["--sizes", "-4K"], "", "--sizes -4K: -4K is not a size of 1 byte or more; expected"),
    "sizes-backwards": (["--sizes", "2K..1K"], "", "--sizes 2K..1K: the range runs backwards; expected"),
    "fault": ([], "hang:rank=one", f"{FAULT_VAR}=hang:rank=one: expected hang, wrong, raise, stall, stall_between, "
                                   "drop, drop_remote or wedge, then :rank=N"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_nonsensical_arguments_are_refused_like_argparse_before_anything_runs(monkeypatch, capsys, case):
    flags, fault, error = REFUSED[case]
    monkeypatch.setenv(FAULT_VAR, fault)
    monkeypatch.setattr(doctor, "Doctor", lambda *a: pytest.fail("the doctor ran"))
    monkeypatch.setattr(doctor, "try_fixes", lambda *a: pytest.fail("the doctor ran"))
    with pytest.raises(SystemExit) as exited:
        doctor.main(flags)
    assert exited.value.code == 2
    assert f"python -m fsdp_trainer.tools.doctor: error: {error}" in capsys.readouterr().err


def test_every_variable_the_trainer_sets_is_explained(tmp_path, monkeypatch):
    from fsdp_trainer.tools.faults import enable_flight_recorder
    environ = {k: v for k, v in os.environ.items() if k not in doctor.KNOWN_VARIABLES}
    before = set(environ)
    monkeypatch.setattr(os, "environ", environ)  # a copy, so that nothing set here outlives the test
    enable_flight_recorder(tmp_path)
    new = environ.keys() - before
    assert new and new <= doctor.KNOWN_VARIABLES.keys(), new - doctor.KNOWN_VARIABLES.keys()


@pytest.mark.slow
def test_single_process(doctor_run):
    proc, _ = doctor_run.result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for section in ("== environment ==", "== checks", "== bandwidth", "== result: PASS =="):
        assert section in proc.stdout
    assert "send_recv_ring   SKIP" in proc.stdout  # a ring needs two ranks; skipping is not failing


@pytest.mark.slow
def test_two_ranks_healthy_text_report(doctor_run):
    proc, _ = doctor_run.result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rank(s) on 1 host(s)" in proc.stdout
    for name in CHECKS:
        assert f"  {name:<16} PASS" in proc.stdout
    assert "1 MiB  reduce_scatter" in proc.stdout and "== result: PASS ==" in proc.stdout


def fake_nvidia_smi(folder: Path, script: str) -> str:
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
    (folder / "nvidia-smi").chmod(0o755)
    return str(folder)


@pytest.mark.slow
def test_a_slow_topology_query_leaves_the_other_ranks_time(tmp_path):
    """Rank 0 asks nvidia-smi for the topology while the others wait for it in the first check: a slow
    nvidia-smi must not use up their deadline."""
    path = fake_nvidia_smi(tmp_path, "sleep 60")
    proc, _ = run_doctor("--json", "--sizes", "0", "--deadline-s", "6", nproc=2, path=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["environment"]["topology"] == "nvidia-smi topo -m did not answer within 3 s (a wedged driver or GPU?)"
    assert all(check["ok"] for check in report["checks"])


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_wedged_in_its_own_gpu_queries_is_named(doctor_run, rank):
    """Stuck before any collective (a CUDA query or nvidia-smi in a wedged driver): named as such, not as a
    transport that hangs."""
    _, check = doctor_run.result()
    assert check["name"] == "environment" and check["ranks"] == [rank], check
    assert f"rank(s) {rank} are stuck gathering their facts" in check["error"]


@pytest.mark.slow
def test_a_rank_that_never_joins_is_reported_by_rank_0_even_if_rank_0_started_late(tmp_path):
    """Without a group there is no store to wait on: the other ranks must not exit (and have torchrun stop rank 0)
    before rank 0, whose deadline comes later when it started later, has written the report."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, threading, time\n"
        "if os.environ.get('RANK') == '0':\n"
        "    time.sleep(2)  # a slower start, as from a shared filesystem\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import fsdp_trainer.distributed as distributed\n"
        "    distributed.init = lambda **kwargs: threading.Event().wait()  # never joins\n")
    proc, _ = run_doctor("--json", "--deadline-s", "4", nproc=2, pythonpath=str(tmp_path))
    assert proc.returncode == 1
    (check,) = json.loads(proc.stdout)["checks"]
    assert check["name"] == "init" and check["timed_out"] and "took over 4 s" in check["error"], check


@pytest.mark.slow
def test_four_ranks_healthy_json(doctor_run):
    proc, _ = doctor_run.result()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout holds the JSON object only; the text report went to stderr
    assert report["ok"] and "== checks" in proc.stderr
    assert report["environment"]["world_size"] == 4 and len(report["environment"]["ranks"]) == 4
    assert [c["name"] for c in report["checks"]] == CHECKS and all(c["ok"] for c in report["checks"])
    rows = report["bandwidth"]
    assert {(r["op"], r["bytes"]) for r in rows} == {(op, size) for op in ("all_reduce", "all_gather", "reduce_scatter")
                                                     for size in parse_sizes("1M")}
    for r in rows:  # nccl-tests' definitions: algbw = bytes / time, busbw = algbw x 2(n-1)/n or (n-1)/n
        assert r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (1.5 if r["op"] == "all_reduce" else 0.75))


@pytest.mark.slow
def test_wrong_value_names_the_rank_and_the_operation(doctor_run):
    proc, _ = doctor_run.result()
    assert proc.returncode != 0
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert not checks["all_reduce"]["ok"] and not checks["reduce_scatter"]["ok"]
    # all_gather and the ring show whose data was wrong; broadcast from rank 0 does not involve rank 1's data.
    assert checks["all_gather"]["suspects"] == [1] and checks["send_recv_ring"]["suspects"] == [1]
    assert checks["broadcast"]["ok"]
    assert "all_gather       FAIL" in proc.stderr and "the bad data came from rank(s) 1" in proc.stderr
    assert "suspect rank(s): 1 " in proc.stderr
    assert "bandwidth: not measured" in proc.stderr


@pytest.mark.slow
def test_hang_is_reported_within_the_deadline(doctor_run):
    proc, failed = doctor_run.result()
    assert failed["name"] == "all_reduce" and failed["timed_out"] and failed["ranks"] == [1]
    assert "all_reduce       TIMEOUT" in proc.stderr
    assert "rank 1" in failed["error"] and "never arrived" in failed["error"]


@pytest.mark.slow
def test_try_fixes_finds_the_setting_that_passes(monkeypatch, capsys):
    # Stand-in for an NCCL setting: the one "fix" on offer clears the injected fault, so it must be the one found.
    monkeypatch.setenv(FAULT_VAR, "wrong:rank=1")
    monkeypatch.setattr(doctor, "_candidates", lambda nccl: [(FAULT_VAR, "")])
    code = doctor.try_fixes(DoctorArgs(json=True, try_fixes=True, nproc=2, sizes="0", deadline_s=30))
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 1 and not result["ok"] and not result["baseline"]["ok"]  # unchanged, it still fails
    assert result["fix"] == f"{FAULT_VAR}=" and result["attempts"][0]["ok"]
    assert "(unchanged)" in err and f"fix: export {FAULT_VAR}=" in err


@pytest.mark.slow
def test_rank_that_raised_is_the_suspect_not_the_ranks_left_waiting(doctor_run):
    proc, failed = doctor_run.result()
    assert failed["name"] == "all_reduce" and failed["timed_out"]
    assert failed["suspects"] == [1] and failed["ranks"] == [1]
    assert "rank 1" in failed["error"] and "failed: RuntimeError: injected fault" in failed["error"]
    assert "rank(s) 0 are waiting inside it for rank(s) 1" in failed["error"]
    assert "transport itself hangs" not in failed["error"] and "suspect rank(s): 1 " in proc.stderr
    assert not any("SOCKET_IFNAME" in hint for hint in json.loads(proc.stdout)["hints"])  # not the transport's


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("stall", ["stall", "stall_between"])
def test_a_rank_stuck_before_the_collective_is_named_not_the_transport(doctor_run, stall, rank):
    """Arrived at its first check, then stuck in its own work before the collective (as on a GPU that wedged
    mid-run): named as the suspect the other rank waits for inside the collective, even when it is rank 0. The same
    where it stalls between two sizes: the other rank then waits inside the second size's collective, while the
    stalled rank entered only the first."""
    proc, failed = doctor_run.result()
    assert failed["name"] == "all_reduce" and failed["suspects"] == [rank] and failed["ranks"] == [rank], failed
    assert f"rank(s) {rank} arrived but never entered the collective" in failed["error"]
    assert f"rank(s) {1 - rank} are waiting inside it for rank(s) {rank}" in failed["error"]
    assert "transport" not in failed["error"] and f"suspect rank(s): {rank} " in proc.stderr
    hints = json.loads(proc.stdout)["hints"]
    assert any("py-spy dump" in hint for hint in hints) and not any("SOCKET_IFNAME" in hint for hint in hints)


# The dead link cases: the ranks, the rank whose sends are dropped, and the links left untried.
DEAD_LINKS = {"2-ranks-0": (2, 0, "1 -> 0"), "2-ranks-1": (2, 1, ""), "3-ranks-0": (3, 0, "2 -> 0, 1 -> 2")}


@pytest.mark.slow
def test_ring_hang_names_the_link_that_never_delivered(doctor_run):
    proc, failed = doctor_run.result()
    assert failed["name"] == "send_recv_ring" and failed["timed_out"]
    # Rank 1's sends never leave: rank 2 waits on it, and rank 0, a size further on, waits on rank 2.
    assert failed["links"] == [[1, 2]], failed["error"]
    assert "no data arrived over 1 -> 2 (within " in failed["error"] and "GLOO_SOCKET_IFNAME" in failed["error"]
    assert any(hint.startswith("GLOO_SOCKET_IFNAME") for hint in json.loads(proc.stdout)["hints"])


@pytest.mark.slow
@pytest.mark.parametrize("nproc,rank,untried", DEAD_LINKS.values(), ids=DEAD_LINKS)
def test_a_dead_link_is_named_alone_not_with_the_links_that_wait_on_it(doctor_run, nproc, rank, untried):
    """Each rank takes its second link of the ring only once its first is through, as under NCCL. A dead 0 -> 1 leaves
    rank 1 without its receive, so it never sends, and rank 0 without its send, so it never receives: 0 -> 1 is named,
    and the links left untried (between two ranks, 1 -> 0) are not. A dead 1 -> 0 leaves rank 0 alone waiting."""
    _, failed = doctor_run.result()
    after = (rank + 1) % nproc
    assert failed["name"] == "send_recv_ring" and failed["links"] == [[rank, after]], failed["error"]
    assert f"no data arrived over {rank} -> {after} (within " in failed["error"]
    said = f"; {untried} untried: a rank takes its second link of the ring only once its first is through"
    assert (said in failed["error"]) if untried else ("untried" not in failed["error"]), failed["error"]


def two_node_doctor(fault: str = "", per_node: int = 2) -> dict:
    """The doctor on two "nodes" of `per_node` ranks on this host (two torchrun agents meeting in a c10d rendezvous,
    as on two machines): rank 0's JSON report."""
    from helpers import free_port
    env = {k: v for k, v in checkout_env().items() if k != FAULT_VAR}
    if fault:
        env[FAULT_VAR] = fault
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=doctor-{port}", "--local-addr=127.0.0.1",
           "-m", "fsdp_trainer.tools.doctor", "--json", "--deadline-s", "5", "--sizes", "0"]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=90) for agent in agents]
    reports = [json.loads(out) for out, _ in outputs if out.strip()]
    assert len(reports) == 1, [err[-2000:] for _, err in outputs]
    return reports[0]


@pytest.mark.slow
def test_one_rank_per_node_needs_no_second_ring_and_names_the_dead_link(doctor_run):
    """With one rank a node, the ring crosses between nodes on every link: no second ring to run (it would share the
    first one's store keys and run the same links again)."""
    healthy, failed = doctor_run.result()
    assert healthy["ok"] and [c["name"] for c in healthy["checks"]] == CHECKS
    check = failed["checks"][-1]
    assert check["name"] == "send_recv_ring" and check["timed_out"] and check["links"] == [[1, 0]], check


@pytest.mark.slow
def test_a_dead_network_link_of_any_gpu_is_named_on_several_nodes(doctor_run):
    """The ring leaves a node from one GPU only; the second ring, rank -> same local rank of the next node, uses
    every GPU's link between nodes: rank 0's (which the first ring never sends over) is named when it is dead."""
    healthy, failed = doctor_run.result()
    assert healthy["ok"] and [c["name"] for c in healthy["checks"]] == [*CHECKS, "send_recv_nodes"]
    assert not failed["ok"] and all(c["ok"] for c in failed["checks"][:-1]), failed["checks"]
    check = failed["checks"][-1]
    assert check["name"] == "send_recv_nodes" and check["timed_out"] and check["links"] == [[0, 2]], check
    assert "no data arrived over 0 -> 2" in check["error"]


def two_node_doctors(fault: str, per_node: int = 2) -> tuple[dict, dict]:
    """(two_node_doctor healthy, two_node_doctor with `fault`)."""
    return two_node_doctor(per_node=per_node), two_node_doctor(fault, per_node)


@pytest.fixture(scope="module")
def doctor_runs(request):
    """The doctor runs of this module's tests, three at a time, longest first: each spends seconds importing torch on
    every rank, and those with a fault then wait out their deadline. Three keep both cores busy without slowing any
    rank's start so much that its group's set-up comes near a deadline. Keyed by test name."""
    def timed_out(fault: str, nproc: int = 2):
        return partial(timed_out_check, fault, nproc)

    runs = {node_name(test_a_dead_network_link_of_any_gpu_is_named_on_several_nodes):
                partial(two_node_doctors, "drop_remote:rank=0"),
            node_name(test_one_rank_per_node_needs_no_second_ring_and_names_the_dead_link):
                partial(two_node_doctors, "drop:rank=1", per_node=1),
            node_name(test_ring_hang_names_the_link_that_never_delivered): timed_out("drop:rank=1", 3),
            node_name(test_hang_is_reported_within_the_deadline): timed_out("hang:rank=1"),
            node_name(test_rank_that_raised_is_the_suspect_not_the_ranks_left_waiting): timed_out("raise:rank=1")}
    for case, (nproc, rank, _) in DEAD_LINKS.items():
        runs[node_name(test_a_dead_link_is_named_alone_not_with_the_links_that_wait_on_it, case)] = timed_out(
            f"drop:rank={rank}", nproc)
    for rank in (0, 1):
        runs[node_name(test_a_rank_wedged_in_its_own_gpu_queries_is_named, rank)] = timed_out(f"wedge:rank={rank}")
        for stall in ("stall", "stall_between"):
            runs[node_name(test_a_rank_stuck_before_the_collective_is_named_not_the_transport, f"{stall}-{rank}")] = \
                timed_out(f"{stall}:rank={rank}")
    runs[node_name(test_four_ranks_healthy_json)] = partial(run_doctor, "--json", "--sizes", "1M", "--iters", "5",
                                                            nproc=4)
    runs[node_name(test_two_ranks_healthy_text_report)] = partial(run_doctor, "--sizes", "1M", nproc=2)
    runs[node_name(test_wrong_value_names_the_rank_and_the_operation)] = partial(
        run_doctor, "--json", "--sizes", "1M", nproc=2, fault="wrong:rank=1")
    runs[node_name(test_single_process)] = run_doctor
    return side_by_side(request, runs, at_once=3)


@pytest.fixture
def doctor_run(doctor_runs, request):
    """This test's run, which doctor_runs made: .result() is what its function returned, or raises what it raised."""
    return doctor_runs[request.node.name]


def test_environment_warnings_name_the_host_or_ranks_and_what_to_do():
    """/dev/shm per host (missing, or under 1 GiB); NCCL_/TORCH_/GLOO_ variables that differ from rank 0's, but not
    CUDA_VISIBLE_DEVICES, which launchers set per rank; GPU models that differ."""
    def rank(number: int, host: str, shm, gpu: str = "NVIDIA H100 80GB HBM3", **variables) -> dict:
        return {"rank": number, "host": host, "shm_bytes": shm, "gpu": {"name": gpu},
                "variables": {"NCCL_DEBUG": "WARN", **variables}}

    healthy = [rank(0, "a", doctor.GiB, CUDA_VISIBLE_DEVICES="0"), rank(1, "a", None, CUDA_VISIBLE_DEVICES="1"),
               rank(2, "b", 16 * doctor.GiB, CUDA_VISIBLE_DEVICES="0")]
    assert doctor._environment_warnings(healthy) == []  # each host's /dev/shm is its first rank's
    broken = [rank(0, "a", None), rank(1, "b", 64 * 2**20, NCCL_DEBUG="INFO"), rank(2, "c", 2**29),
              rank(3, "c", doctor.GiB, gpu="NVIDIA A100-SXM4-80GB", NCCL_IB_DISABLE="1")]
    assert doctor._environment_warnings(broken) == [
        "a: no /dev/shm; NCCL's shared-memory transport cannot work (NCCL_SHM_DISABLE=1)",
        "b: /dev/shm is only 64 MiB, under 1 GiB (Docker's default is 64 MB); NCCL's shared-memory transport fails "
        "or hangs with it. Restart the container with --shm-size=16g (or --ipc=host), or set NCCL_SHM_DISABLE=1",
        "c: /dev/shm is only 512 MiB, under 1 GiB (Docker's default is 64 MB); NCCL's shared-memory transport fails "
        "or hangs with it. Restart the container with --shm-size=16g (or --ipc=host), or set NCCL_SHM_DISABLE=1",
        "rank(s) 1, 3 see different NCCL_/TORCH_/GLOO_ variables than rank 0; set them the same on every node",
        "ranks run on different GPU models; the slowest sets the pace of every collective"]
