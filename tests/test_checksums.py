"""Checksums of checkpoint files (tools/checksums.py): recorded by every save, checked while resume, init_from and
export read a checkpoint, and by `verify`; the marker's own CRC32. A save of one rank in this process, except where
a test says otherwise."""

import errno
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_trainer import checkpoint as ck
from fsdp_trainer.tools import checksums as cs
from fsdp_trainer.tools import checkpoints as ckpt_cli
from fsdp_trainer.tools import convert
from fsdp_trainer.train import main

from helpers import run_ranks
from test_checkpoint import TINY, drop_checksums, flip_a_bit, small, train_in_process  # noqa: F401 - small: a fixture


def summed_files(step: Path) -> set[str]:
    """The files of a checkpoint that its checksums cover: all but the marker that holds them and config.toml."""
    return {p.name for p in step.iterdir()} - {ck.MARKER, ck.CONFIG}


@pytest.mark.slow
def test_a_marker_changed_since_the_save_is_unusable(small, tmp_path, capsys):
    """A digit changed in trainer_state.json (consumed_samples 8 -> 9) would resume one sample on: the marker's own
    CRC32 catches it, at resume, in verify and in list; with the sum's line deleted (an edit on purpose) it loads."""
    root = tmp_path / "checkpoints"
    shutil.copytree(small / "checkpoints", root)
    marker = ck.step_dir(root, 4) / ck.MARKER
    text = marker.read_text()
    assert '"consumed_samples": 8,' in text
    marker.write_text(text.replace('"consumed_samples": 8,', '"consumed_samples": 9,'))
    flags = [*TINY, "--train.output_dir", str(tmp_path), "--train.steps", "5", "--checkpoint.async_mode", "none"]
    with pytest.raises(SystemExit):
        main(flags)
    assert re.search(f"step_00000004 cannot be used: it has a {ck.MARKER} that differs from what the save wrote .*"
                     f"delete its \"{cs.MARKER_SUM}\" line", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        ckpt_cli.main(["verify", str(ck.step_dir(root, 4))])
    assert f"it has a {ck.MARKER} that differs from what the save wrote" in capsys.readouterr().err
    ckpt_cli.main(["list", str(root)])
    assert f"step_00000004  UNUSABLE: it has a {ck.MARKER} that differs" in capsys.readouterr().out

    state = json.loads(marker.read_text())
    del state[cs.MARKER_SUM]
    marker.write_text(json.dumps(state))
    main(flags)
    assert f"resuming from {ck.step_dir(root, 4)}: step 4, 9 samples" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_verify_names_a_changed_file(small, tmp_path, capsys, name):
    """One flipped bit in a summed file: `verify` and export name the file, and export writes nothing;
    `to-hf --no-checksums` salvages what a damaged shard still holds. A checkpoint without checksums cannot be
    verified, and says so."""
    step = tmp_path / "step_00000004"
    shutil.copytree(small / "checkpoints/step_00000004", step)
    ckpt_cli.main(["verify", str(step)])
    files = len(summed_files(step))
    assert re.fullmatch(rf"{step}: {files} files \([\d.]+ GB\) match their checksums \(\.metadata and {files - 1} "
                        r"data files checked by this process in [\d.]+ s\)\n", capsys.readouterr().out)
    flip_a_bit(step / name)
    for command in (ckpt_cli.main, ["verify", str(step)]), (convert.main, ["to-hf", str(step), str(tmp_path / "export")]):
        with pytest.raises(SystemExit) as exit_info:
            command[0](command[1])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"checkpoint {step} is corrupt: {name} differs from what the save wrote" \
            in err, (command, err)
    assert not (tmp_path / "export").exists()
    if name != ".metadata":
        convert.main(["to-hf", "--no-checksums", str(step), str(tmp_path / "export")])
        assert (tmp_path / "export/model.safetensors").is_file()
    plain = tmp_path / "plain" / "step_00000004"
    shutil.copytree(small / "checkpoints/step_00000004", plain)
    drop_checksums(plain)
    with pytest.raises(SystemExit) as exit_info:
        ckpt_cli.main(["verify", str(plain)])
    assert exit_info.value.code == 2 and f"{cs.NO_CHECKSUMS}, so it cannot be verified" in capsys.readouterr().err


@pytest.mark.slow
def test_a_damaged_copy_outside_a_run_s_step_folders_is_not_told_to_be_renamed(small, tmp_path, capsys):
    """Renaming a folder that is no run's step_<number> changes nothing, and resume never looks at it: the ways on
    are copying it again or another checkpoint."""
    copy = tmp_path / "mycopy"
    shutil.copytree(small / "checkpoints/step_00000004", copy)
    flip_a_bit(copy / "__0_0.distcp")
    with pytest.raises(SystemExit):
        ckpt_cli.main(["verify", str(copy)])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("copy it again from where it was saved; or use another checkpoint"), err
    assert ".unusable" not in err


def check_with_an_unreadable_file(step: str, unreadable: str) -> str:
    """On each rank: checked() over the group, where reading `unreadable` fails as on a failing disk (EIO)."""
    dist.init_process_group("gloo")
    real = cs._file_sum

    def failing(path: Path, stop) -> list[int]:
        if path.name == unreadable:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, stop)

    cs._file_sum = failing
    try:
        with cs.checked(ck.check_usable(Path(step)), dist.group.WORLD, "the fix", threads=2):
            pass
    except ck.CheckpointError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_file_that_cannot_be_read_is_reported_by_every_rank(small):
    """An I/O error while one rank checks its share is a problem like any other: every rank raises the same
    CheckpointError, where one rank's OSError would leave the other waiting for it in the exchange of results."""
    step = small / "checkpoints/step_00000004"
    unreadable = sorted(summed_files(step) - {".metadata"})[1::2][0]  # in rank 1's share
    messages = run_ranks(check_with_an_unreadable_file, 2, str(step), unreadable)
    assert messages[0] == messages[1]
    assert f"is corrupt: {unreadable} cannot be read (OSError: [Errno 5] Input/output error)" in messages[0]
    assert messages[0].endswith("the fix")


@pytest.mark.slow
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_a_checkpoint_loads_stops_its_check_at_once(small, monkeypatch, interrupt):
    """Ctrl-C, or an exit, while the block of checked() reads the checkpoint: the interrupt goes on at once, and no
    thread goes on reading the files, which for a large checkpoint would take minutes."""
    reads = []

    class SlowFile:  # 5 s to read, a byte at a time
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def readinto(self, buffer) -> int:
            time.sleep(0.01)
            reads.append(None)
            return 1 if len(reads) < 500 else 0

    checkpoint = ck.check_usable(small / "checkpoints/step_00000004")
    real_open = open  # .metadata is checked before the block, as it is read there
    monkeypatch.setattr(cs, "open", lambda path, *args, **kwargs: real_open(path, *args, **kwargs)
                        if Path(path).name == ".metadata" else SlowFile(), raising=False)
    with pytest.raises(interrupt):
        with cs.checked(checkpoint, None, "the fix", threads=2):
            deadline = time.monotonic() + 10
            while not reads and time.monotonic() < deadline:  # the check is under way
                time.sleep(0.01)
            start = time.monotonic()
            raise interrupt
    assert time.monotonic() - start < 1
    done = len(reads)
    time.sleep(0.1)
    assert 0 < done == len(reads)


def test_on_the_saving_world_size_each_rank_checks_the_files_it_wrote_and_loads():
    names = sorted(["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "__10_0.distcp"])
    assert cs._share(names, 1, 11, 11) == ["__1_0.distcp", "__1_1.distcp"]
    assert cs._share(names, 0, 11, 11) == ["__0_0.distcp", "__0_1.distcp"]
    assert cs._share(names, 10, 11, 11) == ["__10_0.distcp"]
    assert cs._share(names, 1, 2, 11) == names[1::2]  # resharded: no rank loads one rank's files


@pytest.mark.slow
def test_a_checkpoint_saved_without_checksums_resumes_and_says_so(tmp_path, capfd):
    out = tmp_path / "run"
    train_in_process("--train.steps", "2", "--checkpoint.async_mode", "none", "--checkpoint.no_checksums",
                     "--train.output_dir", str(out))
    assert cs.CHECKSUMS not in ck.read_marker(out / "checkpoints/step_00000002")[0]
    capfd.readouterr()
    train_in_process("--train.steps", "3", "--checkpoint.async_mode", "none", "--train.output_dir", str(out))
    err = capfd.readouterr().err
    assert f"step_00000002: {cs.NO_CHECKSUMS}" in err and "resuming from" in err
    assert set(ck.read_marker(out / "checkpoints/step_00000003")[0][cs.CHECKSUMS]) == \
        summed_files(out / "checkpoints/step_00000003")


@pytest.mark.slow
@pytest.mark.parametrize("named", [False, True], ids=["auto", "named"])
def test_a_resume_reads_each_marker_and_sums_each_file_once(small, tmp_path, monkeypatch, named):
    """The marker resume checked is the one it loads by (read again, it could say otherwise), and .metadata, checked
    before its shapes are used, is not summed again with the shards."""
    step4 = small / "checkpoints/step_00000004"
    out = tmp_path / "run"
    if not named:
        shutil.copytree(small / "checkpoints", out / "checkpoints")
    markers, sums = Counter(), Counter()
    read_marker, file_sum, restore = ck.read_marker, cs._file_sum, ck.Checkpointer.restore

    def counted_read(path: Path) -> tuple:
        markers[Path(path).name] += 1
        return read_marker(path)

    def counted_sum(path: Path, stop) -> list[int]:
        sums[path.name] += 1
        return file_sum(path, stop)

    def counted_restore(checkpointer, *args) -> ck.Progress:  # the resume alone: the save after it reads markers too
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ck, "read_marker", counted_read)
            patch.setattr(cs, "_file_sum", counted_sum)
            return restore(checkpointer, *args)

    monkeypatch.setattr(ck.Checkpointer, "restore", counted_restore)
    train_in_process("--train.steps", "5", "--checkpoint.async_mode", "none", "--train.output_dir", str(out),
                     *(["--checkpoint.resume", str(step4)] if named else []))
    assert markers["step_00000004"] == 1 and set(markers.values()) == {1}, markers
    assert sums == Counter(summed_files(step4))
