"""klgrpo.trl: TRL's GRPOTrainer with klgrpo's objective and controllers.

Equivalence with stock TRL (float64, 1e-10) for every TRL loss_type and option klgrpo's math has (delta, GSPO's
sequence-level ratio, cispo, luspo), the refusal of the others with the reason, each adaptation method on
hand-computed values, short real runs, metrics and checkpoint resume.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import AutoModelForCausalLM  # noqa: E402

from klgrpo.errors import ConfigError  # noqa: E402
from klgrpo.trl import (  # noqa: E402
    CONTROLLER_FILE,
    KL_ADAPTATION_METHODS,
    LOSS_TYPES,
    GRPOConfig,
    GRPOTrainer,
)
from tests.helpers.trl_setup import addition_prompts, char_tokenizer, count_zeros, run_args, save_tiny_model  # noqa: E402

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("trl_tiny"))


def make_trainer(trainer_cls, config_cls, model, out, **overrides):
    args = config_cls(**run_args(out, **overrides))
    return trainer_cls(model=model, reward_funcs=count_zeros, args=args, train_dataset=addition_prompts(),
                       processing_class=char_tokenizer())


# ---- equivalence with stock TRL -----------------------------------------------------------------------------

def float64_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
    """Per-token log-probs and entropies in float64 (TRL's own path returns float32 from a fused LM head)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1]
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
    entropies = -(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None
    return logps, entropies, None


def loss_inputs(model, seed=0, dtype=torch.float64):
    """One micro-batch of 3 completions with unequal lengths, off-policy old log-probs and a reference."""
    gen = torch.Generator().manual_seed(seed)
    batch, prompt_len, completion_len = 3, 4, 5
    prompt_ids = torch.randint(3, 16, (batch, prompt_len), generator=gen)
    completion_ids = torch.randint(3, 16, (batch, completion_len), generator=gen)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    with torch.no_grad():
        logps = float64_logps(model, torch.cat([prompt_ids, completion_ids], 1), None, completion_len)[0].to(dtype)
    noise = lambda scale: scale * torch.randn(logps.shape, generator=gen, dtype=dtype)  # noqa: E731
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.4], dtype=dtype),
        "old_per_token_logps": logps + noise(0.3),   # ratios well outside [0.8, 1.2]: the clip is active
        "ref_per_token_logps": logps + noise(0.5),
        "num_items_in_batch": torch.tensor(2 * int(completion_mask.sum())),  # as if two micro-batches
        "importance_sampling_ratio": torch.exp(noise(0.2)),
    }


def loss_and_grad(trainer, model, inputs, accumulation):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer._compute_loss(model, dict(inputs))
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), torch.cat([g.reshape(-1) for g in grads])


def stock_and_bridge(model_dir, tmp_path, dtype, **fields):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    stock = make_trainer(trl.GRPOTrainer, trl.GRPOConfig, model, tmp_path / "stock", **fields)
    bridge = make_trainer(GRPOTrainer, GRPOConfig, model, tmp_path / "bridge", **fields)
    return model, stock, bridge


