"""GRPO with a KL penalty against a frozen reference, the whole algorithm on one screen.

    python examples/minimal_grpo.py                  # a tiny random Llama learns to write 7s (CPU)
    python examples/minimal_grpo.py --steps 100 --kl-estimator k3 --beta 0.1

One optimizer step:
  1. sample G completions per prompt from the policy                  transformers generate
  2. score each completion                                            a toy reward: the fraction of 7s
  3. advantage = (reward - group mean) / (group std + eps)            klgrpo.math.advantages.group_advantages
  4. log-probs of the completion tokens, policy and frozen reference  klgrpo.math.logprobs.token_logprobs
  5. loss = PPO-clipped surrogate + beta * KL per token, aggregated   klgrpo.math.objective.grpo_objective
  6. AdamW step after gradient clipping; the controller adapts beta   klgrpo.math.kl_control

klgrpo's GRPOTrainer runs this same step (tests/test_minimal_example.py checks that both make the same update)
plus what a real run needs: micro-batches, several updates per batch, LoRA, checkpoints, metrics, processes.
docs/kl_math.md says which KL estimator and placement follow which gradient.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, fields

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from klgrpo.math.advantages import group_advantages
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl_control import build_controller
from klgrpo.math.logprobs import token_logprobs
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective


@dataclass
class Args:
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8             # G
    max_new_tokens: int = 6
    temperature: float = 1.0
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    beta: float = 0.04              # initial KL coefficient
    kl_estimator: str = "k3_st"     # value of k3, gradient of the reverse KL
    controller: str = "adaptive"    # Ziegler et al.: beta follows the KL towards kl_target
    kl_target: float = 0.05
    horizon: float = 1000.0          # Ziegler et al. use ~10000 samples; shorter here, so beta visibly moves
    aggregation: str = "token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.2
    std_eps: float = 1e-4
    seed: int = 0


def toy_reward(completions: list[str]) -> torch.Tensor:
    """The fraction of 7s in each completion (0 for an empty one)."""
    return torch.tensor([c.count("7") / max(len(c), 1) for c in completions])


@dataclass
class Rollout:
    input_ids: torch.Tensor        # [B, P + T] left-padded prompt, then the completion
    attention_mask: torch.Tensor   # [B, P + T] 1 on prompt tokens and on completion tokens through EOS
    completion_ids: torch.Tensor   # [B, T]
    completion_mask: torch.Tensor  # [B, T] 1 through the first EOS
    completions: list[str]


@torch.no_grad()
def sample(policy, tokenizer, prompts: list[str], args: Args) -> Rollout:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids = enc.input_ids.repeat_interleave(args.group_size, dim=0)  # group after group
    prompt_mask = enc.attention_mask.repeat_interleave(args.group_size, dim=0)
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, top_k=0, top_p=1.0,
                          temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completion_ids = out[:, prompt_ids.shape[1]:]
    is_eos = completion_ids == tokenizer.eos_token_id
    completion_mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # no EOS before this position
    completion_ids = torch.where(completion_mask, completion_ids, tokenizer.pad_token_id)
    lengths = completion_mask.sum(-1).tolist()
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths)],
                                   skip_special_tokens=True)
    return Rollout(torch.cat([prompt_ids, completion_ids], 1),
                   torch.cat([prompt_mask, completion_mask.long()], 1), completion_ids, completion_mask, texts)


def completion_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """log model(y_t | prefix) of every completion token, [B, T]: one forward over prompt + completion."""
    t = rollout.completion_ids.shape[1]
    positions = (rollout.attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # skip the left padding
    logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=positions,
                   use_cache=False).logits[:, -t - 1:-1]  # position P-1+t predicts completion token t
    return token_logprobs(logits, rollout.completion_ids, temperature)


def grpo_step(policy, reference, optimizer, controller, rollout, rewards: torch.Tensor, args: Args) -> dict:
    """One on-policy update on a sampled batch; returns what it measured."""
    advantages = group_advantages(rewards, args.group_size, "group", args.std_eps)
    mask = rollout.completion_mask
    with torch.no_grad():
        ref_logp = completion_logprobs(reference, rollout, args.temperature)
    logp = completion_logprobs(policy, rollout, args.temperature)
    kl = KLTerm(coef=controller.value, estimator=args.kl_estimator)  # in the loss, importance weight detached
    normalizer = Normalizer.of(mask, args.max_new_tokens)  # global counts: sequences, tokens, L_max
    # On-policy: pi_old = pi, so old log-probs are the current ones, detached (the PPO ratio is 1, its gradient not).
    policy_term = PolicyTerm(eps_low=args.eps_low, eps_high=args.eps_high)  # PPO's clip
    out = grpo_objective(ObjectiveInputs(logp, logp.detach(), ref_logp, advantages, mask),
                         ObjectiveTerms(kl=kl, aggregation=args.aggregation, policy=policy_term), normalizer)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    optimizer.step()
    beta = controller.value
    kl_token_mean = out.sums.raw_kl.item() / max(mask.sum().item(), 1.0)  # before shaping, per token
    controller.update(kl_token_mean, n_steps=rewards.numel(), reward=rewards.mean().item())
    return {"loss": out.loss.item(), "reward": rewards.mean().item(), "kl": kl_token_mean, "beta": beta,
            "grad_norm": float(grad_norm)}


def make_optimizer(policy, args: Args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)


def tiny_policy(tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config)


def main(args: Args) -> list[dict]:
    from klgrpo.apps.demo.tokenizer import build_char_tokenizer  # one token per character of 0-9 + - =

    tokenizer = build_char_tokenizer()
    policy = tiny_policy(tokenizer, args.seed)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # frozen: the KL anchor
    optimizer = make_optimizer(policy, args)
    controller = build_controller(args.controller, args.beta, target=args.kl_target, horizon=args.horizon)
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    history = []
    for step in range(args.steps):
        batch = [prompts[i] for i in torch.randint(len(prompts), (args.prompts_per_step,)).tolist()]
        rollout = sample(policy, tokenizer, batch, args)
        stats = grpo_step(policy, reference, optimizer, controller, rollout, toy_reward(rollout.completions), args)
        history.append(stats)
        print(f"step {step + 1:3d}  reward {stats['reward']:.3f}  kl {stats['kl']:.5f}  beta {stats['beta']:.4f}  "
              f"e.g. {rollout.completions[0]!r}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    main(Args(**vars(parser.parse_args())))
