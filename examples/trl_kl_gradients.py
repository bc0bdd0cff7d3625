"""What each klgrpo.trl KL setting does to the expected gradient, exactly (no sampling), with verify-kl's problems.

    python examples/trl_kl_gradients.py

For every setting the bridge's KL term is built exactly as ``klgrpo.trl.GRPOTrainer`` builds it (its KLTerm, through
``grpo_objective``; advantages 0, so only the KL term is left; first PPO epoch, pi_old = pi) and its expectation
under pi is differentiated exactly: on ``klgrpo verify-kl``'s categorical (one token, 6 outcomes) and on its
sequence toy (31 sequences, per-sequence sum of the per-token terms). The gradient is compared with the
gradients of the reverse KL(pi||ref) and the forward KL(ref||pi): "reverse"/"forward" means equal within
1e-9 relative, else "neither" with the cosines.
"""

from __future__ import annotations

import torch

from klgrpo.math.aggregation import Normalizer
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import classify_gradient, flat_grad

# (label, KLTerm fields): TRL's default first, then each adaptation method on it, then other weights/estimators
SETTINGS = [
    ("none, k3, in_graph (TRL default)", {}),
    ("clip (threshold 0.3)", {"shaping": "clip", "clip_threshold": 0.3}),
    ("sigmoid (target 0.1)", {"shaping": "sigmoid", "shaping_target": 0.1}),
    ("length_normalized", {"shaping": "length_normalized"}),
    ("none, k3, no weight (use_bias_correction_kl=False)", {"is_correction": "none"}),
    ("none, k3_st, in_graph", {"estimator": "k3_st"}),
    ("none, k3_st, detached", {"estimator": "k3_st", "is_correction": "detached"}),
]


def expected_kl_gradient(logp_BT, ref_logp_BT, mask_BT, prob_B, theta, fields) -> torch.Tensor:
    """d/dtheta of sum_b P(b) * (sum over b's tokens of the bridge's KL term), each row through grpo_objective."""
    kl = KLTerm(**{"coef": 1.0, "estimator": "k3", "placement": "loss", "is_correction": "in_graph", **fields})
    terms = ObjectiveTerms(kl=kl, aggregation="seq_mean_token_sum")
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logp_BT.shape[0]):
        row = slice(b, b + 1)
        inputs = ObjectiveInputs(logp_BT=logp_BT[row], old_logp_BT=logp_BT[row].detach(), ref_logp_BT=ref_logp_BT[row],
                                 advantages_B=torch.zeros(1, dtype=torch.float64), mask_BT=mask_BT[row])
        out = grpo_objective(inputs, terms, Normalizer(1.0, 1.0, 1.0))
        total = total + prob_B[b].detach() * out.loss
    return flat_grad(total, theta)


def categorical_gradient(fields):
    problem = categorical.make_categorical()
    theta = problem.theta()
    b = categorical.batch(problem, theta)
    g = expected_kl_gradient(b["logp_BT"], b["ref_logp_BT"], b["mask_BT"], b["pi_B"], theta, fields)
    kl = categorical.kl_values_and_gradients(problem)
    return classify_gradient(g, kl["grad_reverse"], kl["grad_forward"])


def sequence_gradient(fields):
    problem = sequence_toy.make_toy()
    theta = problem.params()
    toy = sequence_toy.TOY
    logp = toy.logp_BT(theta)
    ref_logp = toy.logp_BT(problem.ref_theta)
    g = expected_kl_gradient(logp, ref_logp, toy.mask_BT, toy.seq_logp(theta).exp(), theta, fields)
    kl = sequence_toy.kl_values_and_gradients(problem)
    return classify_gradient(g, kl["grad_reverse"], kl["grad_forward"])


def main() -> None:
    print(f"| {'setting':<52} | token (categorical)        | sequence (toy, summed)     |")
    print(f"|{'-' * 54}|----------------------------|----------------------------|")
    for label, fields in SETTINGS:
        cells = []
        for check in (categorical_gradient(fields), sequence_gradient(fields)):
            cells.append(f"{check['gradient_target']:<8} cos_rev {check['cosine_reverse']:.4f}")
        print(f"| {label:<52} | {cells[0]:<26} | {cells[1]:<26} |")


if __name__ == "__main__":
    main()
