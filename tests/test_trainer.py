"""End-to-end trainer tests on a tiny local model: smoke, resume equality, micro-batch invariance, KL
placements, no reference at coef 0, Ctrl-C, and the designed errors of the train command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.core.kl_dump import load_dump
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet


def test_smoke_end_to_end(tiny_model_dir, addition_file, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 3, "save_every": 2},
                      logging={"progress": False, "tensorboard": True, "plots": True},
                      eval={"sets": [{"name": "add", "source": str(addition_file), "limit": 8}]})
    summary = GRPOTrainer(cfg, log=quiet).train()
    run = tmp_path / "run"
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("train/loss", "train/kl_penalty", "adaptive_kl/raw_kl", "kl/k1", "kl/k2", "kl/k3", "entropy"):
            assert math.isfinite(r[key]), key
        assert r["kl/k2"] >= 0 and r["kl/k3"] >= 0
    # Step 1 is on-policy at the reference: every log-ratio is exactly 0.
    assert rows[0]["kl/k1"] == 0.0 and rows[0]["kl/max"] == 0.0
    assert rows[-1]["kl/max"] > 0  # the policy moved (lr 1e-2)
    assert summary["steps"] == 3 and set(summary["eval_before"]) == {"add"}
    assert (run / "summary.json").exists() and list((run / "tb").iterdir())
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward.png", "kl.png", "beta.png"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_3")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert GRPOConfig.from_yaml(run / "config.yaml") == cfg


def _final_state(run):
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / "step_4" / "model.safetensors"))


def _train_rows(run):
    drop = ("time/", "wall_time")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in read_metrics(run)]


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_resume_equals_uninterrupted(tiny_model_dir, addition_file, tmp_path, num_iterations):
    groups = dict(train={"steps": 4, "num_iterations": num_iterations},
                  kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100})
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "a", **groups), log=quiet).train()
    # Stop after 3 steps (mid-batch when num_iterations = 2), then resume to 4 in a new trainer.
    part = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups).override({"train.steps": 3})
    GRPOTrainer(part, log=quiet).train()
    full = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups)
    GRPOTrainer(full, log=quiet).train(resume="latest")
    assert _train_rows(tmp_path / "a") == _train_rows(tmp_path / "b")
    a, b = _final_state(tmp_path / "a"), _final_state(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_micro_batch_invariance(tiny_model_dir, addition_file, tmp_path, aggregation):
    """The gradient and logged sums of one batch do not depend on the micro-batch size (float64)."""
    from transformers import AutoModelForCausalLM

    grads, sums = [], []
    for micro in (0, 4, 8):
        cfg = make_config(tiny_model_dir, addition_file, tmp_path / f"m{micro}", train={"micro_batch_size": micro},
                          loss={"aggregation": aggregation}, kl={"coef": 0.1, "placement": "both"})
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
        trainer = GRPOTrainer(cfg, model=model, log=quiet)
        torch.manual_seed(0)
        batch = trainer.make_batch()
        with torch.no_grad():  # move the policy off the reference so the KL terms are non-zero
            for p in trainer.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        s = trainer.grpo_step.accumulate_gradients(batch)[0]
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None]))
        sums.append({"loss": s.loss.double(), "entropy": s.entropy.double(), "token_kl": s.token_kl.double(),
                     **{k: v.double() for k, v in s.objective.present().items()}})  # token_kl is [2, B, T]
    assert grads[0].abs().max() > 0
    for g, s in zip(grads[1:], sums[1:]):
        torch.testing.assert_close(g, grads[0], rtol=1e-10, atol=1e-12)
        assert s.keys() == sums[0].keys()
        for k in s:
            torch.testing.assert_close(s[k], sums[0][k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("placement", ["loss", "reward", "both"])
def test_kl_placements_run_and_log(tiny_model_dir, addition_file, tmp_path, placement):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / placement, train={"steps": 3},
                      kl={"coef": 0.5, "placement": placement, "estimator": "k1" if placement == "reward" else "k3_st"})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / placement) if "train/loss" in r]
    assert rows[0]["train/kl_penalty"] == 0.0  # policy == reference at the first step
    assert rows[-1]["train/kl_penalty"] != 0.0 and math.isfinite(rows[-1]["train/kl_penalty"])


def test_coef_zero_without_monitor_creates_no_reference(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", kl={"coef": 0.0, "monitor": False})
    trainer = GRPOTrainer(cfg, log=quiet)
    assert trainer.reference is None
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "r") if "train/loss" in r]
    assert rows and not any(k.startswith(("kl/", "adaptive_kl/raw")) for k in rows[-1])


def test_coef_zero_with_monitor_logs_kl(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "m", kl={"coef": 0.0, "monitor": True},
                      train={"steps": 3})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "m") if "train/loss" in r]
    assert rows[-1]["kl/k3"] > 0 and rows[-1]["train/kl_penalty"] == 0.0


def test_ctrl_c_saves_last_complete_step_and_resumes_identically(tiny_model_dir, addition_file, tmp_path,
                                                                monkeypatch):
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "a", train={"steps": 3}), log=quiet).train()

    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "b", train={"steps": 3}), log=quiet)
    real_update = trainer.grpo_step.update

    def interrupt_on_third(batch, *rest):
        if trainer.step == 2:
            raise KeyboardInterrupt  # after the step's batch was generated: its side effects must be undone
        return real_update(batch, *rest)

    monkeypatch.setattr(trainer.grpo_step, "update", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "b" / "checkpoints" / "step_2").is_dir()
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "b", train={"steps": 3}),
                log=quiet).train(resume="latest")
    assert _train_rows(tmp_path / "a") == _train_rows(tmp_path / "b")


def test_kl_dump_feeds_verify_from_run(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "d", kl={"dump_every": 1}, train={"steps": 2})
    GRPOTrainer(cfg, log=quiet).train()
    dump = load_dump(tmp_path / "d" / "kl_dumps" / "step_000002.safetensors")
    assert dump["logp"].shape == dump["ref_logp"].shape == dump["mask"].shape
    assert dump["mask"].dtype == torch.bool and dump["step"] == 2
    # the logged KL percentiles are those of the dumped tokens (the same forward's log-probs)
    row = read_metrics(tmp_path / "d")[-1]
    l = (dump["logp"] - dump["ref_logp"])[dump["mask"]].double()
    q = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)
    for name, values in (("log_ratio", l), ("k3", torch.exp(-l) + l - 1)):
        expected = torch.quantile(values, q).tolist()
        got = [row[f"kl/{name}_p{p}"] for p in (50, 90, 99)]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-7), name
    assert max(abs(v) for v in l.tolist()) > 0
    assert 0 < row["kl/loss_share"] < 1  # its formula: tests/math/test_objective_sums.py, tests/test_metrics.py


# ------------------------------------------------------------------------------------------ the CLI's errors
def run_cli(args, capsys):
    from klgrpo.apps.train import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--kl.coeff", "0.1"], "did you mean kl.coef"),
    (["--kl.coef", "abc"], "kl.coef in command line must be float"),
    (["--kl.estimator", "k4"], "choose one of: k1, k2, k3, k1_st, k3_st"),
    (["--rollout.group_size", "1"], "rollout.group_size must be >= 2"),
    (["--train.micro_batch_size", "5"], "must divide the batch"),
    (["--config", "missing.yaml"], "missing.yaml does not exist"),
    (["--resume", "latest"], "no checkpoint in"),
])
def test_train_cli_errors_name_the_field(tiny_model_dir, addition_file, tmp_path, capsys, args, expected):
    base = ["--model.name_or_path", str(tiny_model_dir), "--data.source", str(addition_file),
            "--output-dir", str(tmp_path / "run"), "--train.steps", "1", "--logging.progress", "false"]
    code, err = run_cli(base + args, capsys)
    assert code == 2
    assert expected in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_train_cli_missing_data_file(tiny_model_dir, tmp_path, capsys):
    code, err = run_cli(["--model.name_or_path", str(tiny_model_dir), "--data.source", str(tmp_path / "nope.jsonl"),
                         "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and "nope.jsonl" in err


def test_biased_kl_choice_warns(tiny_model_dir, addition_file, tmp_path):
    import warnings

    from klgrpo.errors import KLGRPOWarning

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "w",
                      kl={"estimator": "k3", "placement": "loss", "is_correction": "detached"})
    with pytest.warns(KLGRPOWarning, match="FORWARD KL"):
        GRPOTrainer(cfg, log=quiet)
    messages = []
    ok = make_config(tiny_model_dir, addition_file, tmp_path / "w2",
                     kl={"estimator": "k3", "placement": "loss", "is_correction": "in_graph"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLGRPOWarning)  # no warning
        GRPOTrainer(ok, log=messages.append)
    assert messages == [f"loading {tiny_model_dir} (torch.float32, cpu)", "sampler: kv_loop (auto for cpu)",
                        "building the reference model"]


def test_yaml_then_cli_override_order(tmp_path):
    from klgrpo.apps.args import parse_args

    (tmp_path / "run.yaml").write_text("kl:\n  coef: 0.5\n  estimator: k2\nrollout:\n  group_size: 4\n")
    cfg, _ = parse_args(["--config", str(tmp_path / "run.yaml"), "--kl.coef", "0.02"])
    assert (cfg.kl.coef, cfg.kl.estimator, cfg.rollout.group_size) == (0.02, "k2", 4)
    assert cfg.rollout.max_new_tokens == GRPOConfig().rollout.max_new_tokens
    json.dumps(cfg.to_dict())  # the resolved tree is plain data


def test_transformers_generate_and_forward_path(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "g", model={"fast_path": False})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "g") if "train/loss" in r]
    assert len(rows) == 2 and 1 <= rows[-1]["completions/mean_length"] <= 4


def test_micro_batches_that_split_groups_train(tiny_model_dir, addition_file, tmp_path):
    """micro_batch_size need not be a multiple of group_size (2 rows of a group of 4 per micro-batch)."""
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "split", train={"micro_batch_size": 2})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "split") if "train/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)


@pytest.mark.parametrize("estimator", ["k1", "k3_st"])
def test_kl_min_and_mean_logps_equal_the_batch_computed_by_hand(tiny_model_dir, addition_file, tmp_path, estimator):
    """kl/min, logp/policy_mean and logp/reference_mean of one update, against the same quantities computed from
    the batch with a separate forward (the policy moved off the reference first, so l != 0); micro-batches of 4."""
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.math.kl import ESTIMATORS

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", kl={"estimator": estimator},
                      train={"micro_batch_size": 4})
    trainer = GRPOTrainer(cfg, log=quiet)
    torch.manual_seed(0)
    batch = trainer.make_batch()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        logp, _ = completion_logprobs(trainer.model, batch.rollout, cfg.rollout.temperature)
    mask = batch.loss_mask.bool()
    l_BT = logp - batch.ref_logp
    metrics, _ = trainer.grpo_step.update(batch)
    n = mask.sum().item()
    assert metrics["logp/policy_mean"] == pytest.approx(logp[mask].sum().item() / n, rel=1e-5)
    assert metrics["logp/reference_mean"] == pytest.approx(batch.ref_logp[mask].sum().item() / n, rel=1e-5)
    assert metrics["logp/policy_mean"] - metrics["logp/reference_mean"] == pytest.approx(metrics["kl/k1"], abs=1e-5)
    expected_min = ESTIMATORS[estimator].fn(l_BT, cfg.kl.log_ratio_clamp)[mask].min().item()
    assert metrics["kl/min"] == pytest.approx(expected_min, rel=1e-4, abs=1e-7)
    if estimator == "k1":
        assert metrics["kl/min"] < 0  # some token is now less likely under the policy than under the reference
    else:
        assert 0 <= metrics["kl/min"] <= metrics["kl/max"]


@pytest.mark.parametrize("kl, advice", [
    ({"estimator": "k3_st", "placement": "loss", "is_correction": "in_graph"},
     "for the reverse KL use kl.is_correction=detached with kl.estimator=k3_st"),
    ({"estimator": "k3_st", "placement": "reward", "is_correction": "detached"},
     "for the reverse KL use kl.estimator=k3_st or k2 in the loss (kl.placement=loss, kl.is_correction=detached)"),
])
def test_reverse_kl_advice_starts_from_the_users_estimator(kl, advice):
    """A straight-through estimator with the weight in the graph is told to detach the weight, not to use the
    estimator it already uses."""
    from klgrpo.config.validation import _warnings

    cfg = GRPOConfig()
    cfg.kl.coef = 0.04
    for key, value in kl.items():
        setattr(cfg.kl, key, value)
    (warning,) = [w for w in _warnings(cfg) if "not the reverse KL" in w]
    assert advice in warning
