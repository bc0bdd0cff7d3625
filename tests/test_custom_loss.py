"""Custom losses: the trainer's typed hook (loss.function / loss_fn=), the datum shape on a local model
(klgrpo.custom), and verify-kl --loss on the exact oracles (the example file's losses, planted bugs, the
built-in objective under every policy loss)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from klgrpo.core.loss_api import LossInput, as_typed, load_loss_function, signature_of
from klgrpo.errors import ConfigError, DataError
from klgrpo.math.kl import ESTIMATORS
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective
from klgrpo.math.policy_loss import POLICY_LOSSES
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.verify.custom_loss import verify_custom_loss
from tests.helpers.configs import make_config, quiet

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_losses" / "grpo_kl_as_written.py"


def _example(name: str):
    return load_loss_function(f"{EXAMPLE}:{name}")


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.fixture()
def trainer64(tiny_model_dir, addition_file, tmp_path):
    """A float64 trainer, one generated batch, and the policy moved off the reference (non-zero KL). The
    transformers forward everywhere (model.fast_path off), so that every micro-batch size and the datum forward
    run the same float64 code."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", model={"fast_path": False})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    trainer = GRPOTrainer(cfg, model=model, log=quiet)
    torch.manual_seed(0)
    batch = trainer.make_batch()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return trainer, batch


def _replan(trainer, **changes) -> None:
    """The step's plan with ``changes`` (its config is read-only once validated; the step reads only the plan)."""
    step = trainer.grpo_step
    step.plan = replace(step.plan, **changes)


def _accumulate(trainer, batch, loss_fn=None, micro=0):
    trainer.model.zero_grad(set_to_none=True)
    trainer.grpo_step.loss_fn = loss_fn
    _replan(trainer, micro_batch_size=micro)
    sums = trainer.grpo_step.accumulate_gradients(batch)[0]
    return _grads(trainer.model), sums


# ---------------------------------------------------------------------------------------------- trainer
def test_typed_loss_that_rebuilds_the_builtin_objective_gives_its_gradient(trainer64):
    trainer, batch = trainer64
    kl = trainer.grpo_step.kl_term()

    def rebuilt(inp: LossInput):
        out = grpo_objective(ObjectiveInputs(inp.logp, inp.old_logp, inp.ref_logp, inp.advantages, inp.mask),
                             ObjectiveTerms(kl=KLTerm(coef=inp.beta, estimator=kl.estimator),
                                            aggregation=inp.aggregation), inp.normalizer)
        return out.loss, {}

    builtin, sums_builtin = _accumulate(trainer, batch)
    custom, sums_custom = _accumulate(trainer, batch, rebuilt)
    assert builtin.abs().max() > 0
    torch.testing.assert_close(custom, builtin, rtol=1e-12, atol=1e-15)
    assert float(sums_custom.loss) == pytest.approx(float(sums_builtin.loss), rel=1e-12)


def test_normalised_custom_loss_is_micro_batch_invariant(trainer64):
    """micro_batch_size 1 and the whole batch give the same gradient when the loss reduces with inp.aggregate;
    a loss that averages over its micro-batch does not (the test can fail)."""
    trainer, batch = trainer64
    typed = _example("grpo_kl_typed")
    full, _ = _accumulate(trainer, batch, typed, micro=0)
    single, _ = _accumulate(trainer, batch, typed, micro=1)
    torch.testing.assert_close(single, full, rtol=1e-10, atol=1e-13)

    def local_mean(inp: LossInput):
        return (-(inp.advantages[:, None] * inp.logp) * inp.mask).sum() / inp.mask.sum(), {}

    full, _ = _accumulate(trainer, batch, local_mean, micro=0)
    single, _ = _accumulate(trainer, batch, local_mean, micro=1)
    assert (single - full).abs().max() > 1e-6 * full.abs().max()


