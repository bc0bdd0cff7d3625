"""What the KL part of YOUR loss estimates and which KL its gradient follows, exactly (``verify-kl --loss``).

The loss (typed ``fn(inp: LossInput)`` or datum ``fn(data, logprobs_list, kl_coef=...)``, see
:mod:`klgrpo.core.loss_api`) is called on every outcome of the exact oracles, one sequence per call:

    level     problem                                      sequences
    token     one categorical draw, K = 6 (categorical)    6 one-token sequences
    sequence  the toy sequence model (sequence_toy)        31 sequences of length <= 4

    sampling  samples from      old log-probs
    on_policy  pi               pi (detached)
    off_policy mu               mu (a rollout policy near pi)

Its KL part is isolated by zero advantages and coefficient scaling: with q the sampling distribution,

    V = (E_q[L(c2)] - E_q[L(c1)]) / (c2 - c1)      value of the KL part per unit coefficient
    g = grad V (autograd of the same exact sums: E_q[grad L] is exact because q is detached)
    policy_part = E_q[L(c1)] - c1 V                 what is left at zero advantages (0 for a sound loss)

The verdict reads the token level, as ``kl.placement: loss`` is judged in the built-in table: a per-token KL term
summed over a sequence does not give the gradient of the sequence-level KL (it misses the scores of the earlier
tokens), so at the sequence level every built-in loss-placed estimator is "neither" as well; only the KL in the
reward (reward-to-go) follows the sequence KL there. The sequence rows show the value and how far off it is.

and reported against the exact KL(pi || ref) of the current policy pi:

    value_over_kl    V / KL: 1 = estimates KL, -1 = estimates -KL; value_bias = V - (+-KL), the sign that of V
    gradient_target  reverse | forward | zero | neither: g against grad KL(pi||ref) and grad KL(ref||pi),
                     allowing a positive scale (gradient_scale) for losses that normalise differently

The coefficient is the typed input's ``beta``, or the datum function's keyword argument named in
``COEFFICIENT_NAMES`` (or ``coef_arg``). The typed input aggregates with ``seq_mean_token_sum`` over one expected
sequence (G = 1, tokens E_q[n]): beta times the sequence KL, the textbook objective.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from klgrpo.core.loss_api import COEFFICIENT_NAMES, LossInput, as_typed, call_loss, signature_of
from klgrpo.errors import ConfigError
from klgrpo.math.aggregation import Normalizer
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import GRADIENT_RTOL, classify_gradient

#: The two coefficients of the scaling (any distinct values: the KL part is linear in a sound loss).
COEFFICIENTS = (1.0, 2.0)
#: |value_over_kl -+ 1| below this reads as estimating +-KL (float64 enumeration errors are ~1e-15).
VALUE_RTOL = 1e-9
LEVELS = ("token", "sequence")
SAMPLINGS = ("on_policy", "off_policy")


@dataclass
class CustomLossRow:
    level: str
    sampling: str
    kl: float
    kl_part: float            # V
    value_over_kl: float
    value_bias: float         # V - KL, or V + KL where V < 0 (the bias against the KL it estimates up to sign)
    value_estimates: str      # KL | -KL | neither
    gradient_target: str      # reverse | forward | zero | neither
    gradient_scale: float     # g = scale * grad of the target KL (1 for an exact match; 0 for zero / neither)
    cosine_reverse: float
    cosine_forward: float
    norm_ratio: float         # ||g|| / ||grad KL(pi||ref)||
    policy_part: float


@dataclass
class CustomLossReport:
    loss: str
    signature: str
    coefficient: str
    rows: list[CustomLossRow] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        """Accepted: per token, the KL part's expected gradient follows the reverse KL, on- and off-policy."""
        return all(r.gradient_target == "reverse" for r in self.rows if r.level == "token")

    @property
    def accepted_on_policy(self) -> bool:
        return all(r.gradient_target == "reverse" for r in self.rows
                   if r.level == "token" and r.sampling == "on_policy")

    def as_dict(self) -> dict:
        return {"loss": self.loss, "signature": self.signature, "coefficient": self.coefficient,
                "rows": [asdict(r) for r in self.rows], "accepted": self.accepted,
                "accepted_on_policy": self.accepted_on_policy}


