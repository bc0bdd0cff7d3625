"""``klgrpo explain`` on ROLL RLVR pipeline configs, by release (klgrpo/apps/explain/roll.json, read by hand from
alibaba/ROLL at every tag v0.1.0 - v0.3.0).

Each expected verdict is derived by hand from ROLL's source (l = log pi - log ref, r = ref / pi, s = grad log pi):
- use_kl_loss: kl_loss_coef x k3 (compute_approx_kl's "k3" = r - 1 - log r clamped to [-10, 10]), no importance
  weight: grad k3 = (1 - r) s, mean grad KL(ref||pi): "forward", and the clip risk; aggregated by loss_agg_mode
  (seq-mean-token-mean from 0.1.1: the sequence verdict "neither" and the seqmean risk; 0.1.0's default
  seq-mean-token-sum);
- add_token_level_kl: beta x kl_penalty's estimate at the rollout policy subtracted from each token's reward after
  the normalisation, summed to the end (gamma 1): kl (k1 = l) as a reward is REINFORCE on the KL: "reverse" per
  token, and per sequence under token-mean (seq-mean-token-mean weighs each sequence's score terms by 1 / its
  length: "neither"); mse (k2) in the reward: E[k2 s] is neither KL's gradient;
- init_kl_coef without add_token_level_kl adds nothing (compute_token_reward's beta stays 0);
- a generating_args block samples at top_p 0.7 / top_k 50 where it leaves them unset (GeneratingArguments);
- keys per release (roll_keys.json): ROLL's loader, dacite's from_dict without strict, drops a key the release's
  dataclasses lack without a word (the run goes on without it) and its type check stops a run that puts a mapping
  where the release's field is a plain value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from klgrpo.apps.explain import main, roll
from klgrpo.apps.explain.frameworks import releases
from klgrpo.config.schema import GRPOConfig
from klgrpo.integrations.versions import NotInRange
from klgrpo.integrations.versions.clauses import constraints

DATA = Path(__file__).resolve().parent / "data" / "explain_roll"
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "kl_off": "kloff",
         "forward_kl": "forward", "kl_clipped": "clip", "seq_mean_token_mean": "seqmean",
         "truncated_sampling": "truncated", "filter_default": "default_filters", "neither_kl": "neither",
         "off_policy": "offpolicy", "reward_kl_off_policy": "reward_offpolicy"}
#: A minimal RLVR config: ROLL's worker groups, GRPO, 8 samples a prompt.
BASE = "actor_train: {}\nactor_infer: {}\nadv_estimator: grpo\nnum_return_sequences_in_group: 8\n"


def _run(tmp_path, text=None, name="cfg.yaml", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def test_the_table_holds_every_release_read():
    rows = [r.release for r in releases("roll")]
    assert [r["from"] for r in rows] == ["0.1.0", "0.1.1"]
    assert rows[0]["defaults"]["loss_agg_mode"] == "seq-mean-token-sum"
    assert rows[1]["defaults"]["loss_agg_mode"] == "seq-mean-token-mean"
    assert all(r["defaults"]["init_kl_coef"] == 0.2 and r["defaults"]["kl_loss_coef"] == 0 for r in rows)
    assert "v0.3.0" in " ".join(rows[1]["read"]) and "v0.1.0" in rows[0]["read"][0]


# file: (token, sequence, beta rule, risks)
REAL = {
    # reinforce, no KL term: use_kl_loss and add_token_level_kl false; init_kl_coef at its default 0.2 only loads
    # the reference; actor_infer samples at top_p 0.99, top_k 100.
    "v0.3.0_qwen2.5-7B-rlvr_megatron_rlvr_config.yaml": ("zero", "zero", "fixed at 0", {"kloff", "truncated"}),
    # grpo with k3 in the loss at 0.01 (init_kl_coef 0): forward, clipped, seq-mean-token-mean; top_p 0.99 / 100.
    "v0.3.0_qwen3-vl-4B-rlvr_megatron_rlvr_megatron_80G.yaml": ("forward", "neither", "fixed at 0.01",
                                                                {"forward", "clip", "seqmean", "truncated"}),
    "v0.1.3_qwen2.5-vl-7B-math_rlvr_math_megatron.yaml": ("forward", "neither", "fixed at 0.01",
                                                          {"forward", "clip", "seqmean", "truncated"}),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.glob("*.yaml")} == set(REAL)
    assert all(row[1] == "alibaba/ROLL" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    token, sequence, beta, risks = REAL[name]
    status, report = _run(tmp_path, source=DATA / name, extra=["--version", "roll==0.3.0"])
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "roll" and "versions" not in report
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks and len(report["risk_ids"]) == len(risks), report["risk_ids"]
    assert (report["config"]["rollout"]["top_p"], report["config"]["rollout"]["top_k"]) == (0.99, 100)
    GRPOConfig.from_dict(report["config"])


def test_real_files_named_details(tmp_path):
    status, report = _run(tmp_path, source=DATA / "v0.3.0_qwen2.5-7B-rlvr_megatron_rlvr_config.yaml",
                          extra=["--version", "roll==0.3.0"])
    assert report["unmapped"]["init_kl_coef"] == ("0.2 without add_token_level_kl: ROLL loads the reference and "
                                                  "logs its KL (critic/kl) but adds none to the rewards")
    assert report["config"]["loss"]["dual_clip"] == pytest.approx(1.4)  # 1 + 2 x pg_clip
    assert report["unmapped"]["whiten_advantages"].startswith("ROLL whitens the advantages over the batch")
    status, report = _run(tmp_path, source=DATA / "v0.3.0_qwen3-vl-4B-rlvr_megatron_rlvr_megatron_80G.yaml",
                          extra=["--version", "roll==0.3.0"])
    kl = report["config"]["kl"]
    assert (kl["coef"], kl["estimator"], kl["placement"], kl["is_correction"], kl["shaping"], kl["clip_threshold"]) \
        == (0.01, "k3", "loss", "none", "clip", 10.0)


def test_the_0_1_0_default_aggregation_is_its_own_answer(tmp_path):
    # the v0.1.3 recipe sets no loss_agg_mode: 0.1.0 sums each sequence's tokens (seq-mean-token-sum), later
    # releases take their mean
    status, report = _run(tmp_path, source=DATA / "v0.1.3_qwen2.5-vl-7B-math_rlvr_math_megatron.yaml")
    answers = [(v["releases"], v["aggregation"]["name"]) for v in report["versions"]]
    assert answers == [(["ROLL 0.1.1 or later"], "seq_mean_token_mean"),
                       (["ROLL >= 0.1.0, < 0.1.1"], "seq_mean_token_sum")]


@pytest.mark.parametrize("penalty, mode, token, sequence, estimator", [
    ("kl", "token-mean", "reverse", "reverse", "k1"),
    # the policy term's 1 / length per sequence also weighs the reward KL's score terms: neither KL per sequence
    ("kl", "seq-mean-token-mean", "reverse", "neither", "k1"),
    ("mse", "token-mean", "neither", "neither", "k2")])
def test_the_reward_kl(tmp_path, penalty, mode, token, sequence, estimator):
    text = BASE + f"add_token_level_kl: true\ninit_kl_coef: 0.05\nkl_penalty: {penalty}\nloss_agg_mode: {mode}\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert status == 0
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    kl = report["config"]["kl"]
    assert (kl["coef"], kl["estimator"], kl["placement"], kl["reward_mode"]) == (0.05, estimator, "reward",
                                                                                 "reward_to_go")


def test_the_adaptive_controller_and_both_terms(tmp_path):
    text = BASE + "add_token_level_kl: true\ninit_kl_coef: 0.05\ntarget_kl: 0.1\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert report["config"]["kl"]["controller"] == "adaptive" and report["config"]["kl"]["target"] == 0.1
    text = BASE + "add_token_level_kl: true\ninit_kl_coef: 0.05\nuse_kl_loss: true\nkl_loss_coef: 0.01\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert report["config"]["kl"]["placement"] == "loss" and report["config"]["kl"]["coef"] == 0.01
    assert report["unmapped"]["add_token_level_kl"].startswith("klgrpo has one KL term: ROLL's reward KL (kl, beta "
                                                               "0.05)")
    assert isinstance(report["value"], list) and len(report["value"]) == 2  # both terms in the verdict


def test_use_kl_loss_with_coefficient_0_is_no_kl(tmp_path):
    status, report = _run(tmp_path, BASE + "use_kl_loss: true\ninit_kl_coef: 0.0\n", extra=["--version", "roll==0.3.0"])
    assert report["gradient"]["token_on_policy"] == "zero" and _kinds(report["risk_ids"]) == {"beta0"}


def test_a_generating_args_block_samples_top_p_0_7_and_top_k_50_unset(tmp_path):
    text = BASE.replace("actor_infer: {}", "actor_infer:\n  generating_args:\n    max_new_tokens: 512") + \
        "use_kl_loss: true\nkl_loss_coef: 0.01\ninit_kl_coef: 0.0\n"
    out = tmp_path / "k.yaml"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0", "--write", str(out)])
    assert status == 0
    line = report["risks"][report["risk_ids"].index("filter_default")]
    assert line.startswith(
        "actor_infer.generating_args.top_p and actor_infer.generating_args.top_k unset: on ROLL 0.1.0 or later the "
        "sampler truncates each position's distribution at top_p 0.7 and top_k 50 (GeneratingArguments' default, "
        "which a generating_args block takes for what it leaves unset) while ROLL's actor scores each token by the "
        "full softmax of its logits")
    rollout = yaml.safe_load(out.read_text())["rollout"]
    assert (rollout["top_p"], rollout["top_k"], rollout["truncation"]) == (0.7, 50, "policy")
    # no block: explain reads no filter
    status, report = _run(tmp_path, BASE + "use_kl_loss: true\nkl_loss_coef: 0.01\n", name="b.yaml",
                          extra=["--version", "roll==0.3.0"])
    assert not {"filter_default", "truncated_sampling"} & set(report["risk_ids"])


def test_refusals(tmp_path, capsys):
    for text, said in ((BASE + "add_token_level_kl: true\nkl_penalty: full\n", "sampled tokens' log-probs only"),
                       (BASE + "add_token_level_kl: true\nkl_penalty: abs\n", "is |log pi - log ref|"),
                       (BASE + "kl_penalty: k3\n", "its config loader (dacite) refuses it"),
                       (BASE + "custom_envs: {}\n", "agentic pipeline")):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        assert main([str(path), "--version", "roll==0.3.0"]) == 2
        assert said in capsys.readouterr().err
    path.write_text(BASE.replace("grpo", "gigpo"))
    assert main([str(path), "--version", "roll==0.1.0"]) == 2
    assert "adv_estimator 'gigpo' is none of ROLL >= 0.1.0, < 0.1.1's" in capsys.readouterr().err


TAGS = ["0.1.0", "0.1.1", "0.1.3", "0.2.0", "0.2.1", "0.3.0"]


def test_the_key_table_agrees_with_the_hand_read_one():
    """roll_keys.json (generated from each tag's config dataclasses by tools/roll_keys.py) against roll.json and the
    reader: the same tags; every key the mapping reads and every default of a range a key of each release of the
    range, but for 0.1.0's clip range and normalisation types; the worker groups dataclasses; rewards free."""
    table = roll._key_table()
    rows = releases("roll")
    read = {m for row in rows for line in row.release["read"] for m in re.findall(r"\bv(\d+\.\d+\.\d+)\b", line)}
    assert list(table["read"]) == sorted(read, key=Version) == TAGS
    # 0.1.0's RLVRConfig has pg_clip alone and reward_norm / reward_shift / reward_scale where 0.1.1 has the norm
    # types: roll.json's 0.1.0 defaults for those five are what 0.1.0's code does without them
    late = {"use_pg_clip_range", "pg_clip_low", "pg_clip_high", "norm_mean_type", "norm_std_type"}
    for row in rows:
        tags = [t for t in TAGS if Version(t) >= row.low and (row.high is None or Version(t) < row.high)]
        for key in {*roll.READ, *row.defaults}:
            lacking = [t for t in tags if not roll._has_key(key, t)]
            assert lacking == (["0.1.0"] if key in late and row.low == Version("0.1.0") else []), key
    for key in roll.OBJECTIVE:
        expected = {"reward_norm": TAGS[:1], "reward_shift": TAGS[:1], "reward_scale": TAGS[:1],
                    "train_infer_correction": TAGS[3:], "use_opd": TAGS[4:], "is_pure_opd": TAGS[4:]}
        assert table["keys"][key] == expected.get(key, TAGS), key
    for group in ("actor_train", "actor_infer", "reference", "validation", "critic"):
        assert table["nested"][group] == TAGS, group
    assert table["open"]["rewards"] == table["open"]["hydra"] == table["open"]["defaults"] == TAGS
    assert not any(key.split(".")[0] in roll.AGENTIC for key in table["keys"])
    for key in ("actor_train.model_args.dtype", "max_steps", "actor_infer.generating_args.top_p",
                "actor_train.strategy_args.strategy_config.tensor_model_parallel_size", "rewards.math.worker_cls"):
        assert all(roll._has_key(key, t) for t in TAGS), key
    assert not any(roll._has_key("no_such_key", t) for t in TAGS)


def test_a_key_the_release_lacks_is_dropped_not_refused(tmp_path):
    """A made-up key: accepted at every release and listed as ignored (ROLL drops it and runs on). A key of a later
    release (use_pg_clip_range with pg_clip_low / pg_clip_high, 0.1.1 on): 0.1.0 drops it, and so does its verdict
    (pg_clip both sides), named; 0.1.1 and 0.3.0 read it."""
    for tag in TAGS:
        status, report = _run(tmp_path, BASE + "no_such_key: 1\n", extra=["--version", f"roll=={tag}"])
        assert status == 0 and "no_such_key" in report["ignored"], tag
    text = (BASE + "use_kl_loss: true\nkl_loss_coef: 0.01\n"
            "use_pg_clip_range: true\npg_clip_low: 0.1\npg_clip_high: 0.3\n")
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.1.0"])
    assert status == 0
    assert (report["config"]["loss"]["eps_low"], report["config"]["loss"]["eps_high"]) == (0.2, 0.2)
    for key in ("use_pg_clip_range", "pg_clip_low", "pg_clip_high"):
        assert report["unmapped"][key] == ("not a field of ROLL 0.1.0's config: its loader (dacite's from_dict, not "
                                           "strict) drops it without a word, so the run, and the verdict here, go "
                                           "on without it")
    for tag in ("0.1.1", "0.3.0"):
        status, report = _run(tmp_path, text, extra=["--version", f"roll=={tag}"])
        assert (report["config"]["loss"]["eps_low"], report["config"]["loss"]["eps_high"]) == (0.1, 0.3)
        assert not [k for k, why in report["unmapped"].items() if "dacite" in why], tag
    # set to what 0.1.0 does without it: nothing lost, listed as ignored
    status, report = _run(tmp_path, BASE + "use_pg_clip_range: false\n", extra=["--version", "roll==0.1.0"])
    assert "use_pg_clip_range" in report["ignored"] and "use_pg_clip_range" not in report["unmapped"]


def test_a_mapping_under_a_plain_field_is_refused(tmp_path, capsys):
    """A made-up key under max_steps (an int in every release): dacite's type check stops the run at every release,
    one line; without --version, or in a config of the distillation launcher (no type check), not judged."""
    text = BASE + "max_steps:\n  no_such_key: 1\n"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    for tag in TAGS:
        assert main([str(path), "--version", f"roll=={tag}"]) == 2, tag
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert (f"max_steps.no_such_key is not a key of ROLL {tag}'s config: max_steps is a plain value there, not a "
                "mapping, so its loader (dacite's type check) stops the run at once (no ROLL release read has it)"
                in err), err
    assert main([str(path), "--json", str(tmp_path / "o.json")]) == 0
    path.write_text(text + "is_pure_opd: true\n")
    assert main([str(path), "--version", "roll==0.3.0", "--json", str(tmp_path / "p.json")]) == 0


def test_refused_at_the_earlier_release_and_taken_at_the_later(monkeypatch):
    """ROLL's history read has no field that turned from a plain value into a dataclass: the check on a table where
    x is a plain value at 0.1.0 and a dataclass holding y at 0.3.0."""
    table = {"read": {"0.1.0": "", "0.3.0": ""}, "keys": {"x": ["0.1.0", "0.3.0"], "x.y": ["0.3.0"]},
             "nested": {"x": ["0.3.0"]}, "open": {}}
    monkeypatch.setattr(roll, "_key_table", lambda: table)
    with pytest.raises(NotInRange, match=r"^f: x.y is not a key of ROLL 0.1.0's config: x is a plain value there, "
                                         r"not a mapping, .* \(ROLL 0.3.0 have it; pass the release you run, e.g. "
                                         r"--version roll==0.3.0\)$"):
        roll.check_keys_at_releases(["x.y"], constraints("==0.1.0"), "f")
    roll.check_keys_at_releases(["x.y"], constraints("==0.3.0"), "f")
    roll.check_keys_at_releases(["x.y"], constraints(">=0.1.0"), "f")  # a release they allow takes it