def test_datum_signature_runs_in_the_trainer(trainer64):
    """A datum-shaped loss through as_typed: sum over every datum's tokens = seq_mean_token_sum x G."""
    trainer, batch = trainer64
    _replan(trainer, aggregation="seq_mean_token_sum")
    datum, _ = _accumulate(trainer, batch, as_typed(_example("compute_grpo_kl_loss_fixed")))
    typed, _ = _accumulate(trainer, batch, lambda inp: _example("grpo_kl_typed")(
        LossInput(inp.logp, inp.old_logp, inp.ref_logp, inp.advantages, inp.mask, 0.01, inp.normalizer,
                  inp.aggregation)))
    torch.testing.assert_close(datum, typed * batch.normalizer.num_sequences, rtol=1e-10, atol=1e-13)


def test_loss_function_from_config_logs_its_metrics_averaged(tiny_model_dir, addition_file, tmp_path):
    loss_file = tmp_path / "my_loss.py"
    loss_file.write_text(
        "def loss(inp):\n"
        "    pg = -(inp.advantages[:, None] * inp.logp)\n"
        "    return inp.aggregate(pg), {'rows': inp.mask.shape[0], 'three': 3.0}\n")
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 1, "micro_batch_size": 4},
                      loss={"function": f"{loss_file}:loss"})
    GRPOTrainer(cfg, log=quiet).train()
    row = next(r for r in read_metrics(tmp_path / "run") if "train/loss" in r)
    assert row["custom/rows"] == 4.0 and row["custom/three"] == 3.0  # 16 rows in 4 micro-batches of 4


def test_datum_loss_from_config_receives_the_controllers_beta(tiny_model_dir, addition_file, tmp_path):
    """A datum-shaped loss.function gets the step's beta as its kl_coef (not its own default 0.01): kl.coef at the
    first step, then the adaptive controller's value, which moves; it logs what it received as a metric."""
    loss_file = tmp_path / "datum_loss.py"
    loss_file.write_text(
        "import torch\n"
        "def loss(data, logprobs_list, kl_coef=0.01):\n"
        "    total = sum(-(d.loss_fn_inputs['advantages'] * lp).sum() for d, lp in zip(data, logprobs_list))\n"
        "    return total, {'kl_coef': kl_coef}\n")
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 3},
                      kl={"coef": 0.3, "controller": "adaptive", "target": 1e-6, "horizon": 10.0},
                      loss={"function": f"{loss_file}:loss"})
    trainer = GRPOTrainer(cfg, log=quiet)
    betas = []
    for _ in range(3):
        betas.append(trainer.controller.value)
        metrics = trainer.train_step()
        assert metrics["custom/kl_coef"] == pytest.approx(betas[-1], rel=1e-6)
        assert metrics["adaptive_kl/current_beta"] == pytest.approx(betas[-1], rel=1e-6)
    assert betas[0] == 0.3 and betas[2] != pytest.approx(0.3, rel=1e-3)  # the controller moved beta


def test_datum_loss_without_a_coefficient_is_named_in_a_warning(tiny_model_dir, addition_file, tmp_path):
    from klgrpo.errors import KLGRPOWarning

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run")
    with pytest.warns(KLGRPOWarning, match="takes no KL-coefficient keyword .*kl.coef and the controller's beta"):
        GRPOTrainer(cfg, loss_fn=lambda data, logprobs_list: (logprobs_list[0].sum(), {}), log=quiet)


def test_loss_function_errors_name_the_fix(tiny_model_dir, addition_file, tmp_path):
    with pytest.raises(ConfigError, match=r"loss.function 'nowhere.py:f': file nowhere.py not found"):
        load_loss_function("nowhere.py:f")
    with pytest.raises(ConfigError, match="has no attribute 'missing'.*compute_grpo_kl_loss"):
        load_loss_function(f"{EXAMPLE}:missing")
    with pytest.raises(ConfigError, match="takes 3 required arguments"):
        signature_of(lambda a, b, c: None)
    assert signature_of(lambda inp: None) == "typed"
    assert signature_of(_example("compute_grpo_kl_loss")) == "datum"
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", loss={"function": f"{EXAMPLE}:grpo_kl_typed"})
    with pytest.raises(ConfigError, match="both loss.function=.* and GRPOTrainer\\(loss_fn=...\\)"):
        GRPOTrainer(cfg, loss_fn=lambda inp: None, log=quiet)


