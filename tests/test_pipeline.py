"""Generation while training (rollout.max_staleness K > 0, train/pipeline.py): batch t is drawn in a generation
process of its own from the weights after max(0, t - K) updates, exactly; the run is reproducible at a seed and
resumes bitwise (a kill -9 included); a batch older than K, a resume without the setting and a dead generation
process are refused in one line."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.core.forward import completion_logprobs
from klgrpo.errors import ConfigError, KLGRPOError
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from klgrpo.train.pipeline import batch_seed, split_threads
from tests.helpers.configs import make_config, quiet

#: the sampler's float32 log-probs against the trainer's forward at the same weights (sampler/logp_diff_max ~1e-6)
LOGP_ATOL = 1e-4
DROP = ("time/", "wall_time")


def _config(model_dir, data, out, steps=4, ahead=1, **rollout):
    return make_config(model_dir, data, out, optim={"lr": 5e-2},
                       rollout={"max_staleness": ahead, "sampler": "kv_loop", "sampler_correction": "token_mask",
                                **rollout},
                       train={"steps": steps, "save_every": 1})


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in read_metrics(run)]


def test_threads_and_seeds():
    assert split_threads(2, 0) == (1, 1) and split_threads(8, 0) == (4, 4) and split_threads(8, 2) == (6, 2)
    assert split_threads(1, 0) == (1, 1)  # each side keeps one
    assert batch_seed(0, 1) != batch_seed(0, 2) != batch_seed(1, 1)


@pytest.mark.parametrize("override, words", [
    ({"train.num_iterations": 2}, "train.num_iterations 2"),
    ({"rollout.sampler": "vllm"}, "rollout.sampler vllm does not draw ahead"),
    ({"rollout.max_staleness": 0, "rollout.generation_threads": 2}, "rollout.generation_threads is set"),
])
def test_settings_it_cannot_run_are_refused_in_one_line(tiny_model_dir, addition_file, tmp_path, override, words):
    cfg = _config(tiny_model_dir, addition_file, tmp_path / "run")
    with pytest.raises(ConfigError, match=words) as info:
        cfg.override(override).validate()
    assert "\n" not in str(info.value)


def test_each_batch_is_drawn_from_the_weights_k_updates_back(tiny_model_dir, addition_file, tmp_path):
    """K = 1: batches 0 and 1 from the starting weights, batch t from those after t - 1 updates. The sampler's
    log-probs of each batch equal the trainer's forward at exactly those weights, and not at the current ones."""
    trainer = GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", ahead=1), log=quiet)
    step = trainer.grpo_step
    weights, batches, real = [], [], step.make_batch

    def recorded():
        batches.append(real())
        return batches[-1]

    step.make_batch = recorded
    real_update = step.update
    step.update = lambda batch, dump_kl=None: (weights.append(copy.deepcopy(step.model.state_dict())),
                                               real_update(batch, dump_kl))[1]
    try:
        trainer.train()
    finally:
        step.close()
    assert len(batches) == 4 and len(weights) == 4  # weights[t]: those after t updates, before update t
    probe = copy.deepcopy(step.model)
    for t, batch in enumerate(batches):
        drawn = max(0, t - 1)
        rollout = batch.rollout

        def logp_at(state):
            probe.load_state_dict(state)
            with torch.no_grad():
                return completion_logprobs(probe, rollout, 1.0)[0]

        mask = rollout.completion_mask
        diff = ((logp_at(weights[drawn]) - rollout.sampler_logp).abs() * mask).max().item()
        assert diff < LOGP_ATOL, (t, diff)
        if drawn != t:  # a planted mistake, the batch scored as if drawn from the current weights, is told apart
            assert ((logp_at(weights[t]) - rollout.sampler_logp).abs() * mask).max().item() > 10 * LOGP_ATOL
    rows = read_metrics(tmp_path / "run")
    assert [r[m.ROLLOUT_STALENESS_MEAN] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r[m.ROLLOUT_STALENESS_MAX] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0][m.SAMPLER_LOGP_DIFF_MAX] < LOGP_ATOL < max(r[m.SAMPLER_LOGP_DIFF_MAX] for r in rows[1:])
    assert torch.get_num_threads() == trainer.grpo_step.pipeline._threads_before  # given back at the end


