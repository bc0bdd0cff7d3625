"""``klgrpo explain --run`` on verl's and OpenRLHF's logs: TensorBoard event folders written by the logging calls
those frameworks make (torch's SummaryWriter.add_scalar with their tag names and global steps from 1), and W&B
offline runs written by wandb itself; the bands judged by hand; one-line refusals."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.run_logs import MAX_LOG_BYTES
from klgrpo.apps.explain.tracker_logs import _history_row

HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_wandb = pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'klgrpo[wandb]')")


def _tensorboard(folder, rows_by_step, texts=()):
    """What verl's _TensorboardAdapter.log and OpenRLHF's TensorboardLogger.log_train do: add_scalar(tag, value,
    global_step) for every logged key, add_text for the generated samples."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, row in rows_by_step:
        for tag, value in row.items():
            writer.add_scalar(tag, value, step)
    for tag, text, step in texts:
        writer.add_text(tag, text, step)
    writer.close()


def _verl_rows(kl_values):
    """verl's per-step metrics with the KL in the loss (use_kl_loss): dp_actor.py's actor/kl_loss and
    actor/kl_coef, metric_utils.py's critic/score/mean, core_algos.py's actor/pg_clipfrac, actor/entropy."""
    return [(step, {"actor/kl_loss": kl, "actor/kl_coef": 0.001, "actor/pg_loss": -0.5,
                    "actor/pg_clipfrac": 0.0625, "actor/entropy": 2.0 - step / 64, "critic/score/mean": step / 64})
            for step, kl in enumerate(kl_values, 1)]


def test_a_verl_tensorboard_folder(tmp_path, capsys):
    # verl's layout: tensorboard_log/<project>/<experiment>/events.out.tfevents.*; the validation at step 0
    kl = [0.125] * 20 + [0.5] * 20  # float32-exact values
    _tensorboard(tmp_path / "tensorboard_log" / "gsm8k" / "qwen", [(0, {"val-core/acc": 0.25})] + _verl_rows(kl))
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "tensorboard_log"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "verl" and summary["kl"]["metric"] == "actor/kl_loss"
    assert summary["kl"]["first"] == {"step": 1, "value": 0.125} and summary["kl"]["last"] == {"step": 40, "value": 0.5}
    assert summary["kl"]["points"] == 40 and summary["kl"]["median"] == 0.3125  # (0.125 + 0.5) / 2
    # windows of 20 (klgrpo's default): means 0.125 then 0.5 > warn_above 0.2 and > 0.125: drifting
    assert summary["bands"]["windows"] == [{"band": "drifting", "first_step": 21, "last_step": 40, "mean": 0.5}]
    assert summary["beta"]["metric"] == "actor/kl_coef" and summary["beta"]["changes"] == 0
    assert summary["reward"]["metric"] == "critic/score/mean" and summary["reward"]["last"]["value"] == 40 / 64
    assert summary["clip_ratio"]["metric"] == "actor/pg_clipfrac" and summary["entropy"]["metric"] == "actor/entropy"
    printed = capsys.readouterr().out
    assert printed.startswith(f"{tmp_path / 'tensorboard_log'}: verl run (")
    assert "steps 21-40 drifting (mean 0.5)" in printed and "sums actor/kl_loss over the step's PPO epochs" in printed


def test_verl_with_the_kl_in_the_reward_reads_the_reward_kl_not_the_zero_loss_placeholder(tmp_path):
    # use_kl_loss off: verl's FSDP actor still logs actor/kl_loss 0.0 (no actor/kl_coef); ray_trainer.py's
    # apply_kl_penalty logs actor/reward_kl_penalty and its coefficient
    rows = [(step, {"actor/kl_loss": 0.0, "actor/pg_loss": 0.25, "actor/reward_kl_penalty": 0.0625 * step,
                    "actor/reward_kl_penalty_coeff": 0.001}) for step in range(1, 5)]
    _tensorboard(tmp_path / "tb", rows)
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "tb"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kl"]["metric"] == "actor/reward_kl_penalty" and summary["kl"]["max"] == {"step": 4, "value": 0.25}
    assert summary["beta"]["metric"] == "actor/reward_kl_penalty_coeff"
    assert not any("sums actor/kl_loss" in note for note in summary["notes"])