CASES = [  # (TRL fields, gradient accumulation steps)
    *[({"loss_type": lt}, 1) for lt in LOSS_TYPES],
    *[({"loss_type": lt, "use_bias_correction_kl": False}, 2) for lt in LOSS_TYPES],
    ({"loss_type": "cispo", "epsilon_high": 5.0}, 1),   # TRL's recommended cap: weights above 1 pass unclipped
    ({"loss_type": "cispo", "epsilon_high": 1.1, "steps_per_generation": 2, "gradient_accumulation_steps": 2}, 2),
    ({"loss_type": "dapo", "delta": 1.5, "epsilon_high": 0.28}, 1),
    ({"loss_type": "grpo", "delta": 1.3}, 2),
    *[({"loss_type": lt, "importance_sampling_level": "sequence", "use_bias_correction_kl": False}, 1)
      for lt in ("grpo", "dapo", "luspo", "dr_grpo")],
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.0}, 1),
    ({"loss_type": "dapo", "steps_per_generation": 2, "gradient_accumulation_steps": 2}, 2),
    ({"loss_type": "grpo", "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.05}, 1),
    ({"loss_type": "dapo", "entropy_coef": 0.05, "top_entropy_quantile": 0.3}, 2),
    ({"loss_type": "sapo", "entropy_coef": 0.05, "off_policy_mask_threshold": 0.05, "sapo_temperature_neg": 1.4}, 2),
    ({"loss_type": "vespo", "use_adaptive_entropy": True, "entropy_coef": 0.1, "vespo_k_neg": 2.0}, 1),
    ({"loss_type": "cispo", "epsilon_high": 1.2, "entropy_coef": 0.02, "off_policy_mask_threshold": 0.05}, 1),
    ({"loss_type": "bnpo", "epsilon_high": 0.28, "vllm": True}, 1),
]


@pytest.mark.parametrize("fields,accumulation", CASES, ids=lambda c: str(c))
def test_defaults_reproduce_stock_trl_loss_and_gradient(model_dir, tmp_path, fields, accumulation):
    fields = dict(fields)
    vllm = fields.pop("vllm", False)
    model, stock, bridge = stock_and_bridge(model_dir, tmp_path, torch.float64, **fields)
    assert bridge.args.kl_adaptation_method == "none" and bridge.args.kl_estimator == "k3"
    for trainer in (stock, bridge):
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm  # TRL's vLLM IS factor, no server
        trainer._get_per_token_logps_and_entropies = float64_logps  # the same log-probs for both, in float64
    inputs = loss_inputs(model)
    if not vllm:  # TRL's batch holds vLLM's ratio only with vLLM's correction on (vespo would read it)
        inputs.pop("importance_sampling_ratio")
    expected_loss, expected_grad = loss_and_grad(stock, model, inputs, accumulation)
    loss, grad = loss_and_grad(bridge, model, inputs, accumulation)
    assert loss.dtype == torch.float64 and expected_grad.abs().max() > 1e-3
    assert abs(loss.item() - expected_loss.item()) <= 1e-10
    assert (grad - expected_grad).abs().max().item() <= 1e-10


def test_trl_forward_path_agrees_in_float32(model_dir, tmp_path):
    # unpatched: the bridge takes its log-probs from TRL's own fused-LM-head forward (float32)
    model, stock, bridge = stock_and_bridge(model_dir, tmp_path, torch.float32, loss_type="dapo",
                                          use_bias_correction_kl=False)  # TRL then logs the raw k3 as "kl"
    inputs = loss_inputs(model, dtype=torch.float32)
    expected_loss, expected_grad = loss_and_grad(stock, model, inputs, 1)
    loss, grad = loss_and_grad(bridge, model, inputs, 1)
    assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6)
    assert (grad - expected_grad).abs().max().item() <= 1e-5 * expected_grad.abs().max().item()
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert bridge._metrics["train"][name] == pytest.approx(stock._metrics["train"][name], abs=1e-6), name


def test_every_trl_loss_type_is_mapped():
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    for loss_type in TRL_LOSS_TYPES:
        assert f"'{loss_type}'" in help_text
    assert set(LOSS_TYPES) == set(TRL_LOSS_TYPES)


