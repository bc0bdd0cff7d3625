"""Which entropy does the entropy bonus's gradient follow? Exact checks by enumeration (float64).

The bonus (loss.entropy_coef, TRL's entropy_coef) is the exact entropy H_t of pi at each sampled prefix, from
the trainer's blocked pass (math.logprobs.token_logprobs_and_entropy), entering the trainer's ``grpo_objective``
(advantages 0, no KL: the bonus alone), its rows weighted by the sampled sequences' probabilities, detached:

    token level (categorical, K outcomes, one position)
        expected grad of the bonus = grad H(pi), exactly (one prefix: per-position = sequence entropy)
    sequence level (the toy: 45 parameters, 31 sequences)
        value      E_pi[sum_t H_t(y_<t)] = H(pi) of the sequences (chain rule), exactly
        expected   grad of the bonus = E_pi[sum_t grad H_t(y_<t)] = the gradient of the per-position entropy
                   with the prefixes' distribution held fixed; NOT grad H(pi) of the sequences, which adds
                   E_pi[sum_t H_t grad log pi(y_<t)] (the prefixes' score term, missing from any loss term, as
                   for a per-token KL in the loss: verify/full_kl.py); the two parts add up to grad H(pi)

The bonus is a token mean (divided by E[n], a constant): the checks compare E[n] times its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.aggregation import Normalizer
from klgrpo.math.logprobs import token_logprobs_and_entropy
from klgrpo.math.objective import EntropyTerm, KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import flat_grad

#: Equal gradients agree to this relative error (float64 sums of a few hundred terms).
ENTROPY_RTOL = 1e-10
#: "Differs" needs a relative gap at least this large (on the toy the gap is of order 1).
ENTROPY_GAP_MIN = 1e-2


@dataclass
class EntropyCheck:
    """One comparison: the bonus's expected gradient (or a value) against a named target."""

    level: str       # token | sequence
    target: str      # what it is compared with
    expected: str    # equal | differs
    rel_diff: float  # ||ours - target|| / ||target||
    passed: bool


def _entropy(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def bonus_gradient(theta: Tensor, logits_BTV: Tensor, tokens_BT: Tensor, mask_BT: Tensor,
                   weights_B: Tensor) -> Tensor:
    """E[n] times the gradient of the trainer's bonus (grpo_objective with entropy_coef 1 and nothing else),
    its rows weighted by ``weights_B`` (detached): the gradient of sum_i w_i sum_t H_it with the draws fixed."""
    logp, entropy = token_logprobs_and_entropy(logits_BTV, tokens_BT)
    tokens = (weights_B.detach() * mask_BT.to(weights_B.dtype).sum(-1)).sum()
    norm = Normalizer(num_sequences=1.0, num_tokens=tokens, max_len=float(mask_BT.shape[-1]))
    inputs = ObjectiveInputs(logp, logp.detach(), None, torch.zeros(len(weights_B), dtype=logp.dtype), mask_BT,
                             entropy_BT=entropy, row_weights_B=weights_B)
    terms = ObjectiveTerms(kl=KLTerm(coef=0.0), aggregation="token_mean", entropy=EntropyTerm(coef=1.0))
    out = grpo_objective(inputs, terms, norm, metrics=False)
    return -flat_grad(out.loss, theta) * float(tokens)


def _check(level: str, target: str, ours: Tensor, reference: Tensor, expected: str) -> EntropyCheck:
    rel = float((ours - reference).norm() / reference.norm().clamp(min=1e-300))
    ok = rel < ENTROPY_RTOL if expected == "equal" else rel > ENTROPY_GAP_MIN
    return EntropyCheck(level=level, target=target, expected=expected, rel_diff=rel, passed=ok)


def token_rows(problem: categorical.CategoricalProblem) -> list[EntropyCheck]:
    theta = problem.theta()
    k = theta.shape[-1]
    pi = torch.softmax(theta.detach(), -1)
    ours = bonus_gradient(theta, theta.expand(k, 1, k), torch.arange(k).unsqueeze(-1),
                          torch.ones(k, 1, dtype=torch.bool), pi)
    exact = problem.theta()
    return [_check("token", "grad H(pi)", ours, flat_grad(_entropy(exact), exact), "equal")]


def sequence_rows(problem: sequence_toy.ToyProblem) -> list[EntropyCheck]:
    toy = sequence_toy.TOY
    theta = problem.params()
    prob_B = toy.seq_logp(theta).exp()
    ours = bonus_gradient(theta, theta[toy.prefix_BT], toy.tokens_BT, toy.mask_BT, prob_B.detach())

    exact = problem.params()
    seq_logp = toy.seq_logp(exact)
    seq_entropy = -(seq_logp.exp() * seq_logp).sum()
    grad_sequence = flat_grad(seq_entropy, exact)
    h_BT = _entropy(exact[toy.prefix_BT]) * toy.mask_BT
    p_B = seq_logp.exp().detach()
    per_position = (p_B * h_BT.sum(-1)).sum()
    grad_position = flat_grad(per_position, exact, retain_graph=True)
    # the prefixes' score term E[sum_t H_t grad log pi(y_<t)]: log pi(y_<t) = cumulative log-probs before t
    logp_BT = toy.logp_BT(exact)
    prefix_logp_BT = torch.cumsum(logp_BT, -1) - logp_BT
    score_term = flat_grad((p_B.unsqueeze(-1) * h_BT.detach() * prefix_logp_BT).sum(), exact)
    value = per_position.detach().reshape(1)
    return [
        _check("sequence", "E[sum_t H_t] = H(pi) (value)", value, seq_entropy.detach().reshape(1), "equal"),
        _check("sequence", "grad of the per-position entropy", ours, grad_position, "equal"),
        _check("sequence", "grad H(pi) of the sequences", ours, grad_sequence, "differs"),
        _check("sequence", "per-position + prefix score term = grad H(pi)", grad_position + score_term,
               grad_sequence, "equal"),
    ]


def entropy_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem) -> list[EntropyCheck]:
    return token_rows(cat) + sequence_rows(toy)
