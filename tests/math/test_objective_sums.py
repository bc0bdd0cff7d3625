"""What grpo_objective hands the step metrics besides the loss: the policy term's magnitude and the per-token KL."""

import math

import torch

from klgrpo.math.aggregation import Normalizer
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective


def test_policy_abs_and_token_kl_by_hand():
    # On-policy (ratio 1), advantages +1 / -1, two tokens each, token_mean: pg_t = -A, so the policy loss is
    # (-1 - 1 + 1 + 1) / 4 = 0 while the mean |pg_t| is 1.
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.25], [0.5, 0.5]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    terms = ObjectiveTerms(kl=KLTerm(coef=0.1, estimator="k3"), aggregation="token_mean")
    out = grpo_objective(ObjectiveInputs(logp, logp.detach(), ref, adv, mask), terms, Normalizer.of(mask))
    assert float(out.sums.policy_loss) == 0.0
    assert float(out.sums.policy_abs) == 1.0
    l = [math.log(2), 0.0, 0.0, -math.log(2)]  # log(0.5/0.25), log(1), log(1), log(0.25/0.5)
    k3 = [math.exp(-x) + x - 1 for x in l]
    torch.testing.assert_close(out.token_kl, torch.tensor([l, k3], dtype=torch.float64).view(2, 2, 2))
    masked = grpo_objective(ObjectiveInputs(logp, logp.detach(), ref, adv, torch.tensor([[False, True], [True, True]])),
                            terms, Normalizer.of(mask))
    assert float(masked.token_kl[0, 0, 0]) == 0.0 and float(masked.token_kl[1, 0, 0]) == 0.0  # 0 off the mask (l=log 2)
    torch.testing.assert_close(masked.token_kl[:, 1], out.token_kl[:, 1])
    no_ref = grpo_objective(ObjectiveInputs(logp, logp.detach(), None, adv, mask),
                            ObjectiveTerms(kl=KLTerm(), aggregation="token_mean"), Normalizer.of(mask))
    assert no_ref.token_kl is None