@pytest.mark.parametrize("fields,message", [
    ({"kl_adaptation_method": "soft"}, "kl_adaptation_method='soft' is not supported; choose one of: none, clip"),
    ({"kl_estimator": "k4"}, "kl_estimator='k4' is not supported; choose one of: k1, k2, k3, k1_st, k3_st"),
    ({"kl_controller": "pid"}, "kl_controller='pid' is not supported"),
    ({"kl_importance_weight": "both"}, "kl_importance_weight='both' is not supported"),
    ({"kl_adaptation_method": "dynamic", "kl_controller": "adaptive"}, "is the 'dynamic' controller"),
    ({"kl_adaptation_method": "clip", "beta": 0.0}, "needs beta > 0"),
    ({"importance_sampling_level": "sequence", "delta": 2.0, "use_bias_correction_kl": False},
     "delta=2.0 is not supported by klgrpo.trl: klgrpo's gspo has no delta cap"),
    ({"importance_sampling_level": "sequence"},
     "use_bias_correction_kl=True is not supported by klgrpo.trl: at importance_sampling_level 'sequence' TRL"),
    ({"importance_sampling_level": "sequence", "loss_type": "cispo", "use_bias_correction_kl": False},
     "loss_type='cispo' is not supported by klgrpo.trl: klgrpo's cispo weights each token by its own ratio"),
    ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold=0.0 is not supported by klgrpo.trl: klgrpo's"),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence", "use_bias_correction_kl": False},
     "loss_type='sapo' is not supported by klgrpo.trl: klgrpo's sapo weights each token by its own ratio"),
    ({"kl_controller": "adaptive", "kl_target": 0.0}, "kl_controller='adaptive': AdaptiveKLController needs"),
])
def test_bad_kl_fields_get_one_clear_line(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOConfig(**run_args(tmp_path, **fields))


def test_fields_defaults_and_choices_come_from_the_registries(tmp_path):
    args = GRPOConfig(**run_args(tmp_path))
    assert (args.kl_adaptation_method, args.kl_clip_threshold, args.kl_target, args.dynamic_beta_decay,
            args.reward_threshold, args.beta_min, args.beta_schedule_steps) == ("none", 1.0, 0.1, 0.9, 0.8, 0.0, 1000)
    assert (args.kl_estimator, args.resolved_kl_controller, args.resolved_kl_importance_weight) == \
        ("k3", "fixed", "in_graph")
    assert GRPOConfig(**run_args(tmp_path, use_bias_correction_kl=False)).resolved_kl_importance_weight == "none"
    fields = GRPOConfig.__dataclass_fields__
    assert fields["kl_adaptation_method"].metadata["choices"] == list(KL_ADAPTATION_METHODS)
    assert KL_ADAPTATION_METHODS == ("none", "clip", "sigmoid", "length_normalized", "dynamic")
    assert fields["kl_controller"].metadata["choices"] == ["fixed", "adaptive", "step", "dual", "dynamic"]


# ---- each method on hand-computed values ------------------------------------------------------------------

LN2 = math.log(2.0)
A, B = LN2 - 0.5, 1.0 - LN2  # k3 at l = ln 2 and l = -ln 2: exp(-l) + l - 1
LOGP = [[LN2, -LN2, 0.0], [LN2, 0.0, 0.0]]  # log pi - log ref per token (ref = 0)
MASK = [[1, 1, 1], [1, 0, 0]]               # lengths 3 and 1; 4 tokens
BETA = 0.5


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def hand_trainer(model_dir, tmp_path, **fields):
    """A bridge trainer whose policy log-probs are the fixed LOGP (advantages 0: only the KL term is left)."""
    trainer = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path, beta=BETA, loss_type="dapo", **fields)
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    trainer._policy_logps = lambda model, inputs: (logp, torch.zeros_like(logp), None)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer._last_reward = 1.0
    return trainer, logp


def hand_step(trainer, logp):
    mask = torch.tensor(MASK)
    inputs = {"completion_mask": mask, "advantages": torch.zeros(2, dtype=torch.float64),
              "ref_per_token_logps": torch.zeros(2, 3, dtype=torch.float64), "num_items_in_batch": mask.sum()}
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad


@pytest.mark.parametrize("method,fields,per_token", [
    ("none", {}, [A, B, A]),
    ("clip", {"kl_clip_threshold": 0.25}, [A, 0.25, A]),            # min(KL, 0.25): B = 0.307 is cut
    ("sigmoid", {"kl_target": 0.1}, [sigmoid(A - 0.1) * A, sigmoid(B - 0.1) * B, sigmoid(A - 0.1) * A]),
    ("length_normalized", {}, [A / 3, B / 3, A / 1]),                # KL / completion length
    ("dynamic", {}, [A, B, A]),                                      # beta changes, not the per-token KL
])
def test_each_method_matches_its_formula_on_hand_values(model_dir, tmp_path, method, fields, per_token):
    trainer, logp = hand_trainer(model_dir, tmp_path, kl_adaptation_method=method, **fields)
    loss, _ = hand_step(trainer, logp)
    assert loss == pytest.approx(BETA * sum(per_token) / 4, abs=1e-12)  # dapo: token mean over 4 tokens
    raw = trainer._metrics["train"]["adaptive_kl/raw_kl"][-1]
    assert raw == pytest.approx((2 * A + B) / 4, rel=1e-6)
    assert trainer._metrics["train"]["adaptive_kl/adapted_kl"][-1] == pytest.approx(sum(per_token) / 4, rel=1e-6)
    assert trainer._metrics["train"]["adaptive_kl/current_beta"][-1] == BETA


