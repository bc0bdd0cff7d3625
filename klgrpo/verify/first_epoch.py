"""The first PPO epoch: the trainer passes old_logp = logp (pi_old == pi) and still applies ``is_correction``.

The registry's "on_policy" rows mean "no weight". A trainer that always weights the KL term gets, on its
first (often only) epoch, w = pi / pi_old = 1 in value, yet with ``in_graph`` the weight still adds
E_pi[k s] to the gradient: k3 becomes reverse, k3_st and k2 become "neither". These rows rerun the
off-policy samplings with mu = pi exactly:

    token level     the registry's first_epoch_<correction> declarations (checked): the loss rows are the
                    off-policy rows (they hold for every mu, so for mu = pi too), the reward part is on-policy
                    (the reward KL is read at pi_old = pi), "both" is declared per estimator
    sequence level  detached: sg(w) = 1, identical to the on_policy row (checked);
                    in_graph: no declaration ("n/a"), shown for information
"""

from __future__ import annotations

from klgrpo.math.kl import ESTIMATORS
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, gradient_check

PLACEMENTS = ("loss", "both")
CORRECTIONS = ("in_graph", "detached")


def mu_at_pi(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem):
    """The two problems with the rollout policy mu set to pi exactly, as on the first update of a fresh batch."""
    return (categorical.CategoricalProblem(cat.logits, cat.ref_logits, mu_logits=cat.logits.clone()),
            sequence_toy.ToyProblem(toy.theta, toy.ref_theta, mu_theta=toy.theta.clone()))


def declared_first_epoch(name: str, placement: str, correction: str, level: str) -> str | None:
    """The declaration a first-epoch row is checked against (None: none, shown for information)."""
    if level == "token":
        return ESTIMATORS[name].gradient_target(placement, f"first_epoch_{correction}", "token")
    if correction == "detached":  # sg(w) = 1: the on-policy row
        return ESTIMATORS[name].gradient_target(placement, "on_policy", "sequence")
    return None


def first_epoch_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                     rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    cat, toy = mu_at_pi(cat, toy)
    levels = (("token", categorical, cat, categorical.kl_values_and_gradients(cat)),
              ("sequence", sequence_toy, toy, sequence_toy.kl_values_and_gradients(toy)))
    rows = []
    for name in ESTIMATORS:
        for placement in PLACEMENTS:
            for correction in CORRECTIONS:
                for level, module, problem, kl in levels:
                    g = module.expected_gradient(problem, name, placement, f"off_policy_{correction}")
                    rows.append(gradient_check(g, kl, declared_first_epoch(name, placement, correction, level), rtol,
                                               estimator=name, placement=placement,
                                               sampling=f"first_epoch_{correction}", level=level))
    return rows
