"""A stop at any moment of a step resumes to the very run that was never stopped (final weights bitwise equal).

SIGTERM and Ctrl-C land inside a step as an exception: before the optimizer step the step is undone (data order,
RNG, batch), after it the step is kept. The signal sent from inside each phase of a step (the generation, the
update's forward and backward, the optimizer step, the metrics and controller after it, the logging, a checkpoint
write), then `--resume latest`; the slow test repeats benchmarks/kill_resume.py's SIGTERM loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.configs import make_config, quiet

from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def _run(model, data, out, resume=None):
    cfg = make_config(model, data, out, train={"steps": STEPS, "save_every": 1, "num_iterations": 2},
                      kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100})
    return GRPOTrainer(cfg, log=quiet).train(resume=resume)


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, addition_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    _run(tiny_model_dir, addition_file, out)
    return _weights(out)


#: (module, attribute) a signal is sent from, after its second call: every phase of a step (the second step's)
PHASES = [
    ("klgrpo.train.step", "GRPOStep.make_batch"),                  # generation, rewards, reference
    ("klgrpo.train.step", "GRPOStep.accumulate_gradients"),        # forward and backward
    ("klgrpo.train.engine", "Engine.step"),                        # clipping and AdamW
    ("klgrpo.train.step", "step_metrics"),                         # after the optimizer step
    ("klgrpo.math.kl_control", "AdaptiveKLController.observe"),    # the controller, after the update
    ("klgrpo.run.metrics", "MetricsLogger.log"),                 # the step's row
    ("klgrpo.run.loop", "TrainingRun.save"),                     # the step's checkpoint
]


def _signal_after(monkeypatch, module: str, attribute: str, signum: int, calls: list) -> None:
    import importlib

    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(name)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def test_a_held_gate_keeps_a_signal_until_released():
    from klgrpo.train.stop_signals import StopGate, Terminated, sigterm_as_interrupt

    gate = StopGate()
    with sigterm_as_interrupt(gate=gate):
        gate.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # the first signal is the one raised
        assert gate.pending == signal.SIGTERM
        with pytest.raises(Terminated):
            gate.release()
        gate.release()  # nothing pending any more
        with pytest.raises(KeyboardInterrupt) as raised:
            os.kill(os.getpid(), signal.SIGINT)  # an open gate: raised at once
        assert not isinstance(raised.value, Terminated)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("module,attribute", PHASES, ids=[a for _, a in PHASES])
def test_a_signal_in_any_phase_of_a_step_resumes_bitwise(module, attribute, signum, uninterrupted, tiny_model_dir,
                                                         addition_file, tmp_path, monkeypatch):
    out, calls = tmp_path / "run", []
    with monkeypatch.context() as patch:
        _signal_after(patch, module, attribute, signum, calls)
        with pytest.raises(KeyboardInterrupt):
            _run(tiny_model_dir, addition_file, out)
    assert len(calls) >= 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handlers are gone
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    _run(tiny_model_dir, addition_file, out, resume="latest")
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, STEPS + 1))
    resumed = _weights(out)
    assert resumed.keys() == uninterrupted.keys()
    different = [k for k in resumed if not (resumed[k] == uninterrupted[k]).all()]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run's, e.g. {different[0]}"


@pytest.mark.slow
def test_sigterm_loop_with_tensorboard_on_and_off_resumes_bitwise(tmp_path):
    """benchmarks/kill_resume.py's SIGTERM loop as a user runs it: SIGTERM at random moments of random steps, then
    `--resume latest`, each run's final weights against the uninterrupted run's."""
    for report_to in (["tensorboard"], []):
        done = subprocess.run([sys.executable, "benchmarks/kill_resume.py", "--signal", "term", "--runs", "2",
                               "--kills", "2", "--steps", "8", "--work", str(tmp_path / f"t{len(report_to)}"),
                               "--report-to", *report_to], cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        trackers = ", ".join(report_to) or "none"
        assert f"2 of 2 runs equal the uninterrupted one (signal term, trackers: {trackers}," in done.stdout