def test_in_graph_weight_turns_the_k3_gradient_into_the_log_ratio(model_dir, tmp_path):
    # d/dl [w k3] at w = 1 = k3 + (1 - e^-l) = l: the reverse-KL gradient; clip keeps only the weight's share
    trainer, logp = hand_trainer(model_dir, tmp_path)
    _, grad = hand_step(trainer, logp)
    expected = torch.tensor(LOGP, dtype=torch.float64) * torch.tensor(MASK) * BETA / 4
    assert torch.allclose(grad, expected, atol=1e-12)
    trainer, logp = hand_trainer(model_dir, tmp_path, kl_adaptation_method="clip", kl_clip_threshold=0.25)
    _, grad = hand_step(trainer, logp)
    expected[0, 1] = 0.25 * BETA / 4  # above the threshold: min(KL, c) = c, only w = pi/pi_old carries a gradient
    assert torch.allclose(grad, expected, atol=1e-12)


def test_dynamic_decays_beta_while_reward_beats_threshold_then_drops_to_beta_min(model_dir, tmp_path):
    trainer, logp = hand_trainer(model_dir, tmp_path, kl_adaptation_method="dynamic", reward_threshold=0.8,
                                 dynamic_beta_decay=0.9, beta_min=0.01, beta_schedule_steps=3)
    betas = []
    for reward in (1.0, 0.5, 1.0):  # above, below, then the schedule's end
        trainer._last_reward = reward
        hand_step(trainer, logp)
        betas.append(trainer.kl_controller.value)
    assert betas == pytest.approx([BETA * 0.9, BETA * 0.9, 0.01], abs=1e-15)
    assert trainer._metrics["train"]["adaptive_kl/current_beta"] == pytest.approx([BETA, BETA * 0.9, BETA * 0.9])


# ---- real runs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", KL_ADAPTATION_METHODS)
def test_two_steps_of_training_with_each_method(model_dir, tmp_path, method):
    trainer = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path, kl_adaptation_method=method,
                           reward_threshold=-1.0, kl_clip_threshold=0.002)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    assert len(logs) == 2
    betas = [h["adaptive_kl/current_beta"] for h in logs]
    assert betas == pytest.approx([0.1, 0.09] if method == "dynamic" else [0.1, 0.1])
    second = logs[1]
    assert second["adaptive_kl/raw_kl"] > 0 and math.isfinite(second["loss"])
    if method in ("none", "dynamic"):
        assert second["adaptive_kl/adapted_kl"] == second["adaptive_kl/raw_kl"]
    else:
        assert second["adaptive_kl/adapted_kl"] < second["adaptive_kl/raw_kl"]


def test_metrics_reach_tensorboard(model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path, kl_adaptation_method="sigmoid",
                           report_to=["tensorboard"], max_steps=1)
    trainer.train()
    run_dirs = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    assert run_dirs
    tags = set().union(*(EventAccumulator(str(d)).Reload().Tags()["scalars"] for d in run_dirs))
    assert {"train/adaptive_kl/raw_kl", "train/adaptive_kl/adapted_kl", "train/adaptive_kl/current_beta"} <= tags


