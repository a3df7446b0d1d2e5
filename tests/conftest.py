import multiprocessing
import subprocess

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available (the GPU machine), never in CPU-only CI."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run, rather than hang at exit, when a test left child processes running: Python's exit waits for
    them, and one that ignores SIGTERM (a data loader worker) would be waited for forever."""
    leftovers = multiprocessing.active_children()
    for child in leftovers:
        child.kill()
        child.join()
    if leftovers:
        names = ", ".join(f"{c.name} (pid {c.pid})" for c in leftovers)
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"FAILED: the tests left child processes running: {names}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


class LaunchInFastTest(RuntimeError):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The fast tier is the tests without a process launch: one that starts a process (torchrun, a script, gloo
    ranks), in its body or in a fixture of any scope, must be marked slow, or it fails and says so."""
    if "slow" in item.keywords:
        yield
        return

    def refuse(*args, **kwargs):
        raise LaunchInFastTest(f"{item.nodeid} starts a process: mark it @pytest.mark.slow")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield
