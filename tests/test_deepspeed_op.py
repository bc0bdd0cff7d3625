"""DeepSpeed's shared-memory op built once, bounded (klgrpo/train/deepspeed_op.py), without DeepSpeed or a
compiler: a planted torch build lock, a stand-in compile command, a second holder of klgrpo's lock."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

import pytest

from klgrpo.train.deepspeed_op import OP_NAME, OpBuildError, clear_stale_lock, ensure_shm_op, lock_is_held


@pytest.fixture
def op_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext" / OP_NAME  # torch's folder under $TORCH_EXTENSIONS_DIR (no python/cuda level)


def test_a_lock_left_by_a_stopped_compile_is_removed_with_a_line(op_folder):
    op_folder.mkdir(parents=True)
    (op_folder / "lock").touch()  # what torch's FileBaton leaves when its process is killed mid-compile
    lines = []
    clear_stale_lock(op_folder, 60, lines.append)
    assert not (op_folder / "lock").exists()
    assert lines == [f"DeepSpeed: removed a stale lock {op_folder / 'lock'} (no process holds it: a compile "
                     f"that was stopped)"]


def test_a_lock_a_live_process_holds_is_left_alone(op_folder):
    op_folder.mkdir(parents=True)
    fd = os.open(op_folder / "lock", os.O_CREAT | os.O_EXCL)  # as torch's compiling process holds it
    try:
        assert lock_is_held(op_folder / "lock") is True
        lines = []
        clear_stale_lock(op_folder, 0, lines.append)
        assert (op_folder / "lock").exists() and lines == []
    finally:
        os.close(fd)
    assert lock_is_held(op_folder / "lock") is False


def test_an_old_lock_is_reported_naming_the_folder_and_the_fix_where_holders_cannot_be_read(op_folder,
                                                                                           monkeypatch):
    op_folder.mkdir(parents=True)
    lock = op_folder / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 120, time.time() - 120))  # 2 minutes old
    monkeypatch.setattr("klgrpo.train.deepspeed_op.lock_is_held", lambda _: None)
    clear_stale_lock(op_folder, 180, print)  # younger than the budget: maybe a compile, left alone
    assert lock.exists()
    with pytest.raises(OpBuildError, match=f"{op_folder} holds a lock older than 60 s.*delete {lock}"):
        clear_stale_lock(op_folder, 60, print)


def test_a_compile_past_its_budget_is_stopped_and_leaves_no_lock(op_folder):
    # Stands in for the compile: takes torch's lock as its FileBaton does, then runs far past the budget.
    slow = [sys.executable, "-c", f"import os, time; os.open({str(op_folder / 'lock')!r}, os.O_CREAT | os.O_EXCL); "
                                  "time.sleep(60)"]
    lines = []
    start = time.monotonic()
    with pytest.raises(OpBuildError, match=f"did not compile within 2 s in {op_folder}"):
        ensure_shm_op(budget_s=2, log=lines.append, command=slow)
    assert time.monotonic() - start < 20  # stopped at the budget, not after the stand-in's 60 s
    assert not (op_folder / "lock").exists()  # the next launch goes on, it does not wait forever
    assert lines[0].startswith("DeepSpeed: compiling its shared-memory op once (first use on this machine")


def test_a_failed_compile_says_its_last_line(op_folder):
    failing = [sys.executable, "-c", "import sys; print('c++: not found'); sys.exit(1)"]
    with pytest.raises(OpBuildError, match=r"failed to compile in .* \(c\+\+: not found\)"):
        ensure_shm_op(budget_s=30, log=lambda _: None, command=failing)


def test_the_wait_for_another_process_compiling_is_bounded(op_folder):
    op_folder.mkdir(parents=True)
    other = os.open(op_folder, os.O_RDONLY)  # another rank holding klgrpo's lock (flock is per open file)
    fcntl.flock(other, fcntl.LOCK_EX)
    lines = []
    try:
        with pytest.raises(OpBuildError, match=f"waited 1 s for another process compiling .* in {op_folder}"):
            ensure_shm_op(budget_s=1, log=lines.append, command=[sys.executable, "-c", "pass"])
    finally:
        os.close(other)
    assert lines == [f"DeepSpeed: another process is compiling its shared-memory op in {op_folder}; waiting for "
                     f"it (at most 1 s)..."]


def test_every_process_runs_the_ninja_that_comes_with_deepspeed_whatever_its_path():
    """A process whose PATH finds the system's ninja first (a venv's python run by its path) and one whose PATH
    finds the package's first (an activated venv) both run the package's once klgrpo pinned it: the same ninja
    reads the op's build log, where two versions each start the build over."""
    ninja = pytest.importorskip("ninja")  # comes with DeepSpeed
    probe = ("import shutil; from klgrpo.train.deepspeed_op import pin_ninja; before = shutil.which('ninja'); "
             "pin_ninja(); print(before, shutil.which('ninja'))")
    found = {}
    for name, path in (("system first", "/usr/bin:/bin"), ("package first", f"{ninja.BIN_DIR}:/usr/bin:/bin")):
        out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PATH=path), check=True,
                             capture_output=True, text=True).stdout.split()
        found[name] = out
    package = os.path.join(ninja.BIN_DIR, "ninja")
    assert found["package first"] == [package, package]
    assert found["system first"][1] == package
    if shutil.which("ninja", path="/usr/bin:/bin"):  # a system ninja exists: without the pin it would have run
        assert found["system first"][0] != package


def test_a_deepspeed_launch_on_the_cpu_builds_the_op_before_accelerate_starts(monkeypatch):
    """Engine asks for the op before ``Accelerator()`` (whose DeepSpeed process group would compile it silently,
    on every rank): a compile that fails its budget ends the rank there, in the op's one line."""
    import torch

    from klgrpo.train import deepspeed_op
    from klgrpo.train.engine import start_engine

    def over_budget(**_):
        raise OpBuildError("DeepSpeed's shared-memory op did not compile within 2 s")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(deepspeed_op, "ensure_shm_op", over_budget)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(OpBuildError, match="did not compile within 2 s"):
        start_engine()
