"""KL / loss settings of the config: refusals (one line naming the field and the fix) and warnings."""

from __future__ import annotations

import pytest

from klgrpo.config.schema import GRPOConfig
from klgrpo.config.validation import kl_gradient_target, validate_config
from klgrpo.errors import ConfigError


def _cfg(**groups) -> GRPOConfig:
    return GRPOConfig.from_dict(groups)


@pytest.mark.parametrize("estimator", ["k3", "k3_st"])
def test_log_ratio_clamp_zero_is_refused_where_k3_needs_it(estimator):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(kl={"estimator": estimator, "log_ratio_clamp": 0.0}))
    message = str(err.value)
    assert "\n" not in message and "kl.log_ratio_clamp" in message and "positive value" in message


@pytest.mark.parametrize("estimator", ["k1", "k2", "k1_st"])
def test_log_ratio_clamp_zero_is_allowed_without_an_exponential(estimator):
    validate_config(_cfg(kl={"estimator": estimator, "log_ratio_clamp": 0.0}))


@pytest.mark.parametrize("field, value", [("delta", 0.9), ("dual_clip", 1.0)])
def test_delta_and_dual_clip_ranges(field, value):
    with pytest.raises(ConfigError, match=f"loss.{field} must be > 1"):
        validate_config(_cfg(loss={field: value}))
    validate_config(_cfg(loss={field: 3.0}))


@pytest.mark.parametrize("placement", ["reward", "both"])
def test_reward_kl_with_several_iterations_warns_what_changes(placement):
    warnings = validate_config(_cfg(kl={"placement": placement, "estimator": "k1", "is_correction": "detached"},
                                    train={"num_iterations": 2}))
    (w,) = [w for w in warnings if "ROLLOUT policy" in w]
    assert "train.num_iterations=2" in w and "KL(pi||pi_old)" in w and "kl.placement=loss" in w
    assert not [w for w in validate_config(_cfg(kl={"placement": placement, "estimator": "k1"}))
                if "ROLLOUT policy" in w]
    assert not [w for w in validate_config(_cfg(kl={"placement": "loss"}, train={"num_iterations": 2}))
                if "ROLLOUT policy" in w]


def test_trl_default_is_reverse_and_uncorrected_k3_is_forward():
    # TRL 1.16: use_bias_correction_kl=True -> k3 with w in the graph: the reverse KL, on the first epoch too
    assert kl_gradient_target(_cfg(kl={"estimator": "k3", "is_correction": "in_graph"})) == "reverse"
    # TRL with the correction off, and verl's low_var_kl: the unweighted k3 -> forward KL
    assert kl_gradient_target(_cfg(kl={"estimator": "k3", "is_correction": "none"})) == "forward"
    # k3 in both places with a detached weight: reverse on the one epoch of num_iterations 1
    assert kl_gradient_target(_cfg(kl={"estimator": "k3", "placement": "both", "is_correction": "detached"})) == \
        "reverse"
    warnings = validate_config(_cfg(kl={"estimator": "k3", "is_correction": "none"}))
    assert any("FORWARD" in w and "use_bias_correction_kl=True" in w for w in warnings)