def scaled_loss(fn: Callable, signature: str = "auto", coef_arg: str = "") -> tuple[Callable, str, str]:
    """(coef -> typed loss, signature, coefficient description) for ``fn`` of either signature."""
    signature = signature_of(fn) if signature == "auto" else signature
    if signature == "typed":
        return (lambda coef: fn), "typed", "beta"
    if signature != "datum":
        raise ConfigError(f"unknown loss signature {signature!r}; choose one of: auto, typed, datum")
    params = inspect.signature(fn).parameters
    name = coef_arg or next((n for n in COEFFICIENT_NAMES if n in params), "")
    if coef_arg and coef_arg not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"--coef-arg {coef_arg!r} is not a parameter of {fn.__name__}{inspect.signature(fn)}")
    if not name:  # scale the whole loss, so that V is the loss itself
        return (lambda coef: _times(coef, as_typed(fn))), "datum", "none (the whole loss is taken as its KL part)"
    return (lambda coef: as_typed(functools.partial(fn, **{name: coef}))), "datum", name


def _times(coef: float, typed: Callable) -> Callable:
    def scaled(inp: LossInput):
        loss, metrics = call_loss(typed, inp)
        return coef * loss, metrics
    return scaled


def _rows_at(level: str, sampling: str) -> dict:
    """The oracle's sequences: theta (leaf), log-probs [S, T] of pi (in the graph), ref, old, mask, tokens, q,
    and the exact KLs with their gradients."""
    if level == "token":
        problem = categorical.make_categorical()
        theta = problem.theta()
        b = categorical.batch(problem, theta)
        kls = categorical.kl_values_and_gradients(problem)
        logp, ref, mu, mask = b["logp_BT"], b["ref_logp_BT"], b["mu_logp_BT"], b["mask_BT"]
        tokens = torch.arange(logp.shape[0]).unsqueeze(-1)
    else:
        problem = sequence_toy.make_toy()
        toy = sequence_toy.TOY
        theta = problem.params()
        kls = sequence_toy.kl_values_and_gradients(problem)
        logp, ref, mu, mask = (toy.logp_BT(theta), toy.logp_BT(problem.ref_theta), toy.logp_BT(problem.mu_theta),
                               toy.mask_BT)
        tokens = toy.tokens_BT
    old = logp.detach() if sampling == "on_policy" else mu
    q = old.sum(-1).exp()  # the sampling probability of each sequence (pad log-probs are 0)
    return {"theta": theta, "logp": logp, "ref": ref, "old": old, "mask": mask, "tokens": tokens, "q": q, **kls}


def expected_loss(loss_fn: Callable, rows: dict, beta: float, advantage: float = 0.0) -> Tensor:
    """E_q[L] exactly: sum over every sequence of q (detached) times the loss of that sequence alone.
    ``advantage``: every sequence's advantage (0 isolates the KL part; others show the coefficient scaling
    alone isolates it too)."""
    mask, q = rows["mask"], rows["q"]
    norm = Normalizer(num_sequences=1.0, num_tokens=(q * mask.sum(-1).to(q.dtype)).sum(),
                      max_len=float(mask.shape[-1]))
    total = torch.zeros((), dtype=torch.float64)
    for i in range(mask.shape[0]):
        sl = slice(i, i + 1)
        inp = LossInput(logp=rows["logp"][sl], old_logp=rows["old"][sl], ref_logp=rows["ref"][sl],
                        advantages=torch.full((1,), advantage, dtype=torch.float64), mask=mask[sl], beta=beta,
                        normalizer=norm,
                        aggregation="seq_mean_token_sum", tokens=rows["tokens"][sl])
        loss, _ = call_loss(loss_fn, inp)
        total = total + q[i] * loss.to(torch.float64)
    return total


