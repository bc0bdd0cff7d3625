"""A "GRPO with KL" loss in the datum shape, as it is often written, and what `klgrpo verify-kl --loss` makes of it.

    klgrpo verify-kl --loss examples/custom_losses/grpo_kl_as_written.py:compute_grpo_kl_loss
    klgrpo verify-kl --loss examples/custom_losses/grpo_kl_as_written.py:compute_grpo_kl_loss_sign_flipped
    klgrpo verify-kl --loss examples/custom_losses/grpo_kl_as_written.py:compute_grpo_kl_loss_fixed

compute_grpo_kl_loss: its "KL" term is kl_coef * (log ref - log pi), whose expectation under pi is -KL(pi||ref)
(the wrong sign) and whose expected gradient on-policy is zero (E_pi[grad log pi] = 0): it does not regularise.
Flipping the sign alone fixes the value, not the gradient (compute_grpo_kl_loss_sign_flipped). The fix
(compute_grpo_kl_loss_fixed) changes one line: k3 = exp(-l) + l - 1 of l = log pi - log ref, multiplied by the
importance ratio pi / pi_old that the loss already has IN the graph. E_old[ratio * k3] = E_pi[k3] = KL(pi||ref)
and its gradient is grad KL(pi||ref), on-policy and off-policy.

docs/custom_loss.md shows the output of verify-kl on each.
"""

import torch

cliprange = 0.2


def compute_grpo_kl_loss(data, logprobs_list, kl_coef=0.01):
    total_loss = 0
    for datum, policy_logprobs in zip(data, logprobs_list):
        advantages = datum.loss_fn_inputs["advantages"]
        old_logprobs = datum.loss_fn_inputs["logprobs"]
        ref_logprobs = datum.loss_fn_inputs["ref_logprobs"]
        ratio = torch.exp(policy_logprobs - old_logprobs)
        clipped_ratio = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        ppo_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        kl_loss = kl_coef * (ref_logprobs - policy_logprobs)        # "KL(pi||ref) ~ log ref - log pi"
        total_loss += ppo_loss.sum() + kl_loss.sum()
    metrics = {}  # the original leaves its metrics out
    return total_loss, metrics


def compute_grpo_kl_loss_sign_flipped(data, logprobs_list, kl_coef=0.01):
    """Only the sign flipped: the value estimates KL now, the expected gradient on-policy is still zero."""
    total_loss = 0
    for datum, policy_logprobs in zip(data, logprobs_list):
        advantages = datum.loss_fn_inputs["advantages"]
        old_logprobs = datum.loss_fn_inputs["logprobs"]
        ref_logprobs = datum.loss_fn_inputs["ref_logprobs"]
        ratio = torch.exp(policy_logprobs - old_logprobs)
        clipped_ratio = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        ppo_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        kl_loss = kl_coef * (policy_logprobs - ref_logprobs)
        total_loss += ppo_loss.sum() + kl_loss.sum()
    return total_loss, {}


def compute_grpo_kl_loss_fixed(data, logprobs_list, kl_coef=0.01):
    """The one-line fix: k3 of log pi - log ref times the in-graph ratio pi / pi_old."""
    total_loss = 0
    for datum, policy_logprobs in zip(data, logprobs_list):
        advantages = datum.loss_fn_inputs["advantages"]
        old_logprobs = datum.loss_fn_inputs["logprobs"]
        ref_logprobs = datum.loss_fn_inputs["ref_logprobs"]
        ratio = torch.exp(policy_logprobs - old_logprobs)
        clipped_ratio = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        ppo_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        kl_loss = kl_coef * ratio * (torch.expm1(ref_logprobs - policy_logprobs) - (ref_logprobs - policy_logprobs))
        total_loss += ppo_loss.sum() + kl_loss.sum()
    metrics = {}
    return total_loss, metrics


def grpo_kl_typed(inp):
    """The fixed loss in the trainer's typed signature (klgrpo.core.loss_api.LossInput)."""
    ratio = torch.exp(inp.logp - inp.old_logp)
    advantages = inp.advantages.unsqueeze(-1)
    ppo = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages)
    log_ratio = inp.ref_logp - inp.logp
    kl = ratio * (torch.expm1(log_ratio) - log_ratio)
    return inp.aggregate(ppo + inp.beta * kl), {"kl": inp.aggregate(kl.detach())}
