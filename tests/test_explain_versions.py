"""``klgrpo explain`` by release: the TRL and Unsloth tables (klgrpo/integrations/versions), the version a file
states, --version, one verdict per range where they differ; real Unsloth, launcher fields, YAML floats, Hydra
configs and the risk lines that hold only where their formula does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.integrations.versions import _table, parse_option, profiles, stated_in


def _run(tmp_path, text, name="cfg.yaml", extra=()):
    src = tmp_path / name
    src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"  # a new file each run
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def test_the_trl_table_holds_the_releases_read():
    rows = {row["from"]: row for row in _table("trl")["ranges"]}
    # grpo_config.py at v0.14.0: beta 0.04; grpo_trainer.py: per-sequence mean loss; no ratio on the KL
    assert rows["0.14.0"]["defaults"]["beta"] == 0.04 and rows["0.14.0"]["defaults"]["loss_type"] == "grpo"
    # v0.16.0's trainer divides by the token count (bnpo before the name existed); 0.17 names it bnpo
    assert rows["0.16.0"]["defaults"]["loss_type"] == "bnpo"
    # v0.19.0: beta 0.0; v0.22.0: loss_type dapo, scale_rewards "group"
    assert rows["0.19.0"]["defaults"]["beta"] == 0.0
    assert rows["0.22.0"]["defaults"]["loss_type"] == "dapo" and rows["0.22.0"]["defaults"]["scale_rewards"] == "group"
    # v0.26.0: use_bias_correction_kl exists (default false) and the trainer multiplies the KL by coef_1
    assert rows["0.26.0"]["kl_weight_field"] == "use_bias_correction_kl"
    assert rows["0.26.0"]["defaults"]["use_bias_correction_kl"] is False and rows["0.22.0"]["kl_weight_field"] is None
    # 1.10.0: its default turns true
    assert rows["1.10.0"]["defaults"]["use_bias_correction_kl"] is True
    assert all("grpo_config.py" in r["read"][0] and "0" in r["read"][0] for r in rows.values())
    assert "max_prompt_length" in rows["0.18.0"]["removed_since"]
    assert "use_bias_correction_kl" in rows["0.22.0"]["absent"]


def test_pins_and_imports_bound_the_release():
    assert [str(c) for c in stated_in('!pip install "trl[vllm]==0.18.0" unsloth')["trl"]] == ["==0.18.0"]
    assert [str(c) for c in stated_in("trl>=0.19,<0.22\n")["trl"]] == [">=0.19", "<0.22"]
    # trl.experimental arrived in 0.24, its openenv module in 0.26: both bounds hold
    assert [str(c) for c in stated_in("from trl.experimental.openenv import x\n")["trl"]] == [">=0.24.0", ">=0.26.0"]
    assert stated_in("import openrlhf_trl==1.0\nmy_trl==2\n") == {}
    labels = [p.label for p in profiles("trl", parse_option("trl>=0.19,<0.22"))]
    assert labels == ["TRL >= 0.19.0, < 0.22.0"]


def test_version_picks_the_range_and_an_unknown_version_gets_every_answer(tmp_path, capsys):
    # beta 0.04 alone: TRL 0.18 (bnpo, no ratio on k3) -> forward; TRL 1.16 (ratio, default true) -> reverse
    status, report = _run(tmp_path, "beta: 0.04\n", extra=["--version", "trl==0.18"])
    assert status == 0 and report["gradient"]["token_on_policy"] == "forward"
    assert report["aggregation"]["name"] == "token_mean" and report["releases"] == ["TRL >= 0.18.0, < 0.19.0"]
    status, report = _run(tmp_path, "beta: 0.04\n", extra=["--version", "trl==1.16.0"])
    assert report["gradient"]["token_on_policy"] == "reverse"
    capsys.readouterr()
    status, report = _run(tmp_path, "beta: 0.04\n")
    assert status == 0
    answers = [(v["releases"], v["gradient"]["token_on_policy"], v["aggregation"]["name"]) for v in report["versions"]]
    # TRL 0.16 and 0.17 default top_k to 50 (0.14 and 0.15 sample with transformers' default 50): a risk line of
    # their own sets them apart from 0.18 - 1.9
    assert answers == [(["TRL 1.10.0 or later"], "reverse", "token_mean"),
                       (["TRL >= 0.18.0, < 1.10.0"], "forward", "token_mean"),
                       (["TRL >= 0.16.0, < 0.18.0"], "forward", "token_mean"),
                       (["TRL >= 0.14.0, < 0.16.0"], "forward", "seq_mean_token_mean")]
    assert "which do you run?" in capsys.readouterr().out.splitlines()[-1]


def test_a_field_of_later_releases_rules_the_earlier_out(tmp_path):
    # use_bias_correction_kl exists from 0.26; set true, both later ranges weigh k3 by the ratio: one answer
    status, report = _run(tmp_path, "beta: 0.04\nuse_bias_correction_kl: true\n")
    assert status == 0 and "versions" not in report and report["gradient"]["token_on_policy"] == "reverse"
    assert report["releases"] == ["TRL 0.26.0 or later"]
    # asked for a release without the field: one line naming it
    assert main([str(tmp_path / "cfg.yaml"), "--version", "trl==0.18"]) == 2


UNSLOTH_SCRIPT = '''# pip install unsloth==2025.10.1 trl==0.22.2
from unsloth import FastLanguageModel, PatchFastRL
PatchFastRL("GRPO", FastLanguageModel)
from trl import GRPOConfig
args = GRPOConfig(loss_type="dr_grpo", num_generations=4)
'''


def test_real_unsloth_uses_its_defaults_and_its_loss(tmp_path):
    status, report = _run(tmp_path, UNSLOTH_SCRIPT, "train.py")
    assert status == 0 and report["source"] == "unsloth"
    # Unsloth 2025.10 writes beta 0.001 (unsloth/models/rl.py); unsloth_zoo's k3 has no ratio -> forward;
    # dr_grpo divides by completions x max length (constant); Unsloth turns scale_rewards True into False
    assert report["controller"] == "fixed at 0.001" and report["gradient"]["token_on_policy"] == "forward"
    assert report["aggregation"]["name"] == "constant" and report["config"]["loss"]["advantage_scale"] == "none"
    assert "scale_rewards" in report["unmapped"]


def test_a_git_install_of_trl_states_its_release(tmp_path):
    git = '"trl @ git+https://github.com/huggingface/trl.git@{}",'
    # a release tag: that release
    assert [str(c) for c in stated_in(git.format("v0.18.1"))["trl"]] == ["==0.18.1"]
    # open-r1's 3f9d75a pin: trl.json's commits row says its grpo_config.py and grpo_trainer.py (0.16.0.dev0) have
    # the 0.16 range's rules (the token-mean loss line, beta 0.04, temperature 0.9); a 7-character prefix too
    for ref in ("013d360b8f2703d3546786fa124f3204d6cd8018", "013d360"):
        assert [str(c) for c in stated_in(git.format(ref))["trl"]] == [">=0.16.0", "<0.18.0"]
    assert [str(c) for c in stated_in(git.format("6f99f42f72"))["trl"]] == [">=0.14.0", "<0.16.0"]
    # a branch, or a commit the table does not hold: no release stated (every range is explained)
    assert stated_in(git.format("main")) == {} and stated_in(git.format("0123456789abcdef")) == {}


def test_the_pinned_commits_were_read_at_the_commit():
    commits = _table("trl")["commits"]
    assert commits["013d360b8f2703d3546786fa124f3204d6cd8018"]["version"] == "0.16.0.dev0"
    assert all(row["read"].endswith(f"at commit {sha}") for sha, row in commits.items())
    assert {row["range_from"] for row in commits.values()} == {"0.14.0", "0.16.0"}


def test_the_loss_line_is_the_loss_assignment_not_the_kl_metric():
    tool = _tool("trl_versions")
    # TRL at 013d360b: a token-mean loss, then the KL metric in the per-sequence form
    trainer = ("        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()\n"
               "    mean_kl = ((per_token_kl * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()\n")
    assert tool.trainer_facts(trainer)["implicit_loss_type"] == "bnpo"
    grpo = "        loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()\n"
    assert tool.trainer_facts(grpo)["implicit_loss_type"] == "grpo"


def test_version_can_be_the_projects_setup_py(tmp_path, capsys):
    pins = Path(__file__).resolve().parent / "data" / "explain_pins"
    recipes = Path(__file__).resolve().parent / "data" / "explain_real"
    listed = {line.split(" | ")[0] for line in (pins / "SOURCES").read_text().splitlines() if line.strip()}
    assert listed == {p.name for p in pins.iterdir() if p.name != "SOURCES"}
    for commit, releases in (("3f9d75a", ["TRL >= 0.16.0, < 0.18.0"]), ("bf08f56", ["TRL >= 0.16.0, < 0.18.0"]),
                             ("b806e10", ["TRL >= 0.18.0, < 0.19.0"])):
        recipe = recipes / f"openr1_{commit}_qwen2.5-1.5b_config_demo.yaml"
        out = tmp_path / f"{commit}.json"
        assert main([str(recipe), "--version", str(pins / f"openr1_{commit}_setup.py"), "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert "versions" not in report and report["releases"] == releases, (commit, report["releases"])
        # beta 0.04 default, k3 without the ratio in every one of these ranges: forward (tests/test_explain_real.py)
        assert report["gradient"]["token_on_policy"] == "forward" and report["controller"] == "fixed at 0.04"
    capsys.readouterr()
    nothing = tmp_path / "requirements.txt"
    nothing.write_text("torch==2.5\n")
    assert main([str(recipes / "openr1_b806e10_qwen2.5-1.5b_config_demo.yaml"), "--version", str(nothing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pins no TRL, Unsloth, verl or OpenRLHF release" in err


def _tool(name):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_verl_table_holds_the_releases_read():
    rows = {row["from"]: row for row in _table("verl")["ranges"]}
    assert list(rows) == ["0.1", "0.2", "0.4.0", "0.6.0", "0.8.0", "0.9.0"]
    # v0.1: no KL loss yet; ray_trainer.py calls apply_kl_penalty on every batch; kl_penalty: kl, abs, mse
    assert "actor_rollout_ref.actor.use_kl_loss" not in rows["0.1"]["defaults"] and rows["0.1"]["reward_kl"] == "always"
    assert rows["0.1"]["estimators"] == {"kl": "k1 = l", "abs": "abs = |l|", "mse": "k2 = l^2 / 2",
                                         "full": "raises NotImplementedError"}
    # v0.2 - v0.3: use_kl_loss (default False) and the reward KL whenever it is off: verl's default puts the KL in
    # the reward; low_var_kl: ratio - kl - 1 with kl = ref - logp, clamped to [-10, 10]
    assert rows["0.2"]["reward_kl"] == "whenever actor.use_kl_loss is false"
    assert rows["0.2"]["defaults"]["actor_rollout_ref.actor.kl_loss_type"] == "low_var_kl"
    assert rows["0.2"]["estimators"]["low_var_kl"] == "k3 = exp(-l) - 1 + l, clamped to [-10, 10]"
    # v0.4.0: algorithm.use_kl_in_reward (default False), the adaptive controller's target and horizon, k1/k2/k3
    assert rows["0.4.0"]["reward_kl"] == "with algorithm.use_kl_in_reward"
    assert rows["0.4.0"]["defaults"]["algorithm.use_kl_in_reward"] is False
    assert rows["0.4.0"]["defaults"]["algorithm.kl_ctrl.target_kl"] == 0.1
    assert rows["0.4.0"]["estimators"]["k3"] == rows["0.4.0"]["estimators"]["low_var_kl"]
    # v0.6.0 on: names ending in "+" exist, and kl_penalty_forward, given the name with its "+", raises
    assert rows["0.6.0"]["estimators"]["k3+"] == "raises NotImplementedError" and rows["0.6.0"]["to"] == "0.8.0"
    # v0.8.0: kl_penalty strips the "+" and returns k2's square with k3's value put in through .detach(); "mse+"
    # is k2 itself; main_ppo_sync.py is a second Hydra trainer beside main_ppo.py
    assert rows["0.8.0"]["estimators"]["k3+"] == "k3 = exp(-l) - 1 + l, clamped to [-10, 10]; gradient of k2"
    assert rows["0.8.0"]["estimators"]["kl+"] == "k1 = l; gradient of k2" and rows["0.8.0"]["estimators"][
        "mse+"] == "k2 = l^2 / 2"
    assert rows["0.8.0"]["entry_points"] == ["verl.trainer.main_ppo", "verl.trainer.main_ppo_sync"]
    # v0.9.0: main_ppo_sync.py is gone (main_ppo.py runs the new trainer); every release: "full" raises
    assert rows["0.9.0"]["entry_points"] == ["verl.trainer.main_ppo"] and rows["0.9.0"]["to"] is None
    assert all(r["estimators"]["full"] == "raises NotImplementedError" for r in rows.values())
    assert all(read.startswith("volcengine/verl ") and " at tag v" in read for r in rows.values() for read in r["read"])


def test_the_openrlhf_table_holds_the_releases_read():
    rows = {row["from"]: row for row in _table("openrlhf")["ranges"]}
    flags = {v: {k: (d["flag"], d["default"]) for k, d in rows[v]["defaults"].items()} for v in rows}
    # examples/train_ppo_ray.py before v0.3.6: --init_kl_coef 0.02, the KL in the reward, k1 only
    assert flags["0.0.1"]["init_coef"] == ("--init_kl_coef", 0.02) and rows["0.0.1"]["reward_kl"] == "always"
    assert rows["0.0.1"]["estimators"] == {"k1": "k1 = l"}
    assert flags["0.3.6"]["init_coef"] == ("--init_kl_coef", 0.01)  # openrlhf/cli/train_ppo_ray.py
    assert flags["0.4.6"]["estimator"] == ("--use_kl_estimator_k3", False)
    assert rows["0.4.6"]["estimators"]["k3"] == "k3 = exp(-l) - 1 + l"  # no clamp yet
    assert rows["0.6.0"]["reward_kl"] == "unless --use_kl_loss"
    assert flags["0.6.0.post1"]["estimator"] == ("--kl_estimator", "k1") and "k2" in rows["0.6.0.post1"]["estimators"]
    assert "horizon" not in flags["0.6.0.post1"] and flags["0.7.1"]["horizon"] == ("--kl_horizon", 10000)
    # v0.8.6: compute_approx_kl clamps every estimator to [-10, 10]; v0.10.2: the --algo.kl.* names
    assert rows["0.8.6"]["estimators"]["k1"] == "k1 = l, clamped to [-10, 10]"
    assert flags["0.10.2"]["use_loss"] == ("--algo.kl.use_loss", False) and rows["0.10.2"]["to"] is None
    assert rows["0.10.2"]["reward_kl"] == "unless --algo.kl.use_loss"


@pytest.mark.parametrize("name, header", [("verl", "| verl | the KL in the reward"),
                                          ("openrlhf", "| OpenRLHF | the KL in the reward")])
def test_the_docs_verl_and_openrlhf_tables_are_the_data(name, header):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "explain.md").read_text()
    lines = docs[docs.index(header):].split("\n\n")[0].splitlines()[2:]
    ranges = _table(name)["ranges"]
    assert len(lines) == len(ranges)
    before: dict = {"estimators": {}, "defaults": {}}
    for line, rng in zip(lines, ranges):
        cells = line.strip("|").split(" | ")
        span = rng["from"] if rng["from"] == rng["last_read"] else f"{rng['from']} - {rng['last_read']}"
        assert cells[0].strip() == span
        # a row states a clamp where the data has one, and where it first appears
        clamped = [any("clamped to [-10, 10]" in f for f in r["estimators"].values()) for r in (before, rng)]
        assert "clamped to [-10, 10]" not in line or clamped[1], line
        assert "clamped to [-10, 10]" in line or not clamped[1] or clamped[0], line
        # a flag's number is stated where it first appears or changes (OpenRLHF's rows)
        for what, flag in rng["defaults"].items():
            if isinstance(flag, dict) and isinstance(flag["default"], (int, float)) and not isinstance(
                    flag["default"], bool) and before["defaults"].get(what) != flag:
                assert f"`{flag['flag']}` {flag['default']:g}" in line, (line, flag)
        before = rng


def test_the_estimator_reader_names_what_a_function_computes():
    import torch

    formula = _tool("rl_versions").formula
    assert formula(lambda l: l) == "k1 = l" and formula(lambda l: l * l / 2) == "k2 = l^2 / 2"
    assert formula(lambda l: (torch.exp(-l) - 1 + l).clamp(-10, 10)) == "k3 = exp(-l) - 1 + l, clamped to [-10, 10]"
    # verl's straight-through "+": k3's value, k2's gradient
    k2 = lambda l: 0.5 * l * l  # noqa: E731
    plus = lambda l: k2(l) - k2(l).detach() + (torch.exp(-l) - 1 + l).detach()  # noqa: E731
    assert formula(plus) == "k3 = exp(-l) - 1 + l; gradient of k2"
    # planted: the sign of k3's log-ratio flipped (exp(l) - 1 - l, the forward-KL form) is none of them
    assert formula(lambda l: torch.exp(l) - 1 - l) == "none of k1, k2, k3, |l|"

    def unknown(l):
        raise NotImplementedError

    assert formula(unknown) == "raises NotImplementedError"


def test_the_adaptive_kl_fork_keeps_a_name_of_its_own(tmp_path):
    text = "beta: 0.04\nkl_adaptation_method: dynamic\n"
    status, report = _run(tmp_path, text)
    assert status == 0 and report["source"] == "adaptive_kl"
    assert main([str(tmp_path / "cfg.yaml"), "--from", "unsloth"]) == 2  # real Unsloth has no such field


def test_a_notebook_is_read_with_its_pins(tmp_path):
    cells = [{"cell_type": "code", "source": ["!pip install trl==0.18.0\n"]},
             {"cell_type": "markdown", "source": "GRPOConfig(beta=9)"},
             {"cell_type": "code", "source": ["from trl import GRPOConfig\n", "args = GRPOConfig(beta=0.04)\n"]}]
    status, report = _run(tmp_path, json.dumps({"cells": cells, "nbformat": 4}), "nb.ipynb")
    assert status == 0 and report["gradient"]["token_on_policy"] == "forward"
    assert report["controller"] == "fixed at 0.04" and report["releases"] == ["TRL >= 0.18.0, < 0.19.0"]


def test_a_shell_line_in_a_notebook_stays_a_statement_at_its_indentation(tmp_path):
    # Colab's install cell: a `!pip` line is the only body of an `if`, a `%%capture` line opens the cell, and a
    # shell line continued with a backslash runs on; as comments they would leave the `if` empty
    install = ("%%capture\nimport os\nif 'COLAB_' not in ''.join(os.environ):\n    !pip install trl==0.18.0 \\\n"
               "        unsloth_zoo\nelse:\n    %env X=1\n")
    cells = [{"cell_type": "code", "source": install},
             {"cell_type": "code", "source": "%%bash\nif then fi\n"},
             {"cell_type": "code", "source": ["from trl import GRPOConfig\n", "args = GRPOConfig(beta=0.04)\n"]}]
    status, report = _run(tmp_path, json.dumps({"cells": cells, "nbformat": 4}), "nb.ipynb")
    assert status == 0 and report["source"] == "trl" and report["controller"] == "fixed at 0.04"
    assert report["releases"] == ["TRL >= 0.18.0, < 0.19.0"]


@pytest.mark.parametrize("cells, said", [
    ([{"cell_type": "code", "source": "x = 1\n"}, {"cell_type": "code", "source": "def f(:\n"}],
     "nb.ipynb: code cell 2, line 1: not valid Python ("),
    ([{"cell_type": "code", "source": [1, 2]}], "nb.ipynb: code cell 1: its source is list [1, 2], not text"),
    ([{"cell_type": "code", "source": {"a": 1}}], "nb.ipynb: code cell 1: its source is dict {'a': 1}, not text"),
])
def test_a_notebook_that_does_not_parse_is_said_as_a_notebook(tmp_path, capsys, cells, said):
    status, _ = _run(tmp_path, json.dumps({"cells": cells, "nbformat": 4}), "nb.ipynb")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and said in err and "YAML" not in err, err


def test_a_notebook_over_the_size_limit_is_one_line_naming_it(tmp_path, capsys):
    from klgrpo.apps.explain.reading import MAX_BYTES

    # a plot's PNG output makes a notebook large though its GRPOConfig cell is small
    cells = [{"cell_type": "code", "source": ["args = GRPOConfig(beta=0.04)\n"],
              "outputs": [{"output_type": "display_data", "data": {"image/png": "A" * MAX_BYTES}}]}]
    status, _ = _run(tmp_path, json.dumps({"cells": cells, "nbformat": 4}), "nb.ipynb")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"more than the {MAX_BYTES} a notebook can be; its outputs count: clear them" in err


def test_launcher_fields_are_named_and_unknown_fields_listed_in_one_line(tmp_path, capsys):
    recipe = "beta: 0.04\nsystem_prompt: hi\ncosine_max_len: 1000\nreward_funcs: [accuracy]\n"
    status, report = _run(tmp_path, recipe, extra=["--version", "trl==0.18.0"])
    assert status == 0 and "open-r1's launcher field" in report["unmapped"]["system_prompt"]
    assert "changes training" in report["unmapped"]["cosine_max_len"]
    capsys.readouterr()
    status, _ = _run(tmp_path, recipe + "betta: 1\nnum_generatoins: 4\n", extra=["--version", "trl==0.18.0"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "'betta'" in err and "'num_generatoins'" in err


def test_yaml_floats_are_numbers_and_hydra_configs_are_verl(tmp_path):
    status, report = _run(tmp_path, "learning_rate: 1e-6\n", extra=["--version", "trl==1.16.0"])
    assert report["config"]["optim"]["lr"] == 1e-6
    hydra = "defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\nactor_rollout_ref:\n  actor:\n    optim:\n" \
            "      lr: 1e-6\n"
    status, report = _run(tmp_path, hydra)
    assert status == 0 and report["source"] == "verl" and report["config"]["optim"]["lr"] == 1e-6


VERL = "algorithm:\n  adv_estimator: {estimator}\nactor_rollout_ref:\n  rollout:\n    n: 4\n  actor:\n" \
       "    use_kl_loss: true\n    kl_loss_coef: {coef}\n    kl_loss_type: k2\n"


@pytest.mark.parametrize("estimator, risk", [("grpo", True), ("rloo", False), ("remax", False),
                                             ("reinforce_plus_plus", False), ("gae", False)])
def test_the_epsilon_risk_only_where_a_group_std_divides(tmp_path, estimator, risk):
    status, report = _run(tmp_path, VERL.format(estimator=estimator, coef=0.001))
    assert status == 0
    assert ("advantage_epsilon" in report["risk_ids"]) is risk


def test_beta_zero_has_no_kl_value_line_and_klgrpo_rules_are_not_the_sources(tmp_path, capsys):
    status, report = _run(tmp_path, VERL.format(estimator="gae", coef=0.0).replace("n: 4", "n: 1"))
    printed = capsys.readouterr().out
    assert "KL value" not in printed and "no counterpart: (klgrpo" not in printed
    assert "klgrpo rule (for the config below, not the source's): rollout.group_size" in printed
    status, report = _run(tmp_path, VERL.format(estimator="grpo", coef=0.001))
    assert "KL value: k2" in capsys.readouterr().out


def test_the_docs_release_table_is_the_data():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "explain.md").read_text()
    table = docs[docs.index("| TRL | beta"):].split("\n\n")[0]  # the TRL table (verl's and OpenRLHF's follow)
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 0.") or line.startswith("| 1.")]
    firsts = [tuple(int(x) for x in row[0][2:].split(" ")[0].rstrip(",").split(".")) for row in rows]
    for rng in _table("trl")["ranges"]:
        start = tuple(int(x) for x in rng["from"].split(".")[:2])
        row = rows[max(i for i, first in enumerate(firsts) if first <= start)]
        defaults = rng["defaults"]
        assert float(row[1]) == defaults["beta"], rng
        assert (defaults["loss_type"] in row[2]) or (defaults["loss_type"] == "grpo" and "per-sequence" in row[2])
        weight = rng["kl_weight_field"]
        expected = "none" if weight is None else f"default {str(defaults['use_bias_correction_kl']).lower()}"
        assert expected in row[3], (rng["from"], row)


@pytest.mark.parametrize("line, named", [("beta: .nan", "beta must be a finite number"),
                                         ("beta: .inf", "beta must be a finite number"),
                                         ("beta: -0.5", "beta must be >= 0"),
                                         ("loss_type: magic", "loss_type 'magic' is none of TRL's"),
                                         ("top_entropy_quantile: 2.0", "top_entropy_quantile must be in [0, 1]")])
def test_invalid_values_are_refused_in_one_line(tmp_path, capsys, line, named):
    status, _ = _run(tmp_path, line + "\n", extra=["--version", "trl==1.16.0"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and named in err


def test_run_options_and_rows_out_of_bounds_are_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    assert main(["--run", str(tmp_path), "--warn-above", "nan"]) == 2
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "klgrpo explain: --warn-above must be a finite number >= 0 (a KL per token), got nan"
    assert len(err) == 2 and "nests too deeply" in err[1]


@pytest.mark.parametrize("keywords, releases", [
    # unsloth/models/rl.py: vllm_sampling_params and unsloth_num_chunks from 2025.2.13 (in every Unsloth range
    # whose TRL allows a beta of 0.04 with a token-mean loss: the two newest give one answer)
    ("vllm_sampling_params=sp, unsloth_num_chunks=-1, loss_type='bnpo'",
     ["Unsloth >= 2025.6.5, < 2025.9.1 (with TRL >= 0.16.0, < 0.26.0)",
      "Unsloth 2025.9.1 or later (with TRL >= 0.18.0, < 0.26.0)"]),
    # unsloth_grpo_mini_batch from 2026.1.2: only the range that holds it
    ("unsloth_grpo_mini_batch=4", ["Unsloth 2025.9.1 or later (with TRL >= 0.18.0, < 0.26.0)"]),
])
def test_unsloths_own_config_fields_make_a_script_unsloths(tmp_path, keywords, releases):
    # no `import unsloth` (the cell that imports it is elsewhere): TRL's GRPOConfig refuses these fields, so the
    # call runs on Unsloth's patched class: Unsloth's loss, k3 without the ratio: forward
    text = f"from trl import GRPOConfig\nsp = None\nargs = GRPOConfig(beta=0.04, {keywords})\n"
    status, report = _run(tmp_path, text, "train.py")
    assert status == 0 and report["source"] == "unsloth" and "versions" not in report
    assert report["releases"] == releases and report["controller"] == "fixed at 0.04"
    assert report["gradient"]["token_on_policy"] == "forward"
    assert {"unsloth_num_chunks", "unsloth_grpo_mini_batch"} & set(keywords.replace("=", " ").split()) <= set(
        report["ignored"])
    if "vllm_sampling_params" in keywords:
        assert "replace the config's" in report["unmapped"]["vllm_sampling_params"]


def test_a_default_that_changed_between_releases_is_said_with_the_release(tmp_path, capsys):
    # trl.json (grpo_config.py per tag): use_bias_correction_kl False until 1.10.0 sets it True (its field exists
    # from 0.26.0; before it the trainer never weighs the KL: False); beta 0.04 until 0.19.0's 0.0; loss_type
    # grpo, bnpo from 0.16.0, dapo from 0.22.0. The file sets beta, so beta is no changed default of its
    status, report = _run(tmp_path, "beta: 0.04\n")
    changes = {line.split(":")[0]: line for line in report["default_changes"]}
    assert changes["use_bias_correction_kl"] == "use_bias_correction_kl: False from TRL 0.14.0, True from TRL 1.10.0"
    assert changes["loss_type"] == "loss_type: 'grpo' from TRL 0.14.0, 'bnpo' from TRL 0.16.0, 'dapo' from TRL 0.22.0"
    assert "beta" not in changes
    capsys.readouterr()
    assert main([str(tmp_path / "cfg.yaml")]) == 0
    assert "use_bias_correction_kl: False from TRL 0.14.0, True from TRL 1.10.0" in capsys.readouterr().out
    # one release: nothing changed
    status, report = _run(tmp_path, "beta: 0.04\n", extra=("--version", "trl==1.10"))
    assert report["default_changes"] == []