def test_resumed_beta_trajectory_equals_the_uninterrupted_one(model_dir, tmp_path):
    fields = dict(kl_controller="adaptive", kl_target=1e-4, kl_horizon=20.0, max_steps=4, save_strategy="steps",
                  save_steps=2, beta=0.1, use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
                  entropy_coef_delta=0.01)  # every entropy is below 100 nats: the coefficient rises each step
    full = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "full", **fields)
    full.train()
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / CONTROLLER_FILE).read_text())
    assert saved["controller"] == "adaptive" and saved["state"]["num_updates"] == 2
    resumed = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "resumed", **fields)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    def betas(trainer):
        return [h["adaptive_kl/current_beta"] for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]

    assert len(betas(full)) == 4 and len(set(betas(full))) == 4  # beta moved at every step
    assert betas(resumed) == betas(full)
    assert resumed.kl_controller.state_dict() == full.kl_controller.state_dict()
    assert saved["entropy_controller"] == "adaptive" and saved["entropy_state"]["value"] == pytest.approx(0.07)
    assert resumed.entropy_controller.state_dict() == full.entropy_controller.state_dict()
    assert full.entropy_controller.value == pytest.approx(0.09)
    coefs = [h["entropy_coef"] for h in full.state.log_history if "entropy_coef" in h]
    resumed_coefs = [h["entropy_coef"] for h in resumed.state.log_history if "entropy_coef" in h]
    assert coefs == pytest.approx([0.06, 0.07, 0.08, 0.09]) and resumed_coefs[-2:] == coefs[-2:]


def test_resume_with_another_controller_is_refused(model_dir, tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    state = {"controller": "dynamic", "state": {"value": 0.05, "num_updates": 2, "kl_measure": "token_mean"}}
    (tmp_path / "checkpoint-2" / CONTROLLER_FILE).write_text(json.dumps(state))
    other = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "run")
    with pytest.raises(ConfigError, match="holds the state of kl_controller='dynamic' but this run uses 'fixed'"):
        other.restore_kl_controller(str(tmp_path / "checkpoint-2"))
    same = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "run", kl_adaptation_method="dynamic")
    same.restore_kl_controller(str(tmp_path / "checkpoint-2"))
    assert same.kl_controller.state_dict() == state["state"]


def test_stock_trl_args_are_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="needs args from klgrpo.trl.GRPOConfig"):
        make_trainer(GRPOTrainer, trl.GRPOConfig, model_dir, tmp_path)


def test_a_trl_outside_the_supported_range_fails_at_import_in_one_line(monkeypatch):
    import klgrpo.trl as bridge

    monkeypatch.setattr(bridge.metadata, "version", lambda name: "1.15.2")
    with pytest.raises(ImportError) as err:
        bridge._check_trl_version()
    assert str(err.value) == ('klgrpo.trl supports TRL >=1.16,<1.17 but TRL 1.15.2 is installed; '
                              'run: pip install "klgrpo[trl]"')

    def missing(name):
        raise bridge.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bridge.metadata, "version", missing)
    with pytest.raises(ImportError, match="but TRL is not installed; run: pip install"):
        bridge._check_trl_version()


def test_the_trl_extra_pins_the_supported_range():
    from pathlib import Path

    import tomllib

    from klgrpo.trl import SUPPORTED_TRL

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["trl"] == [f"trl{SUPPORTED_TRL}"]


# ---- the exact gradient table of docs/trl.md -------------------------------------------------------------------

