"""The settings that make klgrpo reproduce TRL and verl exactly, through the trainer's own objective.

Each row computes the exact expected KL-penalty gradient with the setting switched on in ``grpo_objective`` and
says which KL it follows (reverse = grad KL(pi||ref), forward = grad KL(ref||pi)), against the declaration:

    kl.reward_mode sequence_score  beta * sum_t k(l_mu)_t is subtracted from the sequence's score (verl,
                                   OpenRLHF). Declared: the reward_to_go declaration of the same row, because
                                   E[k_t' s_t | prefix] = 0 for t' < t (the earlier tokens' KL is a baseline for
                                   the later scores), so the two modes have the same expected gradient before
                                   the group normalisation. The oracle does not normalise (a large group's mean
                                   is a baseline, its std would divide beta).
    loss.delta 1.5                 TRL's two-sided clip (eps 0.2 as in training, not the oracle's wide clip).
    loss.dual_clip 3               verl's clip_ratio_c (eps 0.2). Both leave the rows below unchanged: the KL
                                   loss term does not go through the surrogate, and on-policy the ratio is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from klgrpo.math.kl import ESTIMATORS
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, gradient_check

#: The PPO clip of the delta / dual-clip rows: the trainer's default.
TRAINING_EPS = 0.2

SEQUENCE_SCORE_CASES = (("reward", "on_policy"), ("both", "on_policy"), ("reward", "off_policy_detached"))
#: (estimator, placement, sampling) rows whose declaration is a KL, checked with delta / dual clip on.
CLIP_CASES = (("k3", "loss", "off_policy_in_graph"), ("k3_st", "loss", "off_policy_detached"),
              ("k1", "reward", "on_policy"), ("k3", "both", "on_policy"))
SETTINGS = {
    "reward_mode=sequence_score": {"reward_mode": "sequence_score"},
    "delta=1.5": {"delta": 1.5, "eps": TRAINING_EPS},
    "dual_clip=3": {"dual_clip": 3.0, "eps": TRAINING_EPS},
}


@dataclass
class MigrationCheck(GradientCheck):
    setting: str = ""


def _cases(setting: str):
    if setting == "reward_mode=sequence_score":
        return [(name, placement, sampling) for name in ESTIMATORS for placement, sampling in SEQUENCE_SCORE_CASES]
    return [case for case in CLIP_CASES if case[0] in ESTIMATORS]


def migration_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                   rtol: float = GRADIENT_RTOL) -> list[MigrationCheck]:
    kls = {"token": categorical.kl_values_and_gradients(cat), "sequence": sequence_toy.kl_values_and_gradients(toy)}
    rows = []
    for setting, options in SETTINGS.items():
        for name, placement, sampling in _cases(setting):
            for level, module, problem in (("token", categorical, cat), ("sequence", sequence_toy, toy)):
                g = module.expected_gradient(problem, name, placement, sampling, **options)
                declared = ESTIMATORS[name].gradient_target(placement, sampling, level)
                rows.append(gradient_check(g, kls[level], declared, rtol, check=MigrationCheck, setting=setting,
                                           estimator=name, placement=placement, sampling=sampling, level=level))
    return rows