def test_a_run_is_reproducible_and_resumes_bitwise(tiny_model_dir, addition_file, tmp_path):
    """4 steps, and 2 steps then a resume to 4 in a new process's generation process (the batches issued ahead
    come back from the checkpoint): the same metrics and the same final weights, bit for bit."""
    from safetensors.torch import load_file

    GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "a", ahead=2), log=quiet).train()
    GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "resumed", steps=2, ahead=2), log=quiet).train()
    GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "resumed", ahead=2), log=quiet).train(
        resume="latest")
    rows = {name: _rows(tmp_path / name) for name in ("a", "resumed")}
    assert [r[m.ROLLOUT_STALENESS_MEAN] for r in rows["a"]] == [0.0, 1.0, 2.0, 2.0]
    assert rows["a"] == rows["resumed"]
    final = {name: load_file(str(tmp_path / name / "checkpoints" / "step_4" / "model.safetensors"))
             for name in ("a", "resumed")}
    assert all(torch.equal(final["a"][k], final["resumed"][k]) for k in final["a"])
    assert rows["a"][-1]["grad_norm"] > 0  # the weights moved: the equalities are not those of a frozen run


def test_a_checkpoint_with_batches_drawn_ahead_needs_the_setting_to_resume(tiny_model_dir, addition_file,
                                                                           tmp_path):
    """The run folder refuses the changed setting; the step itself refuses the batches where no process takes
    them (a checkpoint folder loaded by a run of another config)."""
    GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", steps=2, ahead=1), log=quiet).train()
    with pytest.raises(ConfigError, match="rollout.max_staleness 1 -> 0") as info:
        GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", steps=4, ahead=0), log=quiet).train(
            resume="latest")
    assert "\n" not in str(info.value)
    step = GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "other", ahead=0), log=quiet).grpo_step
    with pytest.raises(ConfigError, match="rollout.max_staleness set as it was"):
        step.load(tmp_path / "run" / "checkpoints" / "step_2")


def test_a_batch_older_than_k_is_never_trained_on(tiny_model_dir, addition_file, tmp_path):
    trainer = GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", ahead=1), log=quiet)
    step = trainer.grpo_step
    real = step.issue_ahead

    def aged():  # planted: the batch drawn for the next step recorded as two updates older than it is
        real()
        step.issued[-1].drawn_at -= 2

    step.issue_ahead = aged
    with pytest.raises(KLGRPOError, match="beyond rollout.max_staleness 1: it is not trained on"):
        trainer.train()
    assert len(read_metrics(tmp_path / "run")) <= 2  # step 3's batch (drawn at "−1") never reached an update


def test_a_dead_generation_process_stops_the_run_in_one_line(tiny_model_dir, addition_file, tmp_path):
    trainer = GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", steps=6, ahead=1), log=quiet)
    step = trainer.grpo_step
    real = step.issue_ahead

    def killed():
        real()
        if step.completed == 2:
            os.kill(step.pipeline.process.pid, signal.SIGKILL)
            step.pipeline.process.join(10)

    step.issue_ahead = killed
    with pytest.raises(KLGRPOError, match="the generation process .* died with exit code") as info:
        trainer.train()
    assert "\n" not in str(info.value)
    saved = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= 2  # the steps before it are kept


def _train_process(config: Path, run: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-m", "klgrpo", "train", "--config", str(config), "--output-dir", str(run),
                             "--resume", "auto"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _signal_after(proc: subprocess.Popen, run: Path, step: int, sig: int) -> None:
    """``sig`` to the run's whole process group (as a terminal's Ctrl-C, or a kill of everything) once ``step`` is
    logged."""
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < step:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, sig)


