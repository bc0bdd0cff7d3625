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
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, classify_gradient

PLACEMENTS = ("loss", "both")
CORRECTIONS = ("in_graph", "detached")


def first_epoch_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                     rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    cat = categorical.CategoricalProblem(cat.logits, cat.ref_logits, mu_logits=cat.logits.clone())
    toy = sequence_toy.ToyProblem(toy.theta, toy.ref_theta, mu_theta=toy.theta.clone())
    cat_kl = categorical.kl_values_and_gradients(cat)
    toy_kl = sequence_toy.kl_values_and_gradients(toy)
    rows = []
    for name in ESTIMATORS:
        est = ESTIMATORS[name]
        for placement in PLACEMENTS:
            for correction in CORRECTIONS:
                sampling = f"off_policy_{correction}"
                for level, module, problem, kl in (("token", categorical, cat, cat_kl),
                                                   ("sequence", sequence_toy, toy, toy_kl)):
                    g = module.expected_gradient(problem, name, placement, sampling)
                    found = classify_gradient(g, kl["grad_reverse"], kl["grad_forward"], rtol)
                    if level == "token":
                        declared = est.gradient_target(placement, f"first_epoch_{correction}", "token")
                    elif correction == "detached":
                        declared = est.gradient_target(placement, "on_policy", "sequence")
                    else:
                        declared = "n/a"
                    passed = declared == "n/a" or found["gradient_target"] == declared
                    rows.append(GradientCheck(estimator=name, placement=placement,
                                              sampling=f"first_epoch_{correction}", level=level,
                                              declared=declared, passed=passed, **found))
    return rows