def _openrlhf_rows(kl_values):
    """OpenRLHF's status keys (ppo_actor.py: policy_loss, kl, ppo_clip_ratio, ppo_kl, actor_lr, entropy_loss;
    reward), logged as train/<key> at global_step 1, 2, ..."""
    return [(step, {f"train/{k}": v for k, v in {"policy_loss": 0.5, "kl": kl, "reward": step / 8,
                                                 "ppo_clip_ratio": 0.125, "ppo_kl": 0.0, "actor_lr": 1e-6,
                                                 "entropy_loss": 1.5}.items()})
            for step, kl in enumerate(kl_values, 1)]


def test_an_openrlhf_tensorboard_folder(tmp_path, capsys):
    # OpenRLHF's layout: <logger.tensorboard_dir>/<logger.wandb.run_name>/events.out.tfevents.*
    kl = [0.5] * 20 + [0.0009765625] * 20  # 2^-10, float32-exact
    _tensorboard(tmp_path / "tb" / "ppo_1128T06:00", _openrlhf_rows(kl),
                 texts=[("train/generated_samples", "Sample: 1+1=2", 1)])
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "tb"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "openrlhf" and summary["kl"]["metric"] == "train/kl" and summary["beta"] is None
    # window means 0.5 (the first, above warn_above 0.2 and risen from the reference's 0: drifting, as the trainer's
    # watch and runaway guard judge it) then 2^-10 < warn_below 0.01 from the second window on: not learning
    assert summary["bands"]["windows"] == [{"band": "drifting", "first_step": 1, "last_step": 20, "mean": 0.5},
                                           {"band": "not_learning", "first_step": 21, "last_step": 40,
                                            "mean": 0.0009765625}]
    assert summary["reward"]["metric"] == "train/reward" and summary["clip_ratio"]["metric"] == "train/ppo_clip_ratio"
    assert summary["entropy"]["metric"] == "train/entropy_loss"
    printed = capsys.readouterr().out
    assert ": OpenRLHF run (" in printed and "steps 21-40 not learning (mean 0.0009766)" in printed
    assert "OpenRLHF's beta is --algo.kl.init_coef" in printed and "pass --config FILE" in printed


def test_a_short_run_says_so(tmp_path, capsys):
    _tensorboard(tmp_path / "tb", _openrlhf_rows([0.5, 0.75, 1.0]))
    assert main(["--run", str(tmp_path / "tb")]) == 0
    assert ("the run is shorter than one warning window (3 logged KL values, a window is 20): no band judged"
            in capsys.readouterr().out)


def _write_wandb_run(cwd, script):
    """A W&B offline run written by wandb itself, in a process of its own (wandb's service and globals stay out
    of the test process)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(cwd),
           "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(cwd / ".config")}
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


# OpenRLHF's WandbLogger: the step metric train/global_step, train/<key> per step, the samples table logged apart
OPENRLHF_WANDB = """
import wandb
wandb.init(project="openrlhf_train_ppo", name="ppo", config={"algo": "grpo"},
           settings=wandb.Settings(x_disable_stats=True, disable_code=True, disable_git=True))
wandb.define_metric("train/global_step")
wandb.define_metric("train/*", step_metric="train/global_step", step_sync=True)
kl = [0.0625] * 20 + [0.25] * 20 + [0.5] * 5
for step, value in enumerate(kl, 1):
    if step == 1:
        wandb.log({"train/generated_samples": wandb.Table(columns=["global_step", "text", "reward"],
                                                          data=[[1, "1+1=2", 1.0]])})
    wandb.log({"train/kl": value, "train/reward": step / 64, "train/policy_loss": 0.5, "train/global_step": step})