@pytest.mark.slow
def test_ctrl_c_and_a_kill_resume_bitwise(tiny_model_dir, addition_file, tmp_path):
    """`klgrpo train` with K = 1: Ctrl-C to its process group (the generation process ignores it; the trainer
    saves, waiting for the batch in flight) after step 2, resumed; SIGKILL to everything after step 4, often
    mid-checkpoint, resumed: every step logged once, the metrics and the final weights the uninterrupted run's."""
    from safetensors.torch import load_file

    steps, config = 6, tmp_path / "run.yaml"
    config.write_text(_config(tiny_model_dir, addition_file, tmp_path / "straight", steps=steps).to_yaml())
    straight = _train_process(config, tmp_path / "straight")
    assert straight.wait(300) == 0, straight.stderr.read().decode()[-3000:]
    run = tmp_path / "stopped"
    proc = _train_process(config, run)
    _signal_after(proc, run, 2, signal.SIGINT)
    assert proc.wait(120) != 0
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert saved[-1] == len(read_metrics(run)), proc.stderr.read().decode()[-3000:]  # the last logged step saved
    proc = _train_process(config, run)
    _signal_after(proc, run, 4, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    resumed = _train_process(config, run)
    assert resumed.wait(300) == 0, resumed.stderr.read().decode()[-3000:]
    rows = {name: _rows(tmp_path / name) for name in ("straight", "stopped")}
    assert [r["step"] for r in rows["stopped"]] == list(range(1, steps + 1))
    assert rows["straight"] == rows["stopped"]
    a, b = (load_file(str(tmp_path / name / "checkpoints" / f"step_{steps}" / "model.safetensors"))
            for name in ("straight", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_k0_is_todays_loop(tiny_model_dir, addition_file, tmp_path):
    """rollout.max_staleness 0 starts no process and logs no staleness."""
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run")
    trainer = GRPOTrainer(cfg, log=quiet)
    assert trainer.grpo_step.pipeline is None
    trainer.train()
    assert all(m.ROLLOUT_STALENESS_MEAN not in r for r in read_metrics(tmp_path / "run"))
    assert isinstance(cfg, GRPOConfig)


def test_a_rollback_in_memory_replays_the_same_batches(tiny_model_dir, addition_file, tmp_path):
    """snapshot() after step 1, two steps, restore(), the same two steps again (kl.on_runaway's rollback): the
    generation process's batches in flight are dropped and the snapshot's own come back, so the replay is
    the original's to the bit."""
    trainer = GRPOTrainer(_config(tiny_model_dir, addition_file, tmp_path / "run", ahead=1), log=quiet)
    step = trainer.grpo_step
    try:
        step.start()
        step.advance()
        snapshot = step.snapshot()
        first = [step.advance()[0] for _ in range(2)]
        step.restore(snapshot)
        again = [step.advance()[0] for _ in range(2)]
    finally:
        step.close()
    strip = (lambda rows: [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in rows])
    assert strip(first) == strip(again) and first[-1]["grad_norm"] > 0


def test_the_server_pipeline_sends_each_version_once_before_its_batches(tiny_model_dir, monkeypatch):
    """vllm_server's thread, against a client that records its calls: version 0 sent once before batches 0 and 1,
    version 1 before batch 2, each from the copy taken when the batch was issued (not the live weights), and each
    request seeded from (train.seed, batch)."""
    from transformers import AutoModelForCausalLM

    from klgrpo.backends import vllm_server
    from klgrpo.backends.sampling import SamplingParams
    from klgrpo.backends.weights import named_whole_weights
    from klgrpo.core.rollout import EncodedPrompts
    from klgrpo.train.pipeline import ServerPipeline, shared_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    calls = []

    def sync(self, frozen, version=0):
        calls.append(("sync", version, {n: t.clone() for n, t in named_whole_weights(frozen)}))
        return True

    def generate(self, ids, mask, params, pad_id, eos_ids, vocab=None, seed=None):
        calls.append(("generate", seed))
        rows = ids.shape[0] * params.group_size
        return torch.ones(rows, 2, dtype=torch.long), torch.full((rows, 2), -0.5)

    monkeypatch.setattr(vllm_server.ServerClient, "sync", sync)
    monkeypatch.setattr(vllm_server.ServerClient, "generate", generate)
    sampler = vllm_server.VLLMServerSampler("http://127.0.0.1:9", timeout_s=5)
    pipeline = ServerPipeline(model, sampler, seed=3)
    encoded = EncodedPrompts(prompts=["a"], ids=torch.ones(1, 3, dtype=torch.long), mask=torch.ones(1, 3),
                             eos_ids=[2], pad_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=2)
    try:
        start = {n: t.clone() for n, t in shared_weights(model).items()}
        for index, version in ((0, 0), (1, 0)):
            pipeline.submit(index, encoded, params, version, lambda: shared_weights(model))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the live weights move on: what was sent for version 0 must not
        pipeline.submit(2, encoded, params, 1, lambda: shared_weights(model))
        drawn = [pipeline.result(i)[0] for i in range(3)]
    finally:
        pipeline.close()
    assert [c[:2] for c in calls] == [("sync", 0), ("generate", batch_seed(3, 0) % 2 ** 31),
                                      ("generate", batch_seed(3, 1) % 2 ** 31), ("sync", 1),
                                      ("generate", batch_seed(3, 2) % 2 ** 31)]
    assert all(torch.equal(calls[0][2][n], start[n]) for n in start)
    assert all(torch.equal(calls[3][2][n], start[n] + 1.0) for n in start)
    assert [d.weights_version for d in drawn] == [0, 0, 1]



def test_staleness_without_a_correction_is_warned(tiny_model_dir, addition_file, tmp_path):
    """The KL term's samples are the stale policy's: with no sampler correction its gradient follows neither KL."""
    bare = _config(tiny_model_dir, addition_file, tmp_path / "run").override({"rollout.sampler_correction": "none"})
    assert any("rollout.max_staleness 1 with rollout.sampler_correction none" in w for w in bare.validate())
    corrected = _config(tiny_model_dir, addition_file, tmp_path / "run")  # token_mask
    assert not any("rollout.max_staleness" in w for w in corrected.validate())
