"""The sampler-mismatch correction (klgrpo/math/sampler_correction.py) against TRL 1.16's real code, float64 at
1e-10: the ratio as TRL's ``_generate_and_score_completions`` computes it (its own source block, executed on
a stand-in trainer), and the loss and gradient as TRL's ``GRPOTrainer._compute_loss`` weights the policy term
with it (beta 0: TRL leaves the KL term unweighted, klgrpo weights it too, checked separately by hand)."""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import mapped_objective
from klgrpo.integrations.trl_mapping import map_trl
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective
from klgrpo.math.sampler_correction import SAMPLER_CORRECTIONS, SamplerCorrection, mismatch_per_token, sampler_weight
from tests.helpers.one_process import OneProcessAccelerator

trl = pytest.importorskip("trl")

F64 = torch.float64
B, T, MAX_LEN = 4, 5, 6
MODES = SAMPLER_CORRECTIONS[1:]


def _inputs(seed: int = 0, scale: float = 0.6):
    """pi (= pi_old, a batch's first update), the sampler's mu some way off, a reference, advantages, a ragged
    mask, and one token the sampler could not score (NaN)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 3 - 0.05
    mu = logp + scale * torch.randn(B, T, generator=gen, dtype=F64)
    mu[3] -= 0.5  # a row the sampler under-weights: its sequence ratio is above every upper bound below
    mu[0] += 0.4  # and one it over-weights: below the lower bounds
    mu[1, 2] = float("nan")
    ref = logp + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, generator=gen, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, mu, ref, adv, mask


def _trl_ratio_block() -> str:
    """The lines of TRL's ``_generate_and_score_completions`` that turn the sampler's log-probs into
    ``vllm_importance_sampling_ratio``, as installed (the test fails loudly if TRL moves them)."""
    source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    start = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask =")
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    return textwrap.dedent("            " + source[start:end])


def trl_ratio(old, mu, mask, mode: str, clip_min, clip_max):
    fake = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                           vllm_importance_sampling_clip_max=clip_max)
    scope = {"self": fake, "torch": torch, "math": math, "old_per_token_logps": old,
             "sampling_per_token_logps": mu, "completion_mask": mask, "tool_mask": None}
    exec(compile(_trl_ratio_block(), "trl_grpo_trainer_ratio_block", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


BOUNDS = [(None, 3.0), (0.5, 2.0), (None, 1.2), (0.8, None)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_min, clip_max", BOUNDS)
def test_the_weight_is_trls_ratio(mode, clip_min, clip_max):
    logp, mu, _, _, mask = _inputs()
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        pytest.skip("TRL refuses a truncate mode without a bound")
    expected = trl_ratio(logp, mu, mask, mode, clip_min, clip_max)
    got = sampler_weight(logp, mu, mask, SamplerCorrection(mode, clip_min, clip_max))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # the bounds bind somewhere in these inputs (else the cases would test nothing of them)
    diff = torch.nan_to_num((logp - mu) * mask, nan=0.0)
    unbounded = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    assert (got != unbounded).any()


def _trl_loss(fields: dict, logp, old, mu, ref, adv, mask, ratio):
    """TRL 1.16's own GRPOTrainer._compute_loss with use_vllm and the sampler's ratio in its inputs."""
    args = {"beta": 0.0, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "delta": None, **fields}
    eps_high = args["epsilon"] if args["epsilon_high"] is None else args["epsilon_high"]
    leaf = logp.clone().requires_grad_(True)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=args["beta"], loss_type=args["loss_type"],
        epsilon_low=args["epsilon"], epsilon_high=eps_high, use_vllm=True, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=OneProcessAccelerator(), _entropy_bonus_enabled=False, entropy_coef=0.0,
        use_adaptive_entropy=False, _last_world_entropy=math.inf, _entropy_window_stats=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=MAX_LEN,
        get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask, get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=args["delta"], steps_per_generation=1,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05))
    fake.get_high_entropy_mask = MethodType(trl.GRPOTrainer.get_high_entropy_mask, fake)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
              "old_per_token_logps": old, "sampling_per_token_logps": mu, "importance_sampling_ratio": ratio}
    loss = trl.GRPOTrainer._compute_loss(fake, None, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def _ours(fields: dict, mode: str, clip_min, clip_max, logp, mu, ref, adv, mask):
    mapped = map_trl(fields)
    cfg = mapped.klgrpo_config()
    cfg.rollout.sampler_correction = mode
    cfg.rollout.sampler_correction_min, cfg.rollout.sampler_correction_max = clip_min or 0.0, clip_max or 0.0
    leaf = logp.clone().requires_grad_(True)
    out = mapped_objective(cfg, 0.0, ObjectiveInputs(leaf, leaf.detach(), None, adv, mask, sampler_logp_BT=mu),
                           Normalizer.of(mask, MAX_LEN))
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach(), grad


LOSS_TYPES = [{"loss_type": "dapo"}, {"loss_type": "grpo"}, {"loss_type": "dr_grpo"}, {"loss_type": "bnpo"},
              {"loss_type": "cispo", "epsilon_high": 5.0}, {"loss_type": "sapo"}]


@pytest.mark.parametrize("fields", LOSS_TYPES, ids=lambda f: f["loss_type"])
@pytest.mark.parametrize("mode", MODES)
def test_the_weighted_loss_is_trls_compute_loss(fields, mode):
    """Loss and gradient of each mode (TRL's default bounds: clip_min None, clip_max 3.0) with TRL's surrogates."""
    logp, mu, ref, adv, mask = _inputs(seed=1)
    ratio = trl_ratio(logp.detach(), mu, mask, mode, None, 3.0)
    expected_loss, expected_grad = _trl_loss(fields, logp, logp.detach(), mu, ref, adv, mask, ratio)
    loss, grad = _ours(fields, mode, None, 3.0, logp, mu, ref, adv, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-10)
    # the weight matters in these inputs: without it the loss differs
    unweighted, _ = _ours(fields, "none", None, 3.0, logp, mu, ref, adv, mask)
    assert abs(float(unweighted - expected_loss)) > 1e-4


def test_the_kl_term_is_weighted_too():
    """beta * KL per token is multiplied by the same weight: with advantages 0 only the KL term is left, and (the
    aggregation seq_mean_token_sum: the token sum over B sequences)
    the loss with the correction is the one without it with each token's term times the weight (by hand)."""
    logp, mu, ref, _, mask = _inputs(seed=2)
    norm = Normalizer.of(mask, MAX_LEN)
    kl = KLTerm(coef=0.5, estimator="k3_st")
    zero = torch.zeros(B, dtype=F64)
    for mode in MODES:
        correction = SamplerCorrection(mode, None, 3.0)
        got = grpo_objective(ObjectiveInputs(logp, logp, ref, zero, mask, sampler_logp_BT=mu),
                             ObjectiveTerms(kl=kl, aggregation="seq_mean_token_sum", sampler_correction=correction),
                             norm).loss
        l_BT = logp - ref
        k3 = torch.expm1(-l_BT) + l_BT  # k3 value, on-policy weight 1
        weight = sampler_weight(logp, mu, mask, correction)
        torch.testing.assert_close(got, 0.5 * (k3 * weight * mask).sum() / B, rtol=1e-12, atol=1e-12)


def test_none_and_no_sampler_logprobs_leave_the_loss_alone():
    logp, mu, ref, adv, mask = _inputs(seed=3)
    norm, kl = Normalizer.of(mask, MAX_LEN), KLTerm(coef=0.1)
    terms = ObjectiveTerms(kl=kl, aggregation="token_mean")
    plain = grpo_objective(ObjectiveInputs(logp, logp, ref, adv, mask), terms, norm).loss
    with_mu = grpo_objective(ObjectiveInputs(logp, logp, ref, adv, mask, sampler_logp_BT=mu), terms, norm).loss
    assert with_mu == plain
    masking = ObjectiveTerms(kl=kl, aggregation="token_mean", sampler_correction=SamplerCorrection("token_mask"))
    assert grpo_objective(ObjectiveInputs(logp, logp, ref, adv, mask), masking, norm).loss == plain


def test_the_mismatch_per_token_by_hand():
    """d = log pi_old - log mu = log 2 -> |d| = 0.6931..., k3 = r - 1 - log r = 2 - 1 - 0.6931... = 0.3068...;
    a NaN sampler log-prob counts as no mismatch."""
    old = torch.tensor([[math.log(0.5), math.log(0.3)]], dtype=F64)
    mu = torch.tensor([[math.log(0.25), float("nan")]], dtype=F64)
    diff, kl = mismatch_per_token(old, mu)
    torch.testing.assert_close(diff, torch.tensor([[math.log(2.0), 0.0]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(kl, torch.tensor([[1.0 - math.log(2.0), 0.0]], dtype=F64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("overrides, fragment", [
    ({"rollout.sampler_correction": "token_truncate", "rollout.sampler_correction_max": 0.0}, "needs a bound"),
    ({"rollout.sampler_correction": "sequence_mask", "rollout.sampler_correction_min": 2.0,
      "rollout.sampler_correction_max": 1.5}, "must be below"),
    ({"rollout.sampler_correction": "token_mask", "loss.policy_loss": "vespo"}, "vespo"),
    ({"rollout.sampler_correction": "tokens"}, "rollout.sampler_correction"),
    ({"rollout.sampler_correction": "token_mask", "loss.function": "my_loss.py:loss"}, "loss.function"),
])
def test_bad_settings_are_one_line_naming_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        GRPOConfig().override(overrides).validate()
    message = str(info.value)
    assert fragment in message and "\n" not in message