def test_loss_returning_a_vector_is_one_clear_error(trainer64):
    trainer, batch = trainer64
    with pytest.raises(ConfigError, match=r"must return \(loss, metrics\) with loss a scalar tensor"):
        _accumulate(trainer, batch, lambda inp: (inp.logp.sum(-1), {}))


# ------------------------------------------------------------------------------------------ datum shape
def test_issue_loss_runs_unchanged_on_a_local_model(trainer64):
    """forward_backward_custom with the example's compute_grpo_kl_loss: its log-probs are the trainer's, and the
    gradient is that of the same formula written over the padded batch."""
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.custom import datum_logprobs, datums_from_batch, forward_backward_custom

    trainer, batch = trainer64
    model = trainer.model
    data = datums_from_batch(model, batch)
    assert len(data) == batch.rollout.size
    assert set(data[0].loss_fn_inputs) == {"target_tokens", "advantages", "logprobs", "ref_logprobs", "mask"}
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        logp_all, _ = completion_logprobs(model, batch.rollout, 1.0, fast_path=False)
        for i, lp in enumerate(datum_logprobs(model, data)):
            torch.testing.assert_close(lp, logp_all[i][mask[i]], rtol=0, atol=1e-10)

    model.zero_grad(set_to_none=True)
    loss, metrics = forward_backward_custom(model, data, _example("compute_grpo_kl_loss"))
    assert metrics == {}
    got = _grads(model)

    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, batch.rollout, 1.0, fast_path=False)
    old = logp_all  # the batch had no update yet: the sampling log-probs are the model's now
    ratio = torch.exp(logp - old)
    adv = batch.advantages[:, None]
    ppo = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    want_loss = ((ppo + 0.01 * (batch.ref_logp - logp)) * mask).sum()
    want_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-10)
    torch.testing.assert_close(got, _grads(model), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss_fn, config, eps", [
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, (0.2, 0.2)),
    ("ppo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.005}, (0.01, 0.005)),  # clips some tokens
    ("ppo_kl", {}, (0.2, 0.2)),
    ("ppo_kl", {"kl_estimator": "k3", "kl_is_correction": "in_graph", "kl_coef": 0.3,
                "clip_low_threshold": 0.99, "clip_high_threshold": 1.005}, (0.01, 0.005)),
])
def test_builtin_datum_losses_equal_the_trainers_objective(trainer64, loss_fn, config, eps):
    """forward_backward(data, loss_fn=..., loss_fn_config=...) on the batch's datums: the trainer's own objective
    (aggregation seq_mean_token_sum) times the number of datums, in value and gradient (float64). Off-policy: the
    sampling log-probs are the current ones plus noise, so ratios differ from 1 and the clip acts."""
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.custom import datums_from_batch, forward_backward

    trainer, batch = trainer64
    with torch.no_grad():
        logp, _ = completion_logprobs(trainer.model, batch.rollout, 1.0)
    gen = torch.Generator().manual_seed(3)
    batch.old_logp = logp + 0.02 * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    plan = trainer.grpo_step.plan
    _replan(trainer, aggregation="seq_mean_token_sum", policy=replace(plan.policy, eps_low=eps[0], eps_high=eps[1]))
    if loss_fn == "ppo":
        trainer.controller.value = 0.0  # the trainer's objective without its KL term
    else:
        trainer.controller.value = config.get("kl_coef", 0.04)
        _replan(trainer, kl=replace(plan.kl, estimator=config.get("kl_estimator", "k3_st"),
                                    is_correction=config.get("kl_is_correction", "detached")))
    builtin, sums = _accumulate(trainer, batch)
    data = datums_from_batch(trainer.model, batch)
    trainer.model.zero_grad(set_to_none=True)
    loss, metrics = forward_backward(trainer.model, data, loss_fn=loss_fn, loss_fn_config=config)
    n = batch.normalizer.num_sequences
    assert float(loss) == pytest.approx(float(sums.loss) * n, rel=1e-10)
    torch.testing.assert_close(_grads(trainer.model), builtin * n, rtol=1e-9, atol=1e-12)
    clipped = float(sums.objective.clip_low + sums.objective.clip_high) / float(batch.loss_mask.sum())
    assert float(metrics["clip_fraction"]) == pytest.approx(clipped, rel=1e-6)  # counts summed in float32
    if eps[1] < 0.1:
        assert clipped > 0  # the narrow range really clips: the clip branch is compared too
    if loss_fn == "ppo_kl":
        assert float(metrics["kl"]) > 0


