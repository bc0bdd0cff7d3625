"""The replay anchor: exact values against a naive KL, zero at the reference, gradient to the policy only,
the importance-weighted sampled estimators against exact enumeration (every registered estimator), the
cache written once and reused, deterministic resumable cycling, and the trainer's resume equality."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.core.reference import FrozenCopyReference
from klgrpo.errors import ConfigError
from klgrpo.math.kl import ESTIMATORS
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train.replay import CACHE_FILE, AnchorModels, ReplayAnchor, ReplayCache
from tests.test_trainer import _final_state, _train_rows, make_config, quiet

REPLAY = {"coef": 1.0, "num_prompts": 6, "completions_per_prompt": 2, "batch_size": 5}


@pytest.fixture(scope="module")
def subtraction_file(tmp_path_factory):
    from tests.conftest import write_jsonl

    rows = [{"prompt": f"{a:02d}-{b:02d}="} for a in range(50, 90, 7) for b in range(0, 40, 13)]
    return write_jsonl(tmp_path_factory.mktemp("replay") / "sub.jsonl", rows)


def _setup(tiny_model_dir, addition_file, subtraction_file, run, dtype=torch.float64, **replay):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = make_config(tiny_model_dir, addition_file, run,
                      kl={"coef": 0.1, "replay": {**REPLAY, "source": str(subtraction_file), **replay}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "left"
    reference = FrozenCopyReference.copy_of(model)
    return cfg, model, tokenizer, reference


def _perturb(model, scale=0.05):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _peek_rows(anchor) -> list[int]:
    state = anchor.state_dict()
    rows = anchor.sampler.next_indices()
    anchor.load_state_dict(state)
    return rows


def _naive_kl_per_row(policy, reference_model, cache: ReplayCache, i: int) -> list[float]:
    """KL_t = sum_v p(v) (log p(v) - log r(v)) at each completion position of row i, from a forward of the
    row WITHOUT its padding (positions 0..n-1), in float64."""
    keep = cache.attention_mask[i].bool()
    ids = cache.input_ids[i][keep][None]
    n_prompt = int(cache.attention_mask[i, :cache.prompt_len].sum())
    n_comp = int(cache.completion_mask[i].sum())
    out = []
    with torch.no_grad():
        lp = torch.log_softmax(policy(input_ids=ids).logits[0].double(), -1)
        lr = torch.log_softmax(reference_model(input_ids=ids).logits[0].double(), -1)
    for t in range(n_comp):
        pos = n_prompt - 1 + t  # the logits at pos predict completion token t
        out.append(float((lp[pos].exp() * (lp[pos] - lr[pos])).sum()))
    return out


def test_full_kl_equals_naive_exact_kl(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "r")
    anchor = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "r", log=quiet)
    assert anchor.cache.size == 12 and anchor.cache.ref_logsoftmax is not None
    _perturb(model)
    rows = _peek_rows(anchor)
    per_token = [kl for i in rows for kl in _naive_kl_per_row(model, ref.model, anchor.cache, i)]
    expected = sum(per_token) / len(per_token)  # token mean over the batch
    metrics = anchor.accumulate_gradients(model, main_loss=torch.tensor(-0.5, dtype=torch.float64))
    assert expected > 1e-4
    assert metrics["kl/replay"] == pytest.approx(expected, abs=1e-6)
    assert metrics["train/replay_penalty"] == pytest.approx(1.0 * expected, abs=1e-6)
    # share = penalty / (|loss| + penalty)
    assert metrics["train/replay_share"] == pytest.approx(expected / (0.5 + expected), abs=1e-6)


def test_recompute_mode_equals_cached_mode(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    """A zero memory budget recomputes the reference each step: same value and gradient as the cache."""
    results = []
    for budget in (2**30, 0):
        cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / f"b{budget}")
        anchor = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / f"b{budget}", log=quiet,
                                    cache_budget_bytes=budget)
        assert (anchor.cache.ref_logsoftmax is None) == (budget == 0)
        _perturb(model)
        m = anchor.accumulate_gradients(model)
        results.append((m["kl/replay"], torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-9)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-8, atol=1e-12)


def test_zero_kl_and_zero_gradient_at_the_reference(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "z")
    anchor = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "z", log=quiet)
    metrics = anchor.accumulate_gradients(model)
    # float64 throughout: only batch-shape rounding (~1e-16 in the logits) separates the two forwards.
    assert abs(metrics["kl/replay"]) < 1e-13
    assert max(p.grad.abs().max().item() for p in model.parameters()) < 1e-10


def test_gradient_reaches_the_policy_only(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "g")
    anchor = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "g", log=quiet)
    _perturb(model)
    anchor.accumulate_gradients(model)
    assert all(p.grad is not None for p in model.parameters())
    assert max(p.grad.abs().max().item() for p in model.parameters()) > 1e-4
    assert all(p.grad is None and not p.requires_grad for p in ref.model.parameters())
    c = anchor.cache
    assert not any(t.requires_grad for t in (c.ref_logp, c.sample_logp, c.ref_logsoftmax))


def test_micro_batches_do_not_change_value_or_gradient(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    out = []
    for micro in (0, 2):
        cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / f"m{micro}")
        cfg = cfg.override({"train.micro_batch_size": micro})
        anchor = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / f"m{micro}", log=quiet)
        _perturb(model)
        m = anchor.accumulate_gradients(model)
        out.append((m["kl/replay"], torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-10)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("estimator", ESTIMATORS.names())
def test_sampled_estimators_by_exact_enumeration(estimator):
    """One position, every token y of a V = 6 vocabulary as its own cached row, weighted by q(y): the
    expectation over the reference samples of w * k(l) equals the estimator's on-policy expectation, and its
    gradient equals grad KL(pi||ref) exactly when the registry declares (loss, off_policy_in_graph) reverse.

    E_q[w k] = sum_y q(y) (pi(y)/q(y)) k(l(y)) = E_pi[k];  for k1 and k3 that is KL(pi||ref)."""
    torch.manual_seed(0)
    v = 6
    logits = torch.randn(v, dtype=torch.float64, requires_grad=True)
    ref_lsm = torch.log_softmax(torch.randn(v, dtype=torch.float64), -1)
    q_lsm = torch.log_softmax(ref_lsm / 0.7, -1)  # sampled at temperature 0.7: q != ref
    ys = torch.arange(v)
    cache = ReplayCache(input_ids=torch.stack([torch.tensor([3]).repeat(v), ys], 1), attention_mask=torch.ones(v, 2),
                        completion_mask=torch.ones(v, 1, dtype=torch.bool), ref_logp=ref_lsm[ys, None],
                        sample_logp=q_lsm[ys, None], ref_logsoftmax=None, prompt_len=1, meta={})
    anchor = ReplayAnchor(cache, coef=1.0, estimator=estimator, batch_size=v, seed=0, log_ratio_clamp=20.0)
    per_row = anchor.per_token_kl(logits.expand(v, 1, v), ys)[:, 0]
    expectation = (q_lsm.exp() * per_row).sum()
    (grad,) = torch.autograd.grad(expectation, logits)

    lp = torch.log_softmax(logits, -1)
    l = lp - ref_lsm
    on_policy = (lp.exp() * ESTIMATORS[estimator].fn(l, 20.0)).sum()
    exact = (lp.exp() * l).sum()
    (exact_grad,) = torch.autograd.grad(exact, logits)
    assert expectation.item() == pytest.approx(on_policy.item(), rel=1e-10)
    if ESTIMATORS[estimator].value_unbiased:
        assert expectation.item() == pytest.approx(exact.item(), rel=1e-10)
    declared = ESTIMATORS[estimator].gradient_target("loss", "off_policy_in_graph", level="token")
    matches = torch.allclose(grad, exact_grad, rtol=1e-10, atol=1e-12)
    assert matches == (declared == "reverse"), (declared, grad, exact_grad)


def test_cache_written_once_and_reused(tiny_model_dir, addition_file, subtraction_file, tmp_path, monkeypatch):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "c")
    first = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "c", log=quiet)
    assert (tmp_path / "c" / CACHE_FILE).exists()
    rng = torch.get_rng_state()

    def no_sampling(*a, **k):
        raise AssertionError("the cache must be reused, not resampled")

    monkeypatch.setattr("klgrpo.train.replay.generate_groups", no_sampling)
    second = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "c", log=quiet)
    assert torch.equal(first.cache.input_ids, second.cache.input_ids)
    assert torch.equal(first.cache.ref_logsoftmax, second.cache.ref_logsoftmax)
    assert torch.equal(torch.get_rng_state(), rng)
    # Other settings, or another reference: the stale cache is not used.
    for changed_cfg, changed_ref in ((cfg.override({"kl.replay.num_prompts": 3}), ref),
                                     (cfg, FrozenCopyReference.copy_of(model))):
        if changed_ref is not ref:
            _perturb(changed_ref.model, 0.2)
        with pytest.raises(AssertionError, match="reused, not resampled"):
            ReplayAnchor.build(changed_cfg, AnchorModels(model, tok, changed_ref), tmp_path / "c", log=quiet)


def test_sampling_leaves_the_global_rng_alone(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "s")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "s", log=quiet)
    assert torch.equal(torch.get_rng_state(), before)


def test_cycling_is_deterministic_and_resumable(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "d")
    a = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "d", log=quiet)
    batches = [a.sampler.next_indices() for _ in range(5)]
    assert all(len(b) == 5 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat[:12]) == list(range(12))  # an epoch visits every cached sequence once
    b = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "d", log=quiet)
    assert [b.sampler.next_indices() for _ in range(2)] == batches[:2]
    state = b.state_dict()
    c = ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), tmp_path / "d", log=quiet)
    c.load_state_dict(state)
    assert [c.sampler.next_indices() for _ in range(3)] == batches[2:]
    bad = dict(state, cache_rows=99)
    with pytest.raises(ConfigError, match="kl.replay"):
        c.load_state_dict(bad)


def test_settings_errors_name_the_field(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    cfg, model, tok, ref = _setup(tiny_model_dir, addition_file, subtraction_file, tmp_path / "e")
    models = AnchorModels(model, tok, ref)
    with pytest.raises(ConfigError, match="kl.replay.source"):
        ReplayAnchor.build(cfg.override({"kl.replay.source": ""}), models, tmp_path / "e", log=quiet)
    with pytest.raises(ConfigError, match="kl.replay.estimator"):
        ReplayAnchor.build(cfg.override({"kl.replay.estimator": "k9"}), models, tmp_path / "e", log=quiet)
    with pytest.raises(ConfigError, match="kl.monitor"):
        ReplayAnchor.build(cfg, AnchorModels(model, tok, None), tmp_path / "e", log=quiet)


def test_trainer_logs_replay_and_resumes_identically(tiny_model_dir, addition_file, subtraction_file, tmp_path):
    groups = dict(train={"steps": 4},
                  kl={"coef": 0.1, "replay": {**REPLAY, "source": str(subtraction_file)}})
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "a", **groups), log=quiet).train()
    part = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups).override({"train.steps": 3})
    GRPOTrainer(part, log=quiet).train()
    messages = []
    full = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups)
    GRPOTrainer(full, log=messages.append).train(resume="latest")
    assert not any("replay anchor" in m for m in messages)  # the resumed run reused the cache silently

    rows = [r for r in read_metrics(tmp_path / "a") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["kl/replay"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert rows[-1]["kl/replay"] > 1e-6 and math.isfinite(rows[-1]["kl/replay"])
    assert all(r["train/replay_penalty"] == pytest.approx(r["kl/replay"]) for r in rows)
    assert _train_rows(tmp_path / "a") == _train_rows(tmp_path / "b")
    a, b = _final_state(tmp_path / "a"), _final_state(tmp_path / "b")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_refused_run_leaves_another_runs_replay_cache_alone(tiny_model_dir, addition_file, subtraction_file,
                                                              tmp_path):
    """GRPOTrainer(...) builds the anchor before train() opens the folder: in a folder that holds a run, a cache
    sampled for other settings waits until the run may write there (--overwrite), and a refused run writes nothing."""
    import json

    groups = dict(train={"steps": 1}, kl={"coef": 0.1, "replay": {**REPLAY, "source": str(subtraction_file)}})
    run = tmp_path / "run"
    GRPOTrainer(make_config(tiny_model_dir, addition_file, run, **groups), log=quiet).train()
    before = {p.name: p.read_bytes() for p in run.glob("replay_cache.*")}
    assert sorted(before) == ["replay_cache.json", "replay_cache.safetensors"]
    other = make_config(tiny_model_dir, addition_file, run, **groups).override({"kl.replay.num_prompts": 3})
    with pytest.raises(ConfigError, match="already holds a run"):
        GRPOTrainer(other, log=quiet).train()
    assert {p.name: p.read_bytes() for p in run.glob("replay_cache.*")} == before
    GRPOTrainer(other, log=quiet).train(overwrite=True)
    assert json.loads((run / CACHE_FILE).read_text())["tree"]["meta"]["num_prompts"] == 3


def test_replay_share_is_the_magnitude_share_in_0_1():
    from klgrpo.train.replay import replay_share

    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    assert float(replay_share(t(0.25), t(-0.75))) == 0.25
    assert float(replay_share(t(0.5), t(0.5))) == 0.5
    assert float(replay_share(t(0.0), t(0.0))) == 0.0
    assert float(replay_share(t(1.0), t(0.0))) == 1.0
    # step 1 of the demo: policy == reference, both sides are rounding noise and the KL rounded below 0; the
    # signed ratio p / (|L| + p) gave -0.614e-9 / (1e-9 - 0.614e-9) = -1.59
    assert float(replay_share(t(-0.614e-9), t(1e-9))) == pytest.approx(0.614 / 1.614, rel=1e-12)
