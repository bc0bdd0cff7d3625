"""KL controllers (klgrpo/math/kl_control.py) against hand-computed beta sequences (docs/kl_math.md, "Controllers")."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klgrpo.math.kl_control import (
    CONTROLLERS,
    DUAL_BETA_FLOOR,
    AdaptiveKLController,
    DualAscentKLController,
    DynamicScheduleKLController,
    KLObservation,
    StepKLController,
    build_controller,
)

# Each registered controller: constructor parameters, a script of updates (observed_kl, n_steps, reward)
# and the beta after each update, computed by hand in the comments.
_E = math.exp
CASES = {
    "fixed": dict(
        params=dict(init_coef=0.1),
        script=[(0.5, 1, None), (0.0, 7, 1.0), (10.0, 100, -1.0)],
        # beta never moves
        expected=[0.1, 0.1, 0.1],
    ),
    "adaptive": dict(
        # Ziegler: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n_steps / horizon, with n/h = 100/1000
        params=dict(init_coef=0.1, target=0.1, horizon=1000.0),
        script=[(0.5, 100, None), (0.0, 100, None), (0.11, 100, None), (0.1, 100, None), (0.3, 10, None)],
        expected=[
            0.1 * 1.02,                       # e = 0.5/0.1 - 1 = 4 -> clipped to +0.2: 0.1 * (1 + 0.2*0.1) = 0.102
            0.1 * 1.02 * 0.98,                # e = -1 -> clipped to -0.2: 0.102 * 0.98 = 0.09996
            0.1 * 1.02 * 0.98 * 1.01,         # e = 0.11/0.1 - 1 = 0.1 (interior): 0.09996 * 1.01 = 0.1009596
            0.1 * 1.02 * 0.98 * 1.01,         # e = 0: unchanged
            0.1 * 1.02 * 0.98 * 1.01 * 1.002,  # e = 2 -> 0.2, n/h = 10/1000: * (1 + 0.2*0.01) = 1.002
        ],
    ),
    "step": dict(
        # bands: KL > 1.5*0.5 = 0.75 -> *1.5 ; KL < 0.5*0.5 = 0.25 -> *0.75 ; otherwise unchanged
        params=dict(init_coef=1.0, target=0.5),
        script=[(1.0, 1, None), (0.75, 1, None), (0.5, 1, None), (0.25, 1, None), (0.1, 1, None),
                (0.0, 1, None), (2.0, 1, None)],
        expected=[1.5,      # 1.0 > 0.75: up
                  1.5,      # 0.75 is on the band edge (not >): no change
                  1.5,      # inside
                  1.5,      # 0.25 is on the band edge (not <): no change
                  1.125,    # 0.1 < 0.25: 1.5 * 0.75
                  0.84375,  # 1.125 * 0.75
                  1.265625],  # 0.84375 * 1.5
    ),
    "dual": dict(
        # log beta += lr (KL - eps)/eps with lr = 0.1, eps = 0.1, beta_0 = 1
        params=dict(init_coef=1.0, target=0.1, lr=0.1),
        script=[(0.3, 1, None), (0.0, 1, None), (0.1, 1, None), (0.05, 1, None)],
        expected=[_E(0.2),    # + 0.1 * (0.3 - 0.1)/0.1 = +0.2
                  _E(0.1),    # + 0.1 * (0 - 0.1)/0.1 = -0.1
                  _E(0.1),    # KL = eps: no change
                  _E(0.05)],  # + 0.1 * (0.05 - 0.1)/0.1 = -0.05
    ),
    "dynamic": dict(
        # decay 0.5 while reward > 0.5, floor 0.1, beta = beta_min from the 5th update on
        params=dict(init_coef=1.0, reward_threshold=0.5, decay=0.5, beta_min=0.1, schedule_steps=5),
        script=[(0.0, 1, 0.9), (0.0, 1, 0.2), (0.0, 1, None), (0.0, 1, 0.5), (0.0, 1, 0.6),
                (0.0, 1, 0.0), (0.0, 1, 0.9)],
        expected=[0.5,   # 0.9 > 0.5: 1.0 * 0.5
                  0.5,   # 0.2 below: no decay
                  0.5,   # no reward given: no decay
                  0.5,   # 0.5 is not > 0.5
                  0.1,   # 5th update: schedule over -> beta_min (not 0.25)
                  0.1,   # stays at beta_min
                  0.1],
    ),
}


def test_every_registered_controller_has_a_scripted_case():
    assert set(CASES) == set(CONTROLLERS.names())


@pytest.mark.parametrize("name", sorted(CONTROLLERS.names()))
def test_scripted_beta_sequence(name):
    case = CASES[name]
    ctl = build_controller(name, **case["params"])
    assert ctl.value == case["params"]["init_coef"]
    for i, ((kl, n, reward), beta) in enumerate(zip(case["script"], case["expected"])):
        returned = ctl.update(kl, n_steps=n, reward=reward)
        assert returned == ctl.value
        assert ctl.value == pytest.approx(beta, rel=1e-12, abs=0.0), f"update {i + 1}"
        assert ctl.num_updates == i + 1


@pytest.mark.parametrize("name", sorted(CONTROLLERS.names()))
def test_state_dict_round_trip_continues_identically(name):
    case = CASES[name]
    script = case["script"]
    half = len(script) // 2
    straight = build_controller(name, **case["params"])
    first = build_controller(name, **case["params"])
    for kl, n, reward in script[:half]:
        straight.update(kl, n, reward)
        first.update(kl, n, reward)
    # A checkpoint is written as plain data (JSON here) and loaded into a freshly built controller whose
    # own init_coef differs, so the state has to carry beta and the update count.
    state = json.loads(json.dumps(first.state_dict()))
    params = dict(case["params"], init_coef=123.0)
    resumed = build_controller(name, **params)
    resumed.load_state_dict(state)
    assert resumed.value == first.value and resumed.num_updates == half
    for kl, n, reward in script[half:]:
        assert resumed.update(kl, n, reward) == straight.update(kl, n, reward)
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("name", sorted(CONTROLLERS.names()))
def test_kl_measure_is_validated_and_kept(name):
    params = CASES[name]["params"]
    with pytest.raises(ValueError, match="kl_measure"):
        build_controller(name, **params, kl_measure="sequence_mean")
    ctl = build_controller(name, **params, kl_measure="sequence_sum")
    assert ctl.kl_measure == "sequence_sum"
    assert ctl.state_dict()["kl_measure"] == "sequence_sum"
    assert build_controller(name, **params).kl_measure == "token_mean"


def test_unknown_controller_lists_the_valid_names():
    with pytest.raises(KeyError, match="adaptive.*dual.*dynamic.*fixed.*step"):
        build_controller("ziegler", 0.1)


def test_adaptive_clip_bounds_and_interior():
    # n_steps / horizon = 1 so beta_1 = beta_0 (1 + e) shows e directly.
    for kl, e in [(10.0, 0.2),     # 10/2 - 1 = 4 -> +0.2
                  (2.2, 0.1),      # 2.2/2 - 1 = 0.1 (interior)
                  (1.5, -0.2),      # 1.5/2 - 1 = -0.25 -> clipped to -0.2
                  (0.0, -0.2)]:    # -1 -> -0.2
        ctl = AdaptiveKLController(1.0, target=2.0, horizon=64)
        ctl.update(kl, n_steps=64)
        assert ctl.value == pytest.approx(1.0 + e, rel=1e-12)
    # a custom error_clip moves both bounds
    ctl = AdaptiveKLController(1.0, target=2.0, horizon=10, error_clip=0.5)
    ctl.update(10.0, n_steps=1)  # e = 4 -> 0.5; beta = 1 + 0.5 * 1/10 = 1.05
    assert ctl.value == pytest.approx(1.05, rel=1e-12)
    ctl.update(0.0, n_steps=2)   # e = -1 -> -0.5; beta = 1.05 * (1 - 0.5 * 2/10) = 0.945
    assert ctl.value == pytest.approx(0.945, rel=1e-12)
    with pytest.raises(ValueError):
        AdaptiveKLController(1.0, target=0.0, horizon=10)
    with pytest.raises(ValueError):
        AdaptiveKLController(1.0, target=1.0, horizon=0)


def test_step_rule_custom_factors_and_bands():
    # up 2, down 0.5, high 2 (band edge 2*0.25 = 0.5), low 0.25 (edge 0.0625)
    ctl = StepKLController(1.0, target=0.25, up=2.0, down=0.5, high=2.0, low=0.25)
    betas = [ctl.update(kl) for kl in (0.6, 0.5, 0.1, 0.0625, 0.06, 0.0)]
    #          0.6 > 0.5: *2 ; edge: = ; inside: = ; edge: = ; 0.06 < 0.0625: *0.5 ; *0.5
    assert betas == [2.0, 2.0, 2.0, 2.0, 1.0, 0.5]


def test_dual_ascent_bounds():
    ctl = DualAscentKLController(1.0, target=0.1, lr=1.0, beta_min=0.5, beta_max=1.5)
    # log beta = 0 + 1 * (1.0 - 0.1)/0.1 = 9 -> e^9 = 8103 -> capped at beta_max
    assert ctl.update(1.0) == 1.5
    # log beta = log 1.5 + (0 - 0.1)/0.1 = log 1.5 - 1 -> 1.5/e = 0.5518 (inside)
    assert ctl.update(0.0) == pytest.approx(1.5 / math.e, rel=1e-12)
    # 0.5518 / e = 0.203 -> raised to beta_min
    assert ctl.update(0.0) == 0.5
    # from the floor it climbs again: log 0.5 + 1 * (0.2 - 0.1)/0.1 = log 0.5 + 1
    assert ctl.update(0.2) == pytest.approx(0.5 * math.e, rel=1e-12)
    with pytest.raises(ValueError):
        DualAscentKLController(0.0, target=0.1)
    with pytest.raises(ValueError):
        DualAscentKLController(1.0, target=0.0)


def test_dynamic_schedule_decay_floor_and_end():
    ctl = DynamicScheduleKLController(0.4, reward_threshold=0.0, decay=0.5, beta_min=0.08)
    # schedule_steps = 0 disables the end of schedule; decay floors at beta_min
    betas = [ctl.update(0.0, reward=r) for r in (1.0, -1.0, 1.0, 1.0, 1.0)]
    #        0.4*0.5 ; below threshold ; 0.1 ; max(0.05, 0.08) ; stays
    assert betas == pytest.approx([0.2, 0.2, 0.1, 0.08, 0.08], rel=1e-12)
    # schedule end sets beta_min after exactly schedule_steps updates even with no reward above threshold
    ctl = DynamicScheduleKLController(1.0, reward_threshold=10.0, decay=0.9, beta_min=0.0, schedule_steps=3)
    assert [ctl.update(0.0, reward=0.0) for _ in range(4)] == [1.0, 1.0, 0.0, 0.0]


# ---- closed loop: a toy whose KL falls with beta settles at the target ----------------------------------

def test_dual_ascent_settles_on_c_over_beta():
    # KL(beta) = c / beta, budget eps: the fixed point is beta* = c / eps = 0.02 / 0.01 = 2.
    # Near it log beta contracts by (1 - lr) = 0.5 per update; from beta = 0.1 it first hits beta_max.
    c, eps = 0.02, 0.01
    ctl = DualAscentKLController(0.1, target=eps, lr=0.5)
    for _ in range(200):
        ctl.update(c / ctl.value)
    assert ctl.value == pytest.approx(2.0, rel=1e-9)
    assert c / ctl.value == pytest.approx(eps, rel=1e-9)


def test_adaptive_settles_on_c_over_beta():
    # Same toy; beta* = c / target = 0.05 / 0.025 = 2. Far from it beta moves by at most 2% per update
    # (error clipped at 0.2, n/h = 0.1), near it the error contracts by (1 - n/h) = 0.9 per update.
    c, target = 0.05, 0.025
    ctl = AdaptiveKLController(1.0, target=target, horizon=10.0)
    for _ in range(600):
        ctl.update(c / ctl.value, n_steps=1)
    assert ctl.value == pytest.approx(2.0, rel=1e-9)


def _optimum_kl(beta: float) -> float:
    """Exact KL(pi*_beta || ref) for pi*_beta = ref exp(R / beta) / Z, ref uniform over 4 outcomes."""
    rewards = torch.tensor([0.0, 0.5, 1.0, 1.5], dtype=torch.float64)
    log_ref = torch.full((4,), -math.log(4.0), dtype=torch.float64)
    log_pi = torch.log_softmax(log_ref + rewards / beta, dim=0)
    return float((log_pi.exp() * (log_pi - log_ref)).sum())


@pytest.mark.parametrize("name", ["dual", "adaptive"])
def test_closed_loop_on_the_regularised_optimum(name):
    # KL(pi*_beta) decreases in beta, so the budget 0.1 has a single beta*; find it by bisection on the
    # exact formula, then check that the controller reaches it from beta = 1.
    target = 0.1
    lo, hi = 1e-3, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _optimum_kl(mid) > target else (lo, mid)
    beta_star = math.sqrt(lo * hi)
    assert _optimum_kl(beta_star) == pytest.approx(target, rel=1e-10)
    if name == "dual":
        ctl = build_controller("dual", 1.0, target=target, lr=0.3)
    else:
        ctl = build_controller("adaptive", 1.0, target=target, horizon=4.0)
    for _ in range(400):
        ctl.update(_optimum_kl(ctl.value), n_steps=1)
    assert ctl.value == pytest.approx(beta_star, rel=1e-6)
    assert _optimum_kl(ctl.value) == pytest.approx(target, rel=1e-6)


def test_dual_ascent_starts_inside_its_bounds():
    from klgrpo.math.kl_control import DualAscentKLController

    assert DualAscentKLController(5.0, target=0.1, beta_min=0.01, beta_max=2.0).value == 2.0
    assert DualAscentKLController(1e-4, target=0.1, beta_min=0.01, beta_max=2.0).value == 0.01
    assert DualAscentKLController(0.5, target=0.1, beta_min=0.01, beta_max=2.0).value == 0.5


@pytest.mark.parametrize("measure,expected_beta", [
    # Ziegler, target 0.1, horizon 100, 10 sequences: token_mean 0.15 -> e = 0.2 (clipped from 0.5) -> 1.02;
    # sequence_sum 0.05 -> e = -0.5 -> -0.2 -> beta = 1 - 0.2 * 10 / 100 = 0.98
    ("token_mean", 1.02), ("sequence_sum", 0.98),
])
def test_observe_reads_the_declared_measure(measure, expected_beta):
    obs = KLObservation(token_mean=0.15, sequence_sum=0.05, n_sequences=10, reward=0.3)
    ctl = AdaptiveKLController(1.0, target=0.1, horizon=100, kl_measure=measure)
    assert ctl.observe(obs) == pytest.approx(expected_beta, rel=1e-15)
    twin = AdaptiveKLController(1.0, target=0.1, horizon=100, kl_measure=measure)
    assert twin.update(obs.kl(measure), n_steps=10, reward=0.3) == ctl.value  # observe = update, spelled out
    with pytest.raises(ValueError, match="kl_measure"):
        obs.kl("token_sum")


def test_observe_passes_the_reward():
    ctl = DynamicScheduleKLController(1.0, reward_threshold=0.5, decay=0.5)
    assert ctl.observe(KLObservation(token_mean=0.0, sequence_sum=0.0, n_sequences=4, reward=0.6)) == 0.5
    assert ctl.observe(KLObservation(token_mean=0.0, sequence_sum=0.0, n_sequences=4, reward=0.4)) == 0.5
    assert ctl.observe(KLObservation(token_mean=0.0, sequence_sum=0.0, n_sequences=4)) == 0.5  # no reward: hold


def test_dual_beta_floor_is_explicit():
    """beta_min 0 (the config default) would let log beta reach -inf: the controller keeps DUAL_BETA_FLOOR."""
    ctl = DualAscentKLController(1.0, target=0.1, lr=100.0, beta_min=0.0)
    assert ctl.beta_min == DUAL_BETA_FLOOR == 1e-12
    # log beta = 0 + 100 * (0 - 0.1) / 0.1 = -100 -> e^-100 = 3.7e-44 < floor
    assert ctl.update(0.0) == DUAL_BETA_FLOOR
    assert DualAscentKLController(1.0, target=0.1, beta_min=0.25).beta_min == 0.25


def test_adaptive_entropy_controller_by_hand_and_its_state():
    """Skywork-OR1's rule as TRL 1.16 runs it: target 0.5, delta 0.1, bounds [0.05, 0.25], start 0.2."""
    from klgrpo.math.kl_control import ENTROPY_CONTROLLERS

    c = ENTROPY_CONTROLLERS["adaptive"](0.2, entropy_target=0.5, entropy_coef_delta=0.1, entropy_coef_min=0.05,
                                        entropy_coef_max=0.25)
    assert c.applied == 0.0  # nothing observed yet: the last entropy counts as infinite
    steps = [(0.4, 0.25, 0.25), (0.5, 0.25, 0.25), (0.9, 0.15, 0.0), (2.0, 0.05, 0.0), (0.3, 0.15, 0.15)]
    for entropy, value, applied in steps:  # at/below target: +delta up to max; above: -delta down to min
        c.observe(entropy)
        assert (c.value, c.applied) == pytest.approx((value, applied))
    again = ENTROPY_CONTROLLERS["adaptive"](0.2, 0.5, 0.1, 0.05, 0.25)
    again.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert again.state_dict() == c.state_dict() and again.applied == c.applied
    fresh = ENTROPY_CONTROLLERS["adaptive"](0.2, 0.5, 0.1, 0.05, 0.25)
    assert json.loads(json.dumps(fresh.state_dict()))["last_entropy"] is None  # JSON holds no infinity
    fixed = ENTROPY_CONTROLLERS["fixed"](0.3)
    fixed.observe(0.01)
    assert fixed.value == fixed.applied == 0.3
    with pytest.raises(ValueError, match="entropy_coef_min <= entropy_coef_max"):
        ENTROPY_CONTROLLERS["adaptive"](0.2, 0.5, 0.1, 0.3, 0.25)