def test_builtin_loss_errors_name_the_fix(trainer64):
    from klgrpo.custom import builtin_loss, forward_backward

    with pytest.raises(ConfigError, match="unknown loss_fn 'dro'; the built-in losses are ppo, ppo_kl"):
        builtin_loss("dro")
    with pytest.raises(ConfigError, match="key 'kl_coef' is not a setting of loss_fn 'ppo'"):
        builtin_loss("ppo", {"kl_coef": 0.1})
    with pytest.raises(ConfigError, match="0 <= clip_low_threshold <= 1 <= clip_high_threshold"):
        builtin_loss("ppo", {"clip_low_threshold": 1.2})
    with pytest.raises(ConfigError, match="loss_fn_config configures a built-in"):
        forward_backward(trainer64[0].model, [], lambda d, l: None, {"x": 1})


def test_datums_name_what_is_wrong(trainer64):
    from klgrpo.custom import Datum, datums_from_batch, forward_backward_custom

    trainer, batch = trainer64
    bad = Datum(model_input=torch.tensor([1, 2, 3]), loss_fn_inputs={"target_tokens": torch.tensor([2, 9])})
    with pytest.raises(DataError, match="datum 0: target_tokens must be the last 2 tokens of model_input"):
        forward_backward_custom(trainer.model, [bad], _example("compute_grpo_kl_loss"))
    batch.ref_logp = None
    with pytest.raises(DataError, match="no reference log-probs"):
        datums_from_batch(trainer.model, batch)


def _prompt_weighted_loss(data, logprobs_list):
    """A datum loss that reads every part of a datum: the prompt's length (from model_input), the targets, the
    sampling and reference log-probs; per-datum means, so an empty datum would make the loss NaN."""
    total = torch.zeros((), dtype=torch.float64)
    for datum, logprobs in zip(data, logprobs_list):
        inputs = datum.loss_fn_inputs
        prompt_len = len(datum.model_input) - len(inputs["target_tokens"])
        ratio = torch.exp(logprobs - inputs["logprobs"])
        total = total - prompt_len * (ratio * inputs["advantages"]).mean() \
            + 0.01 * (logprobs - inputs["ref_logprobs"]).mean()
    return total, {"datums": float(len(data))}


def test_one_datum_loss_gives_the_same_loss_and_gradient_on_both_routes(trainer64):
    """The trainer's datum route (loss.function -> as_typed) and klgrpo.custom's (datums_from_batch +
    forward_backward_custom) build the same datums, prompt included, and both skip the rows with no loss token."""
    from klgrpo.core.loss_api import datums_from_input
    from klgrpo.custom import datums_from_batch, forward_backward_custom

    trainer, batch = trainer64
    empty = [1, 6]
    batch.loss_mask[empty] = False  # e.g. rollout.mask_truncated: whole rows out of the loss
    n_rows = batch.rollout.size - len(empty)

    grads_trainer, sums = _accumulate(trainer, batch, as_typed(_prompt_weighted_loss))
    model = trainer.model
    model.zero_grad(set_to_none=True)
    data = datums_from_batch(model, batch)
    loss, metrics = forward_backward_custom(model, data, _prompt_weighted_loss)
    grads_custom = _grads(model)

    assert len(data) == n_rows and metrics == {"datums": float(n_rows)}
    assert float(sums.custom["datums"]) == n_rows
    assert math.isfinite(float(loss.detach())) and abs(float(loss.detach())) > 1e-3
    assert float(sums.loss) == pytest.approx(float(loss.detach()), rel=1e-10)
    torch.testing.assert_close(grads_trainer, grads_custom, rtol=1e-9, atol=1e-12)
    # the datums themselves: the same prompt + completion on both routes
    rollout, prompt = batch.rollout, slice(0, batch.rollout.prompt_len)
    typed_data, _ = datums_from_input(LossInput(
        batch.ref_logp, batch.ref_logp, batch.ref_logp, batch.advantages, batch.loss_mask, 0.0, batch.normalizer,
        tokens=rollout.completion_ids, prompt_ids=rollout.input_ids[:, prompt],
        prompt_mask=rollout.attention_mask[:, prompt]))
    assert [d.model_input.tolist() for d in typed_data] == [d.model_input.tolist() for d in data]
    assert all(len(d.model_input) > len(d.loss_fn_inputs["target_tokens"]) for d in data)


