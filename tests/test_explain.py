"""``klgrpo explain``: format detection, the worked examples' verdicts, --json / --write / --strict, one-line
errors for bad input, and the docs' tables equal to the code's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.explain import STRICT_EXIT, main
from klgrpo.integrations.mapping import render_table

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples" / "explain"

#: The worked examples' verdicts. Why each holds (docs/kl_math.md): k3 with the in-graph weight has the expected
#: gradient E[(k3 + 1 - r) s] = E[l s] (reverse) even when pi_old = pi; without the weight E[(1 - r) s] (forward);
#: a per-token loss KL is no sequence-KL gradient (the prefixes' score term is missing): "neither" at sequence
#: level; verl's k3 loss (forward) plus its k1 reward KL (reverse) sum to neither.
EXPECTED = {
    "trl_default.yaml": ("trl", {"token_on_policy": "reverse", "sequence_on_policy": "neither"}),
    "trl_no_bias_correction.yaml": ("trl", {"token_on_policy": "forward", "sequence_on_policy": "neither"}),
    "verl_low_var_kl_and_reward.yaml": ("verl", {"token_on_policy": "neither", "sequence_on_policy": "neither",
                                                 "token_off_policy": "neither"}),
    "openrlhf_k3_loss.txt": ("openrlhf", {"token_on_policy": "forward", "sequence_on_policy": "neither"}),
    "unsloth_dynamic.yaml": ("adaptive_kl", {"token_on_policy": "reverse", "sequence_on_policy": "neither"}),
}


@pytest.fixture(autouse=True)
def _trl_installed():
    pytest.importorskip("trl")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_worked_examples_verdicts_and_json(name, tmp_path, capsys):
    out = tmp_path / "explain.json"
    assert main([str(EXAMPLES / name), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    source, gradient = EXPECTED[name]
    assert report["source"] == source and report["gradient"] == gradient
    for key in ("config", "value", "unmapped", "risks"):
        assert key in report
    assert report["value"]["unbiased"] if isinstance(report["value"], dict) else report["value"][0]["unbiased"]
    printed = capsys.readouterr().out
    assert printed.startswith(f"{EXAMPLES / name}: ") and "KL gradient: token " in printed


def test_risks_name_their_fix(tmp_path):
    out = tmp_path / "r.json"
    main([str(EXAMPLES / "trl_no_bias_correction.yaml"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert "kl.is_correction in_graph" in report["risks"][report["risk_ids"].index("forward_kl")]
    main([str(EXAMPLES / "verl_low_var_kl_and_reward.yaml"), "--json", str(out), "--overwrite"])
    report = json.loads(out.read_text())
    assert {"reward_kl_off_policy", "kl_clipped", "advantage_epsilon"} <= set(report["risk_ids"])
    assert "1e-06" in report["risks"][report["risk_ids"].index("advantage_epsilon")]


@pytest.mark.parametrize("kl, verdict, advised, not_advised", [
    # the clip at 0.001 zeroes the gradient of every token above it: the cause is the shaping, not k3 in_graph
    ("estimator: k3\n  is_correction: in_graph\n  shaping: clip\n  clip_threshold: 0.001", "zero",
     "the estimator and its weight already follow the reverse KL: kl.shaping clip", "use k3 with"),
    ("estimator: k3_st\n  is_correction: detached\n  shaping: clip\n  clip_threshold: 0.001", "zero",
     "kl.shaping clip changes the gradient", "use k3 with"),
    # the same clip with k1 in the loss: the estimator is also wrong, and the advice names it
    ("estimator: k1\n  is_correction: in_graph\n  shaping: clip\n  clip_threshold: 0.001", "neither",
     "use k3 with kl.is_correction in_graph, or k3_st with detached", "already follow"),
    # k3 in the reward: k1 is the reward's estimator; k3 in_graph is what it has
    ("estimator: k3\n  is_correction: in_graph\n  placement: reward", "neither",
     "in the reward use kl.estimator k1", "use k3 with"),
])
def test_the_estimator_advice_leaves_out_what_the_config_has(tmp_path, kl, verdict, advised, not_advised):
    src = tmp_path / "cfg.yaml"
    src.write_text(f"kl:\n  coef: 0.04\n  {kl}\n")
    out = tmp_path / "r.json"
    assert main([str(src), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["gradient"]["token_on_policy"] == verdict
    line = report["risks"][report["risk_ids"].index(f"{verdict}_kl")]
    assert advised in line and not_advised not in line, line


def test_beta_zero_is_a_risk_and_a_zero_gradient(tmp_path):
    src = tmp_path / "trl.yaml"
    src.write_text("loss_type: dapo\n")  # TRL 1.16's default beta is 0.0
    out = tmp_path / "r.json"
    assert main([str(src), "--json", str(out), "--strict"]) == STRICT_EXIT
    report = json.loads(out.read_text())
    assert report["gradient"]["token_on_policy"] == "zero" and report["config"]["kl"]["monitor"] is False
    assert "beta_zero" in report["risk_ids"]


def test_strict_exit_status(tmp_path):
    assert main([str(EXAMPLES / "trl_default.yaml"), "--strict"]) == 0
    assert main([str(EXAMPLES / "trl_no_bias_correction.yaml"), "--strict"]) == STRICT_EXIT
    assert main([str(EXAMPLES / "trl_no_bias_correction.yaml")]) == 0


def test_write_gives_a_klgrpo_config_that_explains_the_same(tmp_path, capsys):
    written = tmp_path / "klgrpo.yaml"
    assert main([str(EXAMPLES / "unsloth_dynamic.yaml"), "--write", str(written)]) == 0
    from klgrpo.config.schema import GRPOConfig

    cfg = GRPOConfig.from_yaml(written)
    assert (cfg.kl.controller, cfg.kl.estimator, cfg.kl.is_correction, cfg.loss.aggregation) == \
        ("dynamic", "k3", "in_graph", "seq_mean_token_mean")
    out = tmp_path / "again.json"
    assert main([str(written), "--json", str(out)]) == 0  # explaining the klgrpo config: same verdict
    again = json.loads(out.read_text())
    assert again["source"] == "klgrpo"
    assert again["gradient"] == EXPECTED["unsloth_dynamic.yaml"][1]


def test_verl_overrides_one_per_line(tmp_path):
    src = tmp_path / "overrides.txt"
    src.write_text("algorithm.adv_estimator=grpo\nactor_rollout_ref.actor.use_kl_loss=true\n"
                   "actor_rollout_ref.actor.kl_loss_type=low_var_kl\n"
                   "actor_rollout_ref.actor.ppo_mini_batch_size=1024\n")
    out = tmp_path / "r.json"
    assert main([str(src), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["source"] == "verl" and report["config"]["kl"]["estimator"] == "k3"
    assert report["gradient"] == {"token_on_policy": "forward", "sequence_on_policy": "neither"}


@pytest.mark.parametrize("text, args, message", [
    ("betta: 0.1\n", [], "unknown TRL GRPOConfig field 'betta'; did you mean beta?"),
    ("beta: high\n", [], "beta must be a number, got 'high'"),
    ("use_bias_correction_kl: 3\n", [], "use_bias_correction_kl must be true or false, got 3"),
    ("kl_target: [1]\nbeta: 0.1\n", [], "kl_target must be a number"),
    ("data:\n  limit: 3\n", [], "could be klgrpo or verl (top-level keys: data); pass --from klgrpo|verl"),
    ("just some words\n", [], "is none of the formats klgrpo explain reads"),
    ("algorithm:\n  kl_ctrll:\n    type: fixed\n", [], "unknown verl key 'algorithm.kl_ctrll.type'"),
    ("actor_rollout_ref.actor.kl_loss_coef=lots\n", [], "actor_rollout_ref.actor.kl_loss_coef must be a number"),
    ("--algo.kl.init_coeff 0.1\n", [], "unknown OpenRLHF flag --algo.kl.init_coeff; did you mean --algo.kl.init_coef?"),
    ("--algo.kl.init_coef much\n", [], "--algo.kl.init_coef must be a number, got 'much'"),
    ("kl:\n  coeff: 0.1\n", [], "unknown config field 'kl.coeff'"),
    ("beta: 0.1\n", ["--from", "openrlhf"], "holds no --flags"),
])
def test_bad_input_gets_one_line(tmp_path, capsys, text, args, message):
    src = tmp_path / "input.txt"
    src.write_text(text)
    assert main([str(src), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_missing_file_and_two_files_with_json(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([str(EXAMPLES / "trl_default.yaml")] * 2 + ["--json", str(tmp_path / "x.json")]) == 2


def test_the_docs_show_the_code_tables():
    from klgrpo.integrations.openrlhf_mapping import OPENRLHF_FIELDS
    from klgrpo.integrations.trl_mapping import ADAPTIVE_KL_FIELDS, TRL_FIELDS
    from klgrpo.integrations.verl_mapping import VERL_FIELDS

    trl_doc = (ROOT / "docs" / "trl.md").read_text()
    explain_doc = (ROOT / "docs" / "explain.md").read_text()
    assert render_table(ADAPTIVE_KL_FIELDS, "adaptive-KL") in trl_doc
    for rows, name in ((ADAPTIVE_KL_FIELDS, "adaptive-KL"), (TRL_FIELDS, "TRL"), (VERL_FIELDS, "verl"),
                       (OPENRLHF_FIELDS, "OpenRLHF")):
        assert render_table(rows, name) in explain_doc, name


def test_trl_defaults_are_trl_1_16s():
    import dataclasses

    import trl

    from klgrpo.integrations.trl_mapping import ADAPTIVE_KL_DEFAULTS, TRL_DEFAULTS
    from klgrpo.trl import GRPOConfig

    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {name: theirs[name] for name in TRL_DEFAULTS} == TRL_DEFAULTS
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {name: ours[name] for name in ADAPTIVE_KL_DEFAULTS} == ADAPTIVE_KL_DEFAULTS


def test_the_bridge_and_the_trainer_build_one_controller(tmp_path):
    from klgrpo.config.schema import GRPOConfig as KlgrpoConfig
    from klgrpo.config.terms import build_kl_controller
    from klgrpo.math.kl_control import DUAL_BETA_FLOOR
    from klgrpo.trl import GRPOConfig
    from klgrpo.trl import build_kl_controller as bridge_controller

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], beta=0.1, kl_controller="dual",
                      kl_target=0.05, beta_min=0.0)
    ours = build_kl_controller(KlgrpoConfig.from_dict({"kl": {"coef": 0.1, "controller": "dual", "target": 0.05,
                                                             "beta_min": 0.0}}).kl)
    theirs = bridge_controller(args)
    assert theirs.beta_min == ours.beta_min == DUAL_BETA_FLOOR  # the controller's own floor, not a copy
    for kl in (0.2, 0.01, 0.07):
        assert theirs.update(kl) == ours.update(kl)


def test_stdin(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump({"beta": 0.04})))
    assert main(["-"]) == 0
    assert capsys.readouterr().out.startswith("<stdin>: TRL GRPOConfig, on TRL 1.10.0 or later")


def test_fields_outside_the_tables_are_named_or_ignored(tmp_path):
    """A key of the objective's groups that the table does not read is named (it may change the objective); a
    speed, memory or logging key is listed as ignored."""
    src = tmp_path / "verl.txt"
    src.write_text("algorithm.adv_estimator=grpo\nactor_rollout_ref.actor.tau_pos=2.0\n"
                   "actor_rollout_ref.actor.fsdp_config.param_offload=true\ntrainer.total_epochs=3\n")
    out = tmp_path / "r.json"
    assert main([str(src), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["unmapped"]["actor_rollout_ref.actor.tau_pos"].startswith("not read by the mapping")
    assert report["ignored"] == ["actor_rollout_ref.actor.fsdp_config.param_offload", "trainer.total_epochs"]
    trl_src = tmp_path / "trl.yaml"
    trl_src.write_text("beta: 0.04\nbf16: true\nrepetition_penalty: 1.1\n")
    assert main([str(trl_src), "--json", str(out), "--overwrite"]) == 0
    report = json.loads(out.read_text())
    assert report["ignored"] == ["bf16"] and "repetition_penalty" in report["unmapped"]


def test_a_klgrpo_configs_reward_functions_and_models_are_listed(tmp_path, capsys):
    """Every rewards.functions entry, a reward model with the settings it scores with; nothing is loaded (the
    reward models' folders do not exist)."""
    config = {"model": {"name_or_path": "some/policy"}, "data": {"source": "prompts.jsonl"}, "kl": {"coef": 0.04},
              "rewards": {"functions": [
                  "exact_match", {"name": "format", "weight": 0.5, "kwargs": {"pattern": "<a>.*</a>"}},
                  {"name": "my_rewards.py:brevity", "weight": -0.1},
                  {"model": str(tmp_path / "absent_rm"), "weight": 2, "batch_size": 8},
                  {"model": "org/rm-big", "dtype": "bfloat16", "label": "positive", "max_length": 512}]}}
    path, out = tmp_path / "run.yaml", tmp_path / "explain.json"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path), "--json", str(out)]) == 0
    plain = "prompt + completion concatenated (prompts given as chat messages: its own chat template)"
    assert json.loads(out.read_text())["rewards"] == [
        {"kind": "built-in", "name": "exact_match", "weight": 1.0},
        {"kind": "built-in", "name": "format", "weight": 0.5, "kwargs": {"pattern": "<a>.*</a>"}},
        {"kind": "function", "name": "my_rewards.py:brevity", "weight": -0.1},
        {"kind": "reward model", "model": str(tmp_path / "absent_rm"), "weight": 2.0, "batch_size": 8,
         "dtype": "the policy's", "label": "single logit", "max_length": "the model's context", "rendering": plain},
        {"kind": "reward model", "model": "org/rm-big", "weight": 1.0, "batch_size": 16, "dtype": "bfloat16",
         "label": "positive", "max_length": 512, "rendering": plain}]
    printed = capsys.readouterr().out
    assert (f"  reward: reward model {tmp_path / 'absent_rm'}, weight 2, batch_size 8, dtype the policy's, label "
            f"single logit, max_length the model's context; input: {plain}\n") in printed
    assert "  reward: function my_rewards.py:brevity, weight -0.1\n" in printed
    config["data"]["as_chat"] = True
    path.write_text(yaml.safe_dump(config))
    assert main([str(path), "--json", str(out), "--overwrite"]) == 0
    rendering = json.loads(out.read_text())["rewards"][4]["rendering"]
    assert rendering == "its own chat template (data.as_chat), the completion as the assistant's turn"


