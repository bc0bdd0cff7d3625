"""DeepSpeed's shared-memory op (``deepspeed_shm_comm``) compiled once, before DeepSpeed starts, bounded and said.

DeepSpeed on the CPU compiles this C++ op (torch.utils.cpp_extension's JIT build, ninja) the first time a
process group starts on a machine: inside ``Accelerator()``, on every rank, silently, under whatever time limit
the launch has (minutes; far more on a busy machine). torch serialises that compile with a ``lock`` file in the
op's build folder which the compiling process deletes when it is done; a process killed mid-compile leaves it
behind, and every later DeepSpeed process then waits on it forever.

``ensure_shm_op`` runs before DeepSpeed is imported: the first local process to take klgrpo's lock (a flock on
the build folder, released however its process ends) compiles the op in a child process through DeepSpeed's own
``build_shm_op`` -- so with exactly the arguments every later process passes -- under a time budget, saying so;
the others wait for it, bounded, then find it built. A torch lock that no process holds open is removed with a
line saying so; where that cannot be told, one that is older than the budget is reported with the fix.

The build file is the same in every process: the op's flags are fixed (``-O2 -fopenmp``, no CPU-feature
probe), and its sources, include paths and folder depend only on the Python, torch and DeepSpeed installs and on
$TORCH_EXTENSIONS_DIR, none of which the launcher sets per rank (tests/test_deepspeed_cpu.py compares the ninja
files of a plain process and of a launched rank); torch's ``_v1``, ``_v2`` names come from its in-process
versioner and only appear when one process loads the op twice with different arguments. What differed between
processes was the ninja that ran it (``pin_ninja``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from klgrpo.errors import KLGRPOError

OP_NAME = "deepspeed_shm_comm"
#: Seconds a compile (and a wait for another process's compile) may take: on a 2-core machine running another
#: job it took 226 s (docs/results/deepspeed_cpu.txt) and, busier, 1291 s.
BUILD_BUDGET_S = 1800.0
#: What DeepSpeed's TorchBackend runs when its process group starts: the same call, so the same build.
_BUILD = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


class OpBuildError(KLGRPOError):
    """DeepSpeed's op could not be compiled within its budget, or its build folder is blocked."""