# -------------------------------------------------------------------------------------- verify-kl --loss
def _rows(report):
    return {(r.level, r.sampling): r for r in report.rows}


def test_issue_loss_estimates_minus_kl_with_zero_gradient_on_policy():
    rows = _rows(verify_custom_loss(_example("compute_grpo_kl_loss")))
    for level in ("token", "sequence"):
        r = rows[(level, "on_policy")]
        assert r.value_over_kl == pytest.approx(-1.0, abs=1e-12)
        assert r.value_estimates == "-KL" and abs(r.value_bias) < 1e-12
        assert r.gradient_target == "zero" and r.norm_ratio < 1e-12
        assert r.policy_part == 0.0  # zero advantages: the PPO part is exactly zero
    assert rows[("token", "off_policy")].gradient_target == "neither"


def test_sign_flip_alone_fixes_the_value_not_the_gradient():
    rows = _rows(verify_custom_loss(_example("compute_grpo_kl_loss_sign_flipped")))
    r = rows[("token", "on_policy")]
    assert r.value_over_kl == pytest.approx(1.0, abs=1e-12) and r.gradient_target == "zero"


def test_the_fix_is_accepted_and_typed_and_datum_agree():
    datum = verify_custom_loss(_example("compute_grpo_kl_loss_fixed"))
    typed = verify_custom_loss(_example("grpo_kl_typed"))
    assert datum.accepted and typed.accepted and datum.signature == "datum" and typed.signature == "typed"
    assert datum.coefficient == "kl_coef" and typed.coefficient == "beta"
    for r in (x for x in datum.rows if x.level == "token"):
        assert r.gradient_target == "reverse" and r.gradient_scale == 1.0
        assert r.value_over_kl == pytest.approx(1.0, abs=1e-12)
    for a, b in zip(datum.rows, typed.rows):
        assert (a.gradient_target, a.value_estimates) == (b.gradient_target, b.value_estimates)
        assert a.value_over_kl == pytest.approx(b.value_over_kl, rel=1e-12)


