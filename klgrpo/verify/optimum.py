"""Where exact-gradient ascent ends for each KL configuration on the sequence toy (docs/kl_math.md,
"Aggregation and length").

Objective ascended: E_pi[R] - beta * penalty, R = 0.5 per 'a' token, beta = 0.5, pi_ref uniform in every row
(logits 0). The penalty gradient is the exact expected gradient of the penalty as the library builds it
(:func:`klgrpo.verify.sequence_toy.penalty_at`, on-policy, with the configuration's aggregation). The task
gradient is either exact (autograd of sum_seq P(seq) R(seq): only the KL term feels the aggregation), or, for the
"(PG too)" rows, the policy-gradient term as the trainer builds it: advantages R - E_pi[R] (the group-mean
baseline of a large group, no std scaling) through ``clipped_surrogate``, aggregated with the same mode as
the KL term. The regularised optimum is

    pi*(seq) = pi_ref(seq) exp(R(seq) / beta) / Z

and a configuration whose penalty gradient is beta * grad KL(pi||ref) of the sequence converges to it; the
others stop at a different stationary point. Adam (lr 0.1) from pi = pi_ref runs until the gradient norm is
below 1e-8 or ``max_steps``; the final gradient norm is reported so an unconverged run is visible.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.kl import ESTIMATORS
from klgrpo.math.policy_loss import clipped_surrogate
from klgrpo.verify.penalty import WIDE_CLIP
from klgrpo.verify.sequence_toy import TOY, penalty_at, sequence_kls

REWARD_PER_A = 0.5
BETA = 0.5
LR = 0.1
MAX_STEPS = 3000
GRAD_TOL = 1e-8
#: A configuration declared exact must end within this total variation of pi*.
EXACT_TV = 1e-6


@dataclass(frozen=True)
class OptimumConfig:
    label: str
    estimator: str
    placement: str
    aggregation: str
    pg_aggregated: bool = False   # the policy-gradient term goes through the same aggregation (trainer-like)


OPTIMUM_CONFIGS = (
    OptimumConfig("k1 in reward", "k1", "reward", "seq_mean_token_sum"),
    OptimumConfig("k3 in reward and loss", "k3", "both", "seq_mean_token_sum"),
    OptimumConfig("k2 loss, token sum", "k2", "loss", "seq_mean_token_sum"),
    OptimumConfig("k3 loss, token sum", "k3", "loss", "seq_mean_token_sum"),
    OptimumConfig("k3_st loss, token sum", "k3_st", "loss", "seq_mean_token_sum"),
    OptimumConfig("k3 loss, seq_mean_token_mean", "k3", "loss", "seq_mean_token_mean"),
    OptimumConfig("k3 loss, token_mean", "k3", "loss", "token_mean"),
    OptimumConfig("k3 loss, constant (L_max 4)", "k3", "loss", "constant"),
    OptimumConfig("k1 in reward, token_mean (PG too)", "k1", "reward", "token_mean", True),
    OptimumConfig("k3_st loss, token_mean (PG too)", "k3_st", "loss", "token_mean", True),
    OptimumConfig("k3 loss, token_mean (PG too)", "k3", "loss", "token_mean", True),
    OptimumConfig("k3 loss, seq_mean_token_mean (PG too)", "k3", "loss", "seq_mean_token_mean", True),
)


@dataclass(frozen=True, kw_only=True)
class OptimumResult(OptimumConfig):
    """A configuration and where its ascent ended."""

    tv_to_optimum: float       # 0.5 sum_seq |P(seq) - pi*(seq)|
    mean_length: float         # E_pi[len], EOS counted as a token
    kl: float                  # sequence KL(pi || ref)
    expected_reward: float
    steps: int
    grad_norm: float           # of the ascended field at the end (convergence)
    expected_exact: bool       # the sequence-level table declares the gradient exact (reverse, token sum)
    passed: bool


def reference_theta() -> torch.Tensor:
    return torch.zeros(len(TOY.prefixes), 3, dtype=torch.float64)


def optimal_policy(ref_theta: torch.Tensor | None = None, beta: float = BETA,
                   reward_per_a: float = REWARD_PER_A) -> torch.Tensor:
    """pi*(seq) over the 31 sequences, exactly."""
    ref_theta = reference_theta() if ref_theta is None else ref_theta
    return torch.softmax(TOY.seq_logp(ref_theta) + reward_per_a * TOY.num_a_B / beta, dim=0)


def summarise(theta: torch.Tensor, ref_theta: torch.Tensor, reward_per_a: float = REWARD_PER_A,
              beta: float = BETA) -> dict:
    with torch.no_grad():
        prob = TOY.seq_logp(theta).exp()
        kl, _ = sequence_kls(theta, ref_theta)
        return {
            "tv_to_optimum": 0.5 * float((prob - optimal_policy(ref_theta, beta, reward_per_a)).abs().sum()),
            "mean_length": float((prob * TOY.lengths_B).sum()),
            "kl": float(kl),
            "expected_reward": float((prob * reward_per_a * TOY.num_a_B).sum()),
        }


def task_objective(theta: torch.Tensor, rewards_B: torch.Tensor, aggregation: str | None) -> torch.Tensor:
    """A scalar whose gradient is the task (reward) gradient: exact when ``aggregation`` is None, else the
    policy-gradient term as the trainer builds it (advantage R - E_pi[R], ratio from clipped_surrogate)."""
    if aggregation is None:
        return (TOY.seq_logp(theta).exp() * rewards_B).sum()
    logp_BT = TOY.logp_BT(theta)
    prob_B = logp_BT.sum(-1).exp().detach()
    advantages_B = rewards_B - (prob_B * rewards_B).sum()
    pg_BT = clipped_surrogate(logp_BT, logp_BT.detach(), advantages_B, WIDE_CLIP, WIDE_CLIP).loss_BT
    norm = Normalizer(num_sequences=1.0, num_tokens=(prob_B * TOY.lengths_B).sum(), max_len=float(TOY.max_len))
    return -aggregate(pg_BT * prob_B.unsqueeze(-1), TOY.mask_BT, aggregation, norm)


def ascend(config: OptimumConfig, beta: float = BETA, reward_per_a: float = REWARD_PER_A,
           max_steps: int = MAX_STEPS, lr: float = LR) -> OptimumResult:
    ref_theta = reference_theta()
    theta = ref_theta.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    rewards = reward_per_a * TOY.num_a_B
    grad_norm, steps = float("inf"), 0
    while steps < max_steps:
        task = task_objective(theta, rewards, config.aggregation if config.pg_aggregated else None)
        objective = task - beta * penalty_at(theta, ref_theta, config.estimator, config.placement,
                                             aggregation=config.aggregation)
        (g,) = torch.autograd.grad(objective, theta)
        grad_norm = float(g.norm())
        if grad_norm < GRAD_TOL:
            break
        theta.grad = -g  # Adam minimises
        opt.step()
        steps += 1
    summary = summarise(theta.detach(), ref_theta, reward_per_a, beta)
    declared = ESTIMATORS[config.estimator].gradient_target(config.placement, "on_policy", "sequence")
    # Exact: the sequence table declares the gradient reverse (token sum), and the aggregation is the token
    # sum, or a batch-level constant (token_mean, constant) applied to the policy-gradient term as well.
    same_scale = config.aggregation == "seq_mean_token_sum" or (
        config.pg_aggregated and config.aggregation in ("token_mean", "constant"))
    exact = same_scale and declared == "reverse"
    converged = grad_norm < 1e-6
    reached = summary["tv_to_optimum"] < EXACT_TV
    return OptimumResult(**asdict(config), steps=steps, grad_norm=grad_norm, expected_exact=exact,
                         passed=converged and reached == exact, **summary)


def run_optimum(configs=OPTIMUM_CONFIGS, **kwargs) -> list[OptimumResult]:
    return [ascend(c, **kwargs) for c in configs if c.estimator in ESTIMATORS]
