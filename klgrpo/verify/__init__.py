"""Exact oracles for the KL machinery, shared by ``klgrpo verify-kl`` and the test suite.

Everything is float64 and exact by enumeration; the penalty is the trainer's own loss
(``klgrpo.math.objective.grpo_objective`` with task advantages 0), so the command and the tests check the code
the trainer runs, against the ground truth of docs/kl_math.md.

    penalty      penalty_objective (grpo_objective reduced to its KL penalty), classify_gradient
    categorical  level "token": one draw from K = 6 outcomes; values, per-sample gradients, gradient table
    sequence_toy level "sequence": {a, b, EOS}, length <= 4, 45 parameters, 31 sequences
    montecarlo   sampled estimates land within z* standard errors of the exact answers
    optimum      where exact-gradient ascent ends for each configuration vs pi* = ref exp(R / beta) / Z
    from_run     k1/k2/k3 statistics of a run's dumped log-probs
    report       run_all() -> VerifyReport, and the printed tables
"""

from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, classify_gradient, penalty_objective

__all__ = ["GRADIENT_RTOL", "GradientCheck", "classify_gradient", "penalty_objective"]