def test_planted_losses_are_classified():
    """k1 with the in-graph ratio: accepted; k3 without the weight: forward KL; k2: reverse gradient with a
    biased value; a loss without a coefficient
    argument: the whole loss is the KL part; a scaled reverse gradient (mean over tokens) is reverse with that
    scale."""
    def k3_plain(data, logprobs_list, beta=0.1):
        total = 0
        for d, lp in zip(data, logprobs_list):
            l = lp - d.loss_fn_inputs["ref_logprobs"]
            total = total + beta * (torch.expm1(-l) + l).sum()
        return total, {}

    def k2_no_coef(data, logprobs_list):
        return sum((0.5 * (lp - d.loss_fn_inputs["ref_logprobs"]) ** 2).sum()
                   for d, lp in zip(data, logprobs_list)), {}

    def k2_halved(inp):
        return 0.5 * inp.beta * (0.5 * (inp.logp - inp.ref_logp) ** 2 * inp.mask).sum(), {}

    def k1_ratio(data, logprobs_list, kl_coef=0.01):
        total = 0
        for d, lp in zip(data, logprobs_list):
            ratio = torch.exp(lp - d.loss_fn_inputs["logprobs"])
            total = total + (kl_coef * ratio * (lp - d.loss_fn_inputs["ref_logprobs"])).sum()
        return total, {}

    assert verify_custom_loss(k1_ratio).accepted
    rows = _rows(verify_custom_loss(k3_plain))
    assert rows[("token", "on_policy")].gradient_target == "forward"
    assert rows[("token", "on_policy")].value_over_kl == pytest.approx(1.0, abs=1e-12)
    report = verify_custom_loss(k2_no_coef)
    assert report.coefficient.startswith("none")
    r = _rows(report)[("token", "on_policy")]
    assert r.gradient_target == "reverse" and r.value_estimates == "neither" and abs(r.value_bias) > 1e-3
    r = _rows(verify_custom_loss(k2_halved))[("token", "on_policy")]
    assert r.gradient_target == "reverse" and r.gradient_scale == pytest.approx(0.5, rel=1e-9)
    with pytest.raises(ConfigError, match="--coef-arg 'gamma' is not a parameter"):
        verify_custom_loss(k3_plain, coef_arg="gamma")


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES.names())
def test_builtin_kl_term_is_proven_under_every_policy_loss(policy_loss):
    """The built-in objective (k3_st, w detached) as a custom loss with advantages 1: coefficient scaling alone
    isolates its KL part, which follows the registry's declarations at both levels, whatever the surrogate."""
    from klgrpo.verify.custom_loss import check_row, scaled_loss

    def objective(inp: LossInput):
        out = grpo_objective(ObjectiveInputs(inp.logp, inp.old_logp, inp.ref_logp, inp.advantages, inp.mask),
                             ObjectiveTerms(kl=KLTerm(coef=inp.beta, estimator="k3_st", is_correction="detached"),
                                            aggregation=inp.aggregation, policy=PolicyTerm(name=policy_loss)),
                             inp.normalizer)
        return out.loss, {}

    scaled = scaled_loss(objective)[0]
    for level, sampling, declared_as in (("token", "on_policy", "on_policy"),
                                         ("token", "off_policy", "off_policy_detached"),
                                         ("sequence", "on_policy", "on_policy")):
        row = check_row(scaled, level, sampling, advantage=1.0)
        assert row.gradient_target == ESTIMATORS["k3_st"].gradient_target("loss", declared_as, level), (level,
                                                                                                       sampling)
        assert row.value_over_kl == pytest.approx(1.0, abs=1e-10)
        assert abs(row.policy_part) > 1e-3  # the surrogate was there, and the scaling removed it


def test_verify_kl_cli_loss(tmp_path, capsys):
    from klgrpo.apps.verify_kl import main

    out_json = tmp_path / "as_written.json"
    assert main(["--loss", f"{EXAMPLE}:compute_grpo_kl_loss", "--json", str(out_json)]) == 1
    printed = capsys.readouterr().out
    assert "REJECTED" in printed and "-KL" in printed
    data = json.loads(out_json.read_text())
    on_policy = [r for r in data["rows"] if r["sampling"] == "on_policy"]
    assert [r["value_over_kl"] for r in on_policy] == pytest.approx([-1.0, -1.0], abs=1e-12)
    assert [r["gradient_target"] for r in on_policy] == ["zero", "zero"]
    assert data["accepted"] is False and data["signature"] == "datum"
    assert main(["--loss", f"{EXAMPLE}:compute_grpo_kl_loss_fixed"]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
    assert main(["--loss", f"{EXAMPLE}:nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--loss" in err and "has no attribute 'nope'" in err


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_policy_loss_choice_trains(tiny_model_dir, addition_file, tmp_path, policy_loss):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 2},
                      loss={"policy_loss": policy_loss}, optim={"lr": 1e-2})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    assert 0.0 <= rows[1]["clip_ratio"] <= 1.0 and rows[1]["kl/max"] > 0  # the policy moved
