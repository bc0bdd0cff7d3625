"""One typed plan between the config and the step: the step reads ``StepPlan`` (config/terms.py), never the
config; the config is validated once per run and read-only from then on; a policy loss's own settings are the
dataclass it registered; declaring the config loads neither torch nor transformers."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klgrpo.config import validation
from klgrpo.config.schema import GRPOConfig, all_field_paths
from klgrpo.config.terms import policy_term, step_plan
from klgrpo.errors import ConfigError
from klgrpo.math.objective import PolicyTerm
from klgrpo.math.policy_loss import POLICY_LOSSES, sapo_surrogate, vespo_surrogate
from klgrpo.math.policy_params import SapoParams, VespoParams
from klgrpo.math.registry import Registry
from tests.helpers.configs import make_config, quiet

PACKAGE = Path(__file__).resolve().parents[1] / "klgrpo"
BASE = {"data": {"source": "x.jsonl"}, "model": {"name_or_path": "m"}}


def test_declaring_the_config_loads_neither_torch_nor_transformers():
    """Importing the config and building one from values that name nothing; a named choice (kl.estimator) is
    checked against the math's registries, which load torch then."""
    code = ("import sys; import klgrpo.config; from klgrpo.config.schema import GRPOConfig, config_help; "
            "cfg = GRPOConfig.from_dict({'train': {'steps': 3}, 'kl': {'coef': 0.1}}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_step_reads_no_config():
    """train/step.py names no config: no ``cfg``, no GRPOConfig, no ``.cfg`` attribute."""
    tree = ast.parse((PACKAGE / "train" / "step.py").read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {"cfg", "GRPOConfig"} & names and "cfg" not in attributes


def test_the_plan_holds_what_the_config_says():
    cfg = GRPOConfig.from_dict({**BASE, "rollout": {"group_size": 3, "prompts_per_step": 6, "max_new_tokens": 9,
                                                     "temperature": 0.7, "top_p": 0.9, "mask_truncated": True},
                                "train": {"micro_batch_size": 6, "num_iterations": 2, "entropy_metrics": False},
                                "loss": {"advantage_scale": "batch", "std_ddof": 0, "aggregation": "seq_mean_token_sum",
                                         "delta": 1.5, "top_entropy_quantile": 0.5},
                                "kl": {"coef": 0.3, "estimator": "k2", "sync_every": 4, "sync_alpha": 0.5},
                                "optim": {"max_grad_norm": 0.0}})
    cfg.validate()
    plan = step_plan(cfg)
    s = plan.sampling
    assert (s.group_size, s.max_new_tokens, s.temperature, s.top_p, s.compiled) == (3, 9, 0.7, 0.9, False)
    assert (plan.prompts_per_step, plan.micro_batch_size, plan.num_iterations, plan.mask_truncated) == (6, 6, 2, True)
    assert (plan.advantage_scale, plan.std_ddof, plan.aggregation) == ("batch", 0, "seq_mean_token_sum")
    assert plan.policy == PolicyTerm(name="ppo_clip", delta=1.5)
    assert (plan.kl.coef, plan.kl.estimator, plan.kl_term(0.05).coef, plan.kl_term(0.05).estimator) == (
        0.3, "k2", 0.05, "k2")
    assert plan.entropy_in_loss and plan.with_entropy and plan.entropy_term(0.2).top_quantile == 0.5
    assert plan.max_grad_norm == math.inf and (plan.sync_every, plan.sync_alpha) == (4, 0.5)


def test_a_config_is_validated_once_and_read_only_afterwards(monkeypatch):
    calls = []
    real = validation.validate_config
    monkeypatch.setattr(validation, "validate_config", lambda cfg, given=False: calls.append(given) or real(cfg, given))
    cfg = GRPOConfig.from_dict({**BASE, "kl": {"placement": "reward", "estimator": "k3"}})
    cfg.kl.coef = 0.2  # settable while it is being put together
    first = cfg.validate()
    assert cfg.validate() == first and cfg.validate(dataset_given=True) == first and calls == [False]
    assert len(first) == 1 and "not the reverse KL" in first[0]
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only once validated"):
        cfg.kl.coef = 0.3
    changed = dataclasses.replace(cfg, kl=dataclasses.replace(cfg.kl, coef=0.3))
    assert (changed.kl.coef, cfg.kl.coef, changed.validated, cfg.validated) == (0.3, 0.2, False, True)
    assert cfg.override({"kl.coef": 0.5}).kl.coef == 0.5


def test_a_run_validates_its_config_once(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    """klgrpo train checks the config before loading anything; the trainer and the replay anchor reuse that."""
    from klgrpo.run.trainer import GRPOTrainer

    calls = []
    real = validation.validate_config
    monkeypatch.setattr(validation, "validate_config", lambda cfg, given=False: calls.append(given) or real(cfg, given))
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", kl={
        "replay": {"coef": 0.1, "source": str(addition_file), "num_prompts": 2, "batch_size": 2}})
    cfg.validate()
    trainer = GRPOTrainer(cfg, log=quiet)
    assert calls == [False] and trainer.grpo_step.replay is not None


def test_sapo_and_vespo_fields_are_declared_from_their_registered_settings():
    assert POLICY_LOSSES.params("sapo") is SapoParams and POLICY_LOSSES.params("vespo") is VespoParams
    assert POLICY_LOSSES.params("ppo_clip") is None
    fields = dict(all_field_paths())
    for loss, params in (("sapo", SapoParams), ("vespo", VespoParams)):
        for spec in dataclasses.fields(params):
            flat = fields[f"loss.{loss}_{spec.name}"]
            assert flat.default == spec.default
            assert {k: flat.metadata[k] for k in ("help", "low", "above", "high", "below", "at_low")} == dict(
                spec.metadata)
    with pytest.raises(ConfigError, match=r"^loss.sapo_temperature_neg must be > 0, got 0.0$"):
        GRPOConfig.from_dict({**BASE, "loss": {"sapo_temperature_neg": 0.0}}).validate()


def test_the_flat_fields_reach_the_surrogate_as_its_settings():
    """The config's loss.sapo_* / loss.vespo_* become the loss's settings, and the objective hands them over: the
    PolicyTerm's loss equals the surrogate called with those keywords (float64, exact), and differs from the
    defaults' (the mapping is seen)."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64), torch.ones(3, 4)
    cases = (("sapo", {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}, sapo_surrogate,
              SapoParams(temperature_pos=0.5, temperature_neg=2.0)),
             ("vespo", {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.5},
              vespo_surrogate, VespoParams(k_pos=1.5, lambda_pos=2.5, k_neg=2.0, lambda_neg=1.5)))
    for name, flat, fn, params in cases:
        cfg = GRPOConfig.from_dict({**BASE, "loss": {"policy_loss": name, **flat}})
        term = policy_term(cfg.loss)
        got = term.surrogate(logp, old, adv, mask).loss_BT
        torch.testing.assert_close(got, fn(logp, old, adv, mask, params=params).loss_BT, rtol=0, atol=0)
        default = PolicyTerm(name=name).surrogate(logp, old, adv, mask).loss_BT
        assert (got - default).abs().max() > 1e-3


def test_policy_params_name_only_the_chosen_losss_own_settings():
    def refusal(loss: dict) -> str:
        with pytest.raises(ConfigError) as err:
            GRPOConfig.from_dict({**BASE, "loss": loss}).validate()
        return str(err.value)

    assert refusal({"policy_params": {"temperature_pos": 2.0}}) == (
        "loss.policy_params.temperature_pos: loss.policy_loss ppo_clip has no settings of its own")
    assert refusal({"policy_loss": "sapo", "policy_params": {"temperature_pos": 2.0}}) == (
        "loss.policy_params.temperature_pos: set loss.sapo_temperature_pos instead")
    assert refusal({"policy_loss": "vespo", "policy_params": {"k": 2.0}}) == (
        "loss.policy_params.k: loss.policy_loss vespo has the settings k_pos, lambda_pos, k_neg, lambda_neg")


def test_a_registry_takes_only_frozen_settings():
    registry = Registry("thing")

    @dataclasses.dataclass
    class Loose:
        x: float = 1.0

    with pytest.raises(TypeError, match="frozen dataclass"):
        registry.register("a", object(), params=Loose)
    assert "a" not in registry


def test_the_objective_picks_no_loss_by_name():
    """The surrogate's settings come from its registration, not from name checks in the objective."""
    source = (PACKAGE / "math" / "objective.py").read_text()
    assert 'name == "' not in source and "sapo" not in source and "vespo" not in source


def test_eval_changes_a_copy_of_the_config():
    from klgrpo.apps.evaluate import _for_evaluation

    sets = [{"name": "a", "source": "a.jsonl"}, {"name": "b", "source": "b.jsonl"}]
    cfg = GRPOConfig.from_dict({**BASE, "eval": {"sets": sets}})
    cfg.validate()
    used = _for_evaluation(cfg, ["b"])
    assert used.eval.sets == sets[1:] and used.logging.progress is False
    assert cfg.eval.sets == sets and cfg.logging.progress is True