wandb.finish()
"""


@needs_wandb
@pytest.mark.slow
def test_an_openrlhf_wandb_offline_run(tmp_path, capsys):
    (tmp_path / "job").mkdir()
    _write_wandb_run(tmp_path / "job", OPENRLHF_WANDB)
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "job"), "--json", str(out)]) == 0  # wandb/offline-run-*/run-*.wandb below
    summary = json.loads(out.read_text())
    assert summary["kind"] == "openrlhf" and summary["log"].endswith(".wandb")
    # the steps are train/global_step's (W&B's own _step counts the table's row too: 46 rows)
    assert summary["kl"]["first"] == {"step": 1, "value": 0.0625} and summary["kl"]["last"] == {"step": 45,
                                                                                               "value": 0.5}
    # windows of 20: means 0.0625, then 0.25 > warn_above 0.2 and rising: drifting; steps 41-45 fill no window
    assert summary["bands"]["windows"] == [{"band": "drifting", "first_step": 21, "last_step": 40, "mean": 0.25}]
    assert summary["reward"]["max"] == {"step": 45, "value": 45 / 64}
    assert "steps 21-40 drifting (mean 0.25)" in capsys.readouterr().out


# verl's Tracking with the wandb backend: wandb.init(project, name, config), wandb.log(data, step=global_steps)
VERL_WANDB = """
import wandb
wandb.init(project="verl", name="grpo", config={"algorithm": {"adv_estimator": "grpo"}},
           settings=wandb.Settings(x_disable_stats=True, disable_code=True, disable_git=True))
for step in range(1, 5):
    wandb.log({"actor/kl_loss": 0.25 * step, "actor/kl_coef": 0.001, "critic/score/mean": 0.5}, step=step)
wandb.finish()
"""


@needs_wandb
@pytest.mark.slow
def test_a_verl_wandb_offline_run(tmp_path):
    _write_wandb_run(tmp_path, VERL_WANDB)
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    out = tmp_path / "run.json"
    assert main(["--run", str(run), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "verl" and summary["kl"]["max"] == {"step": 4, "value": 1.0}
    assert summary["kl"]["median"] == 0.625 and summary["beta"]["first"]["value"] == 0.001  # (0.5 + 0.75) / 2


def test_wandb_history_records_take_openrlhfs_step_else_wandbs():
    """The lines `wandb leet inspect --json` prints (as wandb 0.31 printed them for the run above)."""
    table = {"_type": "table-file", "path": "media/table/x.json"}
    lines = ['{"num":13,"type":"summary","summary":{"update":{"_step":0,"train/kl":0.1}}}',
             '{"num":14,"type":"history","history":{"item":{"_step":0,"train/generated_samples":%s},'
             '"step":{"num":0}}}' % json.dumps(table),
             '{"num":15,"type":"history","history":{"item":{"_step":1,"train/global_step":1,"train/kl":0.1}}}',
             '{"num":16,"type":"history","history":{"item":{"_step":2,"actor/kl_loss":0.5}}}', "not json"]
    rows = [row for line in lines if (row := _history_row(line)) is not None]
    assert [(row["step"], row.get("train/kl"), row.get("actor/kl_loss")) for row in rows] == [
        (0, None, None), (1, 0.1, None), (2, None, 0.5)]


def _offline_folder(tmp_path, summary=None, run_bytes=b"not a real W&B log"):
    run = tmp_path / "wandb" / "offline-run-20260101_000000-abc"
    (run / "files").mkdir(parents=True)
    (run / "run-abc.wandb").write_bytes(run_bytes)
    if summary is not None:
        (run / "files" / "wandb-summary.json").write_text(json.dumps(summary))
    return run


def test_a_wandb_run_without_wandb_says_what_to_install(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    _offline_folder(tmp_path, summary={"train/kl": 0.25, "_step": 9})
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the wandb package (pip install 'wandb>=0.31'" in err, err
    assert "wandb-summary.json holds only the last values (train/kl 0.25)" in err


@needs_wandb
def test_a_broken_wandb_log_is_one_line(tmp_path, capsys):
    _offline_folder(tmp_path)
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wandb could not read it" in err, err


@pytest.mark.parametrize("setup, message", [
    (lambda p: _tensorboard(p / "tb", [(1, {"loss": 0.5})]), "logs none of the metric names explain reads (verl: "),
    (lambda p: _tensorboard(p / "tb", [(1, {"actor/kl_loss": 0.0, "actor/pg_loss": 0.5})]),
     "logs no KL (actor/kl_loss (with actor/kl_coef) or actor/reward_kl_penalty or critic/kl)"),
    (lambda p: (_tensorboard(p / "a", _openrlhf_rows([0.5])), _tensorboard(p / "b", _openrlhf_rows([0.5]))),
     "holds 2 tensorboard runs"),
    (lambda p: (p / "tb").mkdir() or os.truncate(_touch(p / "tb" / "events.out.tfevents.1.host"),
                                                  MAX_LOG_BYTES + 1),
     f"more than the {MAX_LOG_BYTES} explain --run reads"),
])
def test_bad_tracker_folders_are_one_line(tmp_path, capsys, setup, message):
    setup(tmp_path)
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _touch(path):
    path.write_bytes(b"")
    return path


# ----------------------------------------------------------------------------------------------- NeMo-RL, prime-rl
def _nemo_rl_rows(kl_values, gen_kl=0.0009765625):
    """What NeMo-RL's grpo_train logs through Logger.log_metrics(metrics, total_steps + 1, prefix="train"): the
    loss function's kl_penalty, approx_entropy, gen_kl_error, token_mult_prob_error, probs_ratio_clamped
    (ClippedPGLossFn), grpo.py's reward and loss; validation/ and timing/ beside them."""
    return [(step, {"train/kl_penalty": kl, "train/reward": step / 64, "train/loss": -0.25,
                    "train/approx_entropy": 1.5, "train/gen_kl_error": gen_kl, "train/token_mult_prob_error": 1.0,
                    "train/probs_ratio_clamped": 1.0, "timing/train/total_step_time": 12.0})
            for step, kl in enumerate(kl_values, 1)]