def shm_op_folder() -> Path:
    """The op's build folder, as torch names it ($TORCH_EXTENSIONS_DIR, else torch's per-user cache); created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(OP_NAME, verbose=False))


def ensure_shm_op(budget_s: float = BUILD_BUDGET_S, log: Callable[[str], None] = print,
                  command: list[str] | None = None) -> bool:
    """Compile DeepSpeed's shared-memory op unless it is built (True when this process compiled it). Raises
    OpBuildError, in one line naming the folder, when the compile or the wait for another process's compile
    passes ``budget_s``. Nothing where DeepSpeed is not installed or the op does not exist (not Linux)."""
    if command is None and (sys.platform != "linux" or importlib.util.find_spec("deepspeed") is None):
        return False
    pin_ninja()
    folder = shm_op_folder()
    deadline = time.monotonic() + budget_s
    waiting = f"DeepSpeed: another process is compiling its shared-memory op in {folder}; waiting for it"
    with _bounded_flock(folder, budget_s, on_wait=lambda: log(f"{waiting} (at most {budget_s:.0f} s)...")):
        clear_stale_lock(folder, budget_s, log)
        if is_built(folder):
            return False
        log(f"DeepSpeed: compiling its shared-memory op once (first use on this machine, about 4 minutes, 20 "
            f"on a busy one; stopped after {_minutes(budget_s)}) in {folder}...")
        start = time.monotonic()
        _run_bounded(command or [sys.executable, "-c", _BUILD], max(deadline - time.monotonic(), 1.0), folder)
        log(f"DeepSpeed: its shared-memory op compiled in {time.monotonic() - start:.0f} s")
        return True


def pin_ninja() -> str | None:
    """Put the folder of the ninja that comes with DeepSpeed (the ``ninja`` package's) first on PATH, for this
    process and the ones it starts (its compile, DeepSpeed's load); its folder, None without the package.

    torch runs whichever ``ninja`` PATH finds first, and ninja versions do not read each other's build log
    (``.ninja_log``: "build log version is too old; starting over"): the system's ninja in one process (a
    venv's python run by its path) and the package's in another (an activated venv) recompiled the whole op
    each time they alternated, with the same build file."""
    if importlib.util.find_spec("ninja") is None:
        return None
    import ninja

    folder = str(ninja.BIN_DIR)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != folder:
        os.environ["PATH"] = os.pathsep.join([folder, path]) if path else folder
    return folder


def is_built(folder: Path) -> bool:
    """The op's library is there and ninja, reading the folder's build file, has nothing left to do."""
    ninja = shutil.which("ninja")
    if ninja is None or not (folder / f"{OP_NAME}.so").is_file() or not (folder / "build.ninja").is_file():
        return False
    dry = subprocess.run([ninja, "-C", str(folder), "-n"], capture_output=True, text=True)
    return dry.returncode == 0 and "no work to do" in dry.stdout


def clear_stale_lock(folder: Path, budget_s: float, log: Callable[[str], None]) -> None:
    """Remove torch's build lock in ``folder`` when no live process holds it open (its compile was stopped);
    where open files cannot be read, refuse one older than ``budget_s`` in one line naming the fix."""
    lock = folder / "lock"
    if not lock.exists():
        return
    held = lock_is_held(lock)
    if held is False:
        lock.unlink(missing_ok=True)
        log(f"DeepSpeed: removed a stale lock {lock} (no process holds it: a compile that was stopped)")
    elif held is None and time.time() - lock.stat().st_mtime > budget_s:
        raise OpBuildError(f"DeepSpeed's op build folder {folder} holds a lock older than {budget_s:.0f} s, left "
                           f"by a compile that was stopped; delete {lock} (no DeepSpeed compile is running)")


def lock_is_held(lock: Path) -> bool | None:
    """Whether a live process has ``lock`` open (torch's compiling process, a Python interpreter, keeps it open
    until it deletes it); None where a Python process's open files cannot be read (another user's) or there is
    no /proc. Other processes whose files cannot be read (a container's init) cannot be that compile."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target, unknown = str(lock.resolve()), False
    for pid in (p for p in proc.iterdir() if p.name.isdigit()):
        try:
            if any(os.readlink(fd) == target for fd in (pid / "fd").iterdir()):
                return True
        except PermissionError:
            unknown = unknown or _runs_python(pid)
        except (FileNotFoundError, ProcessLookupError):  # the process or one of its files went meanwhile
            continue
    return None if unknown else False


def _runs_python(pid: Path) -> bool:
    try:
        program = (pid / "cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return True  # cannot tell: assume it might be
    return b"python" in os.path.basename(program)


@contextmanager
def _bounded_flock(folder: Path, budget_s: float, on_wait: Callable[[], None]):
    """An exclusive flock on ``folder`` (released however this process ends), waited for ``budget_s`` at most."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        deadline, said = time.monotonic() + budget_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OpBuildError(f"DeepSpeed: waited {budget_s:.0f} s for another process compiling its "
                                       f"shared-memory op in {folder}; let it finish (or stop it), then "
                                       f"launch again") from None
                if not said:
                    on_wait()
                    said = True
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def _run_bounded(command: list[str], timeout_s: float, folder: Path) -> None:
    """Run the compile in its own process group; past ``timeout_s`` stop it (the compiler included) and remove
    the lock it leaves, so that the next launch goes on where it stopped instead of waiting forever."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        clear_stale_lock(folder, timeout_s, lambda _: None)
        raise OpBuildError(f"DeepSpeed's shared-memory op did not compile within {timeout_s:.0f} s in {folder} "
                           f"(a busy machine?); launch again to go on where it stopped, or on a less busy "
                           f"machine") from None
    if proc.returncode != 0:
        last = next((line for line in reversed(out.splitlines()) if line.strip()), "no output")
        raise OpBuildError(f"DeepSpeed's shared-memory op failed to compile in {folder} ({last.strip()[:200]}); "
                           f"DeepSpeed needs a C++ compiler and ninja on the PATH")


def _minutes(seconds: float) -> int:
    return round(seconds / 60)


__all__ = ["BUILD_BUDGET_S", "OP_NAME", "OpBuildError", "clear_stale_lock", "ensure_shm_op", "is_built",
           "lock_is_held", "pin_ninja", "shm_op_folder"]
