"""Start 2 CPU processes under a real launcher (``accelerate launch`` or ``torchrun``) on a free loopback port,
and stop them when something gets stuck: a timeout SIGTERMs the launcher (which stops its workers), then
kills what is left of the process group this module started. Used by the fault tests and benchmarks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
ACCELERATE_CONFIGS = {"ddp": ROOT / "examples" / "accelerate" / "ddp.yaml",
                      "fsdp2": ROOT / "examples" / "accelerate" / "fsdp2.yaml"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra) -> dict:
    return dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                ACCELERATE_USE_CPU="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)


def accelerate_command(kind: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS[kind]),
            "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
            *args]


def torchrun_command(args: list[str], max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "--max_restarts", str(max_restarts), *args]


@dataclass
class Finished:
    returncode: int
    output: str
    exited_at: float  # time.time() when the launcher had exited
    timed_out: bool

    def marks(self, prefix: str) -> list[float]:
        """The time stamps of the output lines ``<prefix> ... (<time.time()>)`` (the fault helpers print them)."""
        return [float(line.rsplit("(", 1)[1].rstrip(")"))
                for line in self.output.splitlines() if line.startswith(prefix)]


class Launch:
    """A running launcher; ``finish`` waits for it (SIGTERM, then SIGKILL of its group, past ``timeout``)."""

    def __init__(self, command: list[str], env: dict | None = None, cwd: Path = ROOT):
        # the launcher's own temporary folders (torch elastic's torchelastic_* logs, never removed by it; the
        # compile cache) go to a folder of this launch's, removed when it has finished
        self.scratch = tempfile.mkdtemp(prefix="klgrpo-launch-")
        self.proc = subprocess.Popen(command, env={**(env or launch_env()), "TMPDIR": self.scratch}, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def finish(self, timeout: float) -> Finished:
        try:
            return self._finish(timeout)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _finish(self, timeout: float) -> Finished:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            return Finished(self.proc.returncode, out, time.time(), False)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # the launcher stops its workers on SIGTERM
            try:
                out, _ = self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this Launch started, nothing else
                out, _ = self.proc.communicate()
            return Finished(self.proc.returncode, out, time.time(), True)


def metrics_steps(run: Path) -> list[int]:
    """The step of every complete metrics.jsonl row (a row cut by a kill is skipped)."""
    try:
        lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def rank_pid(launch: Launch, rank: int) -> int | None:
    """The PID of the worker with RANK ``rank`` among the launcher's descendants (None if not (yet) there)."""
    import psutil

    for child in psutil.Process(launch.proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "klgrpo" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None