def check_row(scaled: Callable, level: str, sampling: str, rtol: float = GRADIENT_RTOL,
              advantage: float = 0.0) -> CustomLossRow:
    rows = _rows_at(level, sampling)
    c1, c2 = COEFFICIENTS
    low, high = expected_loss(scaled(c1), rows, c1, advantage), expected_loss(scaled(c2), rows, c2, advantage)
    kl_part = (high - low) / (c2 - c1)
    if not kl_part.requires_grad:
        raise ConfigError("the loss does not depend on the policy's log-probs (no gradient reaches them)")
    (g,) = torch.autograd.grad(kl_part, rows["theta"], retain_graph=True)
    found = _classify_scaled(g.reshape(-1), rows["grad_reverse"], rows["grad_forward"], rtol)
    value, kl = kl_part.item(), rows["reverse"]
    ratio = value / kl
    estimates = "KL" if abs(ratio - 1) <= VALUE_RTOL else "-KL" if abs(ratio + 1) <= VALUE_RTOL else "neither"
    return CustomLossRow(level=level, sampling=sampling, kl=kl, kl_part=value, value_over_kl=ratio,
                         value_bias=value - (kl if value >= 0 else -kl), value_estimates=estimates,
                         policy_part=low.detach().item() - c1 * value,
                         **found)


def _classify_scaled(g: Tensor, rev: Tensor, fwd: Tensor, rtol: float) -> dict:
    """classify_gradient, then: g = c * (grad of a KL) with c > 0 also counts as that KL (scale c)."""
    found = classify_gradient(g, rev, fwd, rtol)
    keep = ("gradient_target", "cosine_reverse", "cosine_forward", "norm_ratio")
    out = {k: found[k] for k in keep}
    out["gradient_scale"] = {"reverse": 1.0, "forward": 1.0}.get(found["gradient_target"], 0.0)
    if found["gradient_target"] == "neither":
        for target, direction in (("reverse", rev.reshape(-1)), ("forward", fwd.reshape(-1))):
            scale = float(torch.dot(g, direction) / torch.dot(direction, direction))
            residual = float((g - scale * direction).norm() / rev.norm())
            if scale > 0 and residual <= rtol * max(1.0, scale):
                out["gradient_target"], out["gradient_scale"] = target, scale
                break
    return out


def verify_custom_loss(fn: Callable, name: str = "", signature: str = "auto", coef_arg: str = "",
                       rtol: float = GRADIENT_RTOL) -> CustomLossReport:
    """Every level x sampling row for ``fn`` (module docstring)."""
    scaled, signature, coefficient = scaled_loss(fn, signature, coef_arg)
    report = CustomLossReport(loss=name or getattr(fn, "__name__", "loss"), signature=signature,
                              coefficient=coefficient)
    for level in LEVELS:
        for sampling in SAMPLINGS:
            report.rows.append(check_row(scaled, level, sampling, rtol))
    return report


def format_custom_report(report: CustomLossReport) -> str:
    head = (f"{'level':<9} {'sampling':<11} {'value/KL':>10} {'estimates':>9} {'bias(+-KL)':>11} {'gradient':<8} "
            f"{'scale':>6} {'cos_rev':>8} {'cos_fwd':>8} {'|g|/|rev|':>9} {'policy_part':>11}")
    lines = [f"Custom loss {report.loss} ({report.signature} signature; KL coefficient: {report.coefficient})",
             "KL part = d loss / d coefficient at zero advantages, exact expectations over every outcome (float64);",
             "value/KL: 1 = estimates KL(pi||ref), -1 = estimates -KL; gradient: which KL the expected gradient "
             "follows", head, "-" * len(head)]
    for r in report.rows:
        lines.append(f"{r.level:<9} {r.sampling:<11} {r.value_over_kl:10.6f} {r.value_estimates:>9} "
                     f"{r.value_bias:11.3e} {r.gradient_target:<8} {r.gradient_scale:6.3f} {r.cosine_reverse:8.4f} "
                     f"{r.cosine_forward:8.4f} {r.norm_ratio:9.2e} {r.policy_part:11.1e}")
    if report.accepted:
        verdict = "ACCEPTED: per token, the KL part's expected gradient is grad KL(pi||ref), on- and off-policy"
    elif report.accepted_on_policy:
        verdict = ("accepted on-policy only (train.num_iterations = 1): per token off-policy, the KL part's "
                   "expected gradient is not grad KL(pi||ref)")
    else:
        on_policy = next(r for r in report.rows if r.level == "token" and r.sampling == "on_policy")
        verdict = (f"REJECTED: per token on-policy, the KL part's expected gradient is {on_policy.gradient_target!r}, "
                   f"not grad KL(pi||ref)")
    lines.append(verdict)
    lines.append("(sequence rows: a per-token term in the loss misses the earlier tokens' scores, so no loss-placed "
                 "estimator follows the sequence KL; the built-in ones are 'neither' there too)")
    return "\n".join(lines)
