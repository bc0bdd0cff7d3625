"""kl.estimator full in the trainer, on the tiny local model: it trains, and its KL term (value and gradient)
equals exact_kl of the policy's and the reference's logits computed naively (full log-softmax, autograd)."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.core.forward import position_ids_from_mask
from klgrpo.errors import ConfigError
from klgrpo.math.kl import exact_kl
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

BETA = 0.5


def _completion_logits(model, batch):
    t = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False)
    return out.logits[:, -t - 1:-1]


def test_full_kl_trains_two_steps(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "f", kl={"coef": BETA, "estimator": "full"},
                      train={"steps": 2, "num_iterations": 2, "micro_batch_size": 8})
    summary = GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "f") if "train/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    assert summary["kl_estimator"] == "full" and summary["final_kl"] >= 0


def test_trainer_kl_term_is_the_exact_kl_of_the_logits(tiny_model_dir, addition_file, tmp_path):
    temperature = 0.8
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "e", kl={"coef": BETA, "estimator": "full"},
                      rollout={"temperature": temperature}, train={"steps": 2, "micro_batch_size": 8})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()  # the policy moves away from the reference: a non-zero KL
    batch = trainer.make_batch()
    batch.advantages = torch.zeros_like(batch.advantages)  # only the KL term is left in the loss
    trainer.model.zero_grad(set_to_none=True)
    sums = trainer.grpo_step.accumulate_gradients(batch)[0].objective
    got_grads = [p.grad.clone() for p in trainer.model.parameters()]

    trainer.model.zero_grad(set_to_none=True)
    mask = batch.loss_mask.to(torch.float64)
    with torch.no_grad():
        ref_logits = _completion_logits(trainer.reference.model, batch.rollout).double() / temperature
    logits = _completion_logits(trainer.model, batch.rollout).double() / temperature
    kl_BT = exact_kl(logits, ref_logits)
    want_loss = BETA * (kl_BT * mask).sum() / mask.sum()  # token_mean over the batch
    want_loss.backward()

    assert float((kl_BT.detach() * mask).sum()) > 1e-4
    torch.testing.assert_close(sums.raw_kl.double(), (kl_BT * mask).sum(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sums.loss_kl_penalty.double(), want_loss.detach(), rtol=1e-4, atol=1e-7)
    for got, p in zip(got_grads, trainer.model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-3, atol=1e-6)


def test_a_reference_whose_head_does_not_give_its_logprobs_is_refused(tiny_model_dir, addition_file, tmp_path):
    """A logit transform after the output layer (here: the reference's log-probs scaled) fails the check."""
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "c", kl={"coef": BETA, "estimator": "full"},
                      train={"steps": 1})
    trainer = GRPOTrainer(cfg, log=quiet)
    batch = trainer.make_batch()
    batch.ref_logp = 1.5 * batch.ref_logp
    with pytest.raises(ConfigError, match="kl.estimator=full: the reference's output layer"):
        trainer.grpo_step.accumulate_gradients(batch)


@pytest.mark.parametrize("groups,field", [
    ({"kl": {"estimator": "full", "placement": "reward"}}, "kl.placement"),
    ({"kl": {"estimator": "full", "placement": "both"}}, "kl.placement"),
    ({"kl": {"estimator": "full"}, "loss": {"function": "my_loss.py:loss"}}, "loss.function"),
])
def test_full_kl_outside_the_loss_is_refused_in_one_line(tiny_model_dir, addition_file, tmp_path, groups, field):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path, **groups)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_full_kl_with_lora_reads_the_adapter_disabled_reference(tiny_model_dir, addition_file, tmp_path):
    """LoRA: the reference is the policy with its adapter off (then, after a sync, the reference adapter)."""
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "l", model={"lora": {"r": 4, "alpha": 8.0}},
                      kl={"coef": BETA, "estimator": "full", "sync_every": 1}, optim={"lr": 5e-2},
                      train={"steps": 1})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()  # one step, then the sync: the reference adapter exists and equals the policy's
    assert trainer.reference.synced
    trainer.model.train()
    trainer.grpo_step.update(trainer.make_batch())  # one more update without a sync: the policy moves away
    batch = trainer.make_batch()
    sums = trainer.grpo_step.accumulate_gradients(batch)[0].objective
    with torch.no_grad():
        with trainer.reference.sampling_model() as model:
            ref_logits = _completion_logits(model, batch.rollout).double()
        logits = _completion_logits(trainer.model, batch.rollout).double()
    mask = batch.loss_mask.to(torch.float64)
    want = (exact_kl(logits, ref_logits) * mask).sum()
    assert float(want) > 1e-6
    torch.testing.assert_close(sums.raw_kl.double(), want, rtol=1e-4, atol=1e-6)