def test_a_bad_reward_model_entry_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "p"}, "data": {"source": "d.jsonl"},
                                    "rewards": {"functions": [{"model": "rm", "batch": 8}]}}))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown key 'batch'" in err and "batch_size" in err


def test_trls_reward_model_is_listed_as_klgrpos_entry(tmp_path):
    path, out = tmp_path / "trl.yaml", tmp_path / "explain.json"
    path.write_text(yaml.safe_dump({"beta": 0.04, "reward_model_name_or_path": "org/reward-model"}))
    assert main([str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (entry,) = report["rewards"]
    assert (entry["kind"], entry["model"], entry["label"], entry["dtype"]) == ("reward model", "org/reward-model",
                                                                               "single logit", "the policy's")
    assert "{model: PATH}" in report["unmapped"]["reward_model_name_or_path"]


def test_every_risk_id_is_documented_and_every_report_pairs_ids_with_lines(tmp_path):
    """The ids a program reads (risk_ids in the JSON): each one explain can give is listed in docs/explain.md,
    and a report holds one id per risk line, in order."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "".join((root / "klgrpo/apps/explain" / f).read_text()
                   for f in ("report.py", "slime.py", "prime_rl.py", "truncation.py"))
    given = set(re.findall(r'add\("(\w+)"', code)) | set(re.findall(r'[(\[]\("(\w+)",', code))
    given |= {"neither_kl", "zero_kl"}  # the token verdict's own id
    row = next(line for line in (root / "docs/explain.md").read_text().splitlines() if line.startswith("| `risk_ids`"))
    assert given and given == set(re.findall(r"`(\w+)`", row)) - {"risk_ids"}
    script = tmp_path / "train.py"
    script.write_text("from trl import GRPOConfig\nc = GRPOConfig(beta=0.0, top_k=0, top_p=0.9)\n")
    out = tmp_path / "r.json"
    assert main([str(script), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["risk_ids"]) == len(report["risks"]) >= 2 and "beta_zero" in report["risk_ids"]