def test_a_nemo_rl_tensorboard_folder(tmp_path, capsys):
    # NeMo-RL's layout: <logger.log_dir>/exp_NNN/tensorboard/events.out.tfevents.* (logger.tensorboard_enabled)
    kl = [0.125] * 20 + [0.5] * 20
    _tensorboard(tmp_path / "logs" / "exp_001" / "tensorboard", [(0, {"validation/accuracy": 0.25})]
                 + _nemo_rl_rows(kl))
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "logs"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "nemo_rl" and summary["kl"]["metric"] == "train/kl_penalty"
    assert summary["kl"]["to"] == "reference" and summary["bands"]["judged"] is True
    assert summary["bands"]["windows"] == [{"band": "drifting", "first_step": 21, "last_step": 40, "mean": 0.5}]
    assert summary["reward"]["metric"] == "train/reward" and summary["reward"]["last"] == {"step": 40,
                                                                                          "value": 40 / 64}
    assert summary["entropy"]["metric"] == "train/approx_entropy" and summary["beta"] is None
    assert summary["clip_ratio"] is None  # NeMo-RL logs no clip fraction
    printed = capsys.readouterr().out
    assert ": NeMo-RL run (" in printed and "steps 21-40 drifting (mean 0.5)" in printed
    assert "NeMo-RL's is loss_fn.reference_policy_kl_penalty" in printed
    assert "train/gen_kl_error, train/policy_kl_error and train/js_divergence_error compare the sampler's" in printed