def test_gradient_table_rows_match_verify_kl_declarations():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "trl_kl_gradients.py"
    spec = importlib.util.spec_from_file_location("trl_kl_gradients", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    token = {label: script.categorical_gradient(fields)["gradient_target"] for label, fields in script.SETTINGS}
    assert list(token.values()) == ["reverse", "neither", "neither", "reverse", "forward", "neither", "reverse"]
    # the k3 rows are what verify-kl declares for the same placement and weight
    from klgrpo.math.kl import ESTIMATORS
    assert ESTIMATORS["k3"].gradient_target("loss", "off_policy_in_graph") == token[script.SETTINGS[0][0]]
    assert ESTIMATORS["k3"].gradient_target("loss", "on_policy") == "forward"
    assert ESTIMATORS["k3_st"].gradient_target("loss", "off_policy_detached") == token[script.SETTINGS[6][0]]


# ---- 2 processes under accelerate launch ---------------------------------------------------------------------

@pytest.mark.slow
def test_two_cpu_processes_under_accelerate_launch_share_one_controller(model_dir, tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    root = Path(__file__).parents[1]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    # `--cpu --num_processes 2` starts ONE process in accelerate 1.15 (multi-CPU needs an MPI hostfile);
    # `--multi_gpu` with ACCELERATE_USE_CPU=1 goes through torchrun and runs 2 gloo processes on the CPU
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip",
           "127.0.0.1", "--main_process_port", port, str(root / "tests" / "helpers" / "trl_dist_worker.py"),
           model_dir, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    kl_keys = ("adaptive_kl/current_beta", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "reward", "num_tokens")
    assert ranks[0]["controller"] == ranks[1]["controller"]
    assert [[h[k] for k in kl_keys] for h in ranks[0]["logs"]] == [[h[k] for k in kl_keys] for h in ranks[1]["logs"]]
    logs = ranks[0]["logs"]
    assert logs[0]["num_tokens"] > 0 and len(logs) == 3
    # adaptive: beta <- beta (1 + clip(KL / target - 1, +-0.2) n / horizon), n = 4 sequences x 2 processes
    beta = 0.1
    for log in logs:
        assert log["adaptive_kl/current_beta"] == pytest.approx(beta, rel=1e-12)
        error = min(max(log["adaptive_kl/raw_kl"] / 1e-4 - 1.0, -0.2), 0.2)
        beta *= 1.0 + error * 8 / 20.0
    assert ranks[0]["controller"]["value"] == pytest.approx(beta, rel=1e-12)


@pytest.mark.parametrize("fields,target", [
    ({}, "reverse"),                                                   # TRL's default: k3, in-graph weight
    ({"use_bias_correction_kl": False}, "forward"),                    # k3, no weight, first epoch
    ({"kl_estimator": "k3_st", "kl_importance_weight": "detached"}, "reverse"),
    ({"kl_estimator": "k3_st"}, "neither"),                            # straight-through under an in-graph weight
    ({"kl_estimator": "k1", "kl_importance_weight": "detached"}, "zero"),
])
def test_estimator_and_weight_combinations_without_a_kl_gradient_warn(tmp_path, fields, target):
    from klgrpo.trl import kl_gradient_target

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GRPOConfig(**run_args(tmp_path, **fields))
    assert kl_gradient_target(args) == target
    ours = [w for w in caught if "expected KL gradient" in str(w.message)]
    assert len(ours) == (1 if target in ("neither", "zero") else 0)


def test_trl_command_line_parser_takes_the_new_fields_and_their_choices(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(GRPOConfig)
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "true", "--beta", "0.1", "--kl_adaptation_method", "clip",
        "--kl_clip_threshold", "0.5", "--kl_controller", "adaptive", "--kl_estimator", "k3_st",
        "--kl_importance_weight", "detached"])
    assert (args.kl_adaptation_method, args.kl_clip_threshold, args.resolved_kl_controller, args.kl_estimator,
            args.resolved_kl_importance_weight) == ("clip", 0.5, "adaptive", "k3_st", "detached")
    with pytest.raises(SystemExit):  # argparse's own one-line "invalid choice" message
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--kl_adaptation_method", "soft"])


def test_sequence_level_refuses_only_what_gspo_lacks():
    """importance_sampling_level 'sequence' is klgrpo's gspo; per-token factors TRL multiplies into a sequence
    loss have no counterpart there, per-sequence ones do."""
    from klgrpo.integrations.trl_mapping import map_trl

    base = {"importance_sampling_level": "sequence", "use_bias_correction_kl": False, "beta": 0.1}
    assert not map_trl(base).unmapped and map_trl(base).config["loss.policy_loss"] == "gspo"
    token_vllm = map_trl({**base, "use_vllm": True, "vllm_importance_sampling_mode": "token_mask"})
    assert "vllm_importance_sampling_mode" not in token_vllm.source_runtime
    assert "per token" in token_vllm.unmapped["vllm_importance_sampling_mode"]
    sequence_vllm = map_trl({**base, "use_vllm": True, "vllm_importance_sampling_mode": "sequence_mask"})
    # use_vllm maps onto klgrpo's vLLM sampler and its correction; the KL term's weighting differs (klgrpo weights it
    # too), which the bridge leaves to TRL's trainer
    assert sequence_vllm.config["rollout.sampler"] == "vllm"
    assert sequence_vllm.config["rollout.sampler_correction"] == "sequence_mask"
    assert set(sequence_vllm.unmapped) == sequence_vllm.source_runtime == {"vllm_importance_sampling_correction"}
    opted_in = map_trl({**base, "use_bias_correction_kl": True, "kl_importance_weight": "in_graph"})
    assert not opted_in.unmapped  # the user accepts klgrpo's per-token KL weight


def test_use_vllm_maps_onto_the_vllm_sampler_and_its_correction():
    """TRL's use_vllm picks klgrpo's vLLM sampler of the same mode; its importance ratio is
    rollout.sampler_correction with the same mode and bounds (cap: the deprecated name of clip_max; None: 0, no
    bound); beta 0 leaves nothing unmapped, since only the KL term's weighting differs."""
    from klgrpo.integrations.trl_mapping import map_trl

    base = {"beta": 0.0, "use_vllm": True}
    default = map_trl(base)
    assert (default.config["rollout.sampler"], default.config["rollout.sampler_correction"],
            default.config["rollout.sampler_correction_min"], default.config["rollout.sampler_correction_max"]) == (
        "vllm", "sequence_mask", 0.0, 3.0) and not default.unmapped
    server = map_trl({**base, "vllm_mode": "server", "vllm_importance_sampling_mode": "token_truncate",
                      "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_cap": 2.0})
    assert (server.config["rollout.sampler"], server.config["rollout.sampler_correction"],
            server.config["rollout.sampler_correction_min"], server.config["rollout.sampler_correction_max"]) == (
        "vllm_server", "token_truncate", 0.5, 2.0)
    assert server.config["rollout.vllm.server_url"] == "http://0.0.0.0:8000"  # TRL's client's default address
    assert (server.config["rollout.vllm.weight_transfer"], server.config["rollout.vllm.group_port"]) == ("nccl", 51216)
    ported = map_trl({**base, "vllm_mode": "server", "vllm_group_port": 52000})
    assert ported.config["rollout.vllm.group_port"] == 52000
    assert "rollout.vllm.weight_transfer" not in default.config  # colocated: the weights stay in the process
    based = map_trl({**base, "vllm_mode": "server", "vllm_server_base_url": "http://gen:8001"})
    assert based.config["rollout.vllm.server_url"] == "http://gen:8001"
    assert "rollout.vllm.server_url" not in default.config
    unbounded = map_trl({**base, "vllm_importance_sampling_clip_max": None})
    assert unbounded.config["rollout.sampler_correction_max"] == 0.0
    off = map_trl({**base, "vllm_importance_sampling_correction": False})
    assert "rollout.sampler_correction" not in off.config and off.config["rollout.sampler"] == "vllm"
    assert "rollout.sampler" not in map_trl({"beta": 0.0}).config


# ---- TRL's colocated vLLM on the CPU ----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_the_cpu_weight_sync_names_a_tied_output_embedding(model_dir, tied):
    """TRL walks named_parameters, which lists a tied weight once; vLLM's reload_weights leaves a layer without a
    weight unloaded, so the sync sends the tied lm_head under its own name as well (and nothing extra untied)."""
    from klgrpo.trl import _tied_output_embedding

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, tie_word_embeddings=tied)
    listed = {name for name, _ in model.named_parameters()}
    assert ("lm_head.weight" in listed) is not tied
    expected = {"model.embed_tokens.weight": "lm_head.weight"} if tied else {}
    assert _tied_output_embedding(model) == expected
    if tied:  # the name the sync adds is the output embedding's, a state-dict entry sharing the input's storage
        state = model.state_dict()
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