def test_a_nemo_rl_run_without_a_kl_term_logs_no_kl(tmp_path, capsys):
    # reference_policy_kl_penalty 0: ClippedPGLossFn logs kl_penalty 0 at every step, which is no measured KL
    _tensorboard(tmp_path / "tb", _nemo_rl_rows([0.0] * 5))
    assert main(["--run", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "logs no KL (train/kl_penalty (not 0 throughout))" in err, err
    # one step with a KL is a KL: the zeros around it are read as the log's numbers
    _tensorboard(tmp_path / "tb2", _nemo_rl_rows([0.0, 0.0, 0.25]))
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "tb2"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kl"]["points"] == 3


def _prime_rl_file_rows(mismatch_kl_values):
    """prime-rl's trainer (src/prime_rl/trainer/rl/train.py) calls monitor.log five times a step: perf/, optim/,
    the tensor stats (loss/mean, entropy/all/mean, mismatch_kl/all/mean and /max, is_masked/mean, ...), time/ and
    disk metrics; its FileMonitor writes each as {"step": step, "time": wall, **metrics} (the metrics hold "step"
    too), leaving NaN out."""
    rows = []
    for step, kl in enumerate(mismatch_kl_values, 1):
        stats = {"loss/mean": 0.01, "entropy/all/mean": 0.75, "entropy/all/std": 0.5, "is_masked/mean": 0.0625,
                 "is_masked/max": 1.0, "step": step}
        if kl is not None:
            stats.update({"mismatch_kl/all/mean": kl, "mismatch_kl/all/max": 4 * kl})
        for metrics in ({"perf/throughput": 1e4, "perf/mfu": 30.0, "step": step},
                        {"optim/lr": 1e-6, "optim/zero_grad_ratio": 0.0, "optim/grad_norm": 0.5, "step": step},
                        stats, {"time/step": 20.0, "step": step}):
            rows.append({"step": step, "time": 1.7e9 + step, **metrics})
    return rows


def test_a_prime_rl_metrics_jsonl_is_read_as_a_kl_to_the_sampler(tmp_path, capsys):
    run = tmp_path / "outputs"
    run.mkdir()
    values = [0.0009765625] * 39 + [None]  # 2^-10, below warn_below: a reference KL this small would be judged
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _prime_rl_file_rows(values)))
    out = tmp_path / "run.json"
    assert main(["--run", str(run), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "prime_rl" and summary["kl"]["metric"] == "mismatch_kl/all/mean"
    assert summary["kl"]["to"] == "sampler" and summary["kl"]["points"] == 39
    # a KL to the sampler is not the KL the bands are for: no window judged (not "not learning" from step 21)
    assert summary["bands"]["judged"] is False and summary["bands"]["windows"] == []
    assert summary["entropy"]["metric"] == "entropy/all/mean" and summary["clip_ratio"]["metric"] == "is_masked/mean"
    assert summary["reward"] is None and summary["beta"] is None
    printed = capsys.readouterr().out
    assert ": prime-rl trainer run (" in printed and "KL to the sampler, not to a reference (mismatch_kl/all/mean)" in (
        printed)
    assert "none judged: the bands judge a KL to the reference model, this log's is to the sampler" in printed
    assert "leaves NaN and infinite values out of metrics.jsonl" in printed
    assert "the reward is in the orchestrator's log" in printed


def test_the_frameworks_are_told_by_their_own_names():
    from klgrpo.apps.explain.tracker_logs import framework

    where = Path("log")
    assert framework([{"step": 1, "train/kl_penalty": 0.1, "train/reward": 0.5}], where) == "nemo_rl"
    assert framework([{"step": 1, "train/kl": 0.1, "train/policy_loss": 0.5, "train/reward": 0.5}], where) == (
        "openrlhf")
    assert framework([{"step": 1, "mismatch_kl/mean": 0.1}], where) == "prime_rl"  # prime-rl 0.2 - 0.5
    assert framework([{"step": 1, "mismatch_kl/all/mean": 0.1}], where) == "prime_rl"  # 0.6 on


def test_a_prime_rl_wandb_row_takes_prime_rls_own_step():
    # prime-rl: define_metric("*", step_metric="step") and five wandb.log calls a step: W&B's _step counts calls
    line = '{"num":40,"type":"history","history":{"item":{"_step":9,"step":2,"mismatch_kl/all/mean":0.001}}}'
    assert _history_row(line)["step"] == 2


def test_a_nemo_rl_wandb_run_is_found_four_folders_down(tmp_path, capsys, monkeypatch):
    # NeMo-RL's WandbLogger: wandb.init(dir=<log_dir>/exp_NNN/wandb), which writes its own wandb/offline-run-*/
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    run = tmp_path / "logs" / "exp_001" / "wandb" / "wandb" / "offline-run-20260101_000000-abc"
    (run / "files").mkdir(parents=True)
    (run / "run-abc.wandb").write_bytes(b"not read without wandb")
    (run / "files" / "wandb-summary.json").write_text(json.dumps({"train/kl_penalty": 0.125, "_step": 9}))
    assert main(["--run", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'run-abc.wandb'} is a W&B offline run" in err, err
    assert "holds only the last values (train/kl_penalty 0.125)" in err
