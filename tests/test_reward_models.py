"""Reward models in rewards.functions: a tiny LlamaForSequenceClassification with its own tokenizer, built here.

Scores equal a forward of the same model on the same ids (one sequence at a time, unpadded) for every batch size;
conversations go through the reward model's chat template; the one-line refusals; the trainer scores each
completion once per generated batch, keeps the reward model out of checkpoints and learns what it prefers.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification

from klgrpo.apps.demo.tokenizer import build_char_tokenizer
from klgrpo.config.schema import GRPOConfig
from klgrpo.core.rewards import RewardComputer, RewardModel, RewardModelContext, RewardModelSpec, RewardSpec
from klgrpo.errors import ConfigError, KLGRPOWarning, RewardError
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as names
from klgrpo.train.step_memory import check_step_memory
from tests.helpers.configs import make_config, quiet
from tests.helpers.reward_model import (
    CHAT_TEMPLATE,
    build_reward_model,
    prefers_token,
    rm_tokenizer,
    save_reward_model,
)

PROMPTS = ["12+3=", "7-4=", "99+1=", "0+0=", "5-5="]
COMPLETIONS = ["15", "3", "100", "", "0<eos>"]  # lengths 2, 1, 3, 0 and 6 characters: padding in every batch


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    tokenizer = rm_tokenizer(chat_template=CHAT_TEMPLATE)
    return save_reward_model(tmp_path_factory.mktemp("rm"), build_reward_model(tokenizer, seed=3), tokenizer)


def loaded(spec: RewardModelSpec, **context) -> RewardModel:
    model = RewardModel(spec)
    model.load(RewardModelContext(**context))
    return model


def hand_scores(folder, texts, add_special_tokens=True, label=0, tokenizer=None):
    """One unpadded forward per text, as transformers runs it; ids from the reward model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"]])).logits[0, label]
                .item() for t in texts]


def test_scores_equal_a_hand_forward_for_every_batch_size(rm_dir):
    expected = hand_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    by_size = {}
    for batch_size in (1, 2, 3, len(PROMPTS)):
        by_size[batch_size] = loaded(RewardModelSpec(rm_dir, batch_size=batch_size))(PROMPTS, COMPLETIONS)
        assert by_size[batch_size] == pytest.approx(expected, abs=1e-6, rel=0)
    assert by_size[1] == pytest.approx(by_size[len(PROMPTS)], abs=1e-6, rel=0)  # batching invariance
    # Planted: the policy's tokenizer orders the characters differently, so its ids give other scores.
    other = hand_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)], tokenizer=build_char_tokenizer())
    assert max(abs(a - b) for a, b in zip(other, expected)) > 1e-3


def test_the_computer_logs_the_reward_model_under_its_folder_name_and_weights_it(rm_dir):
    computer = RewardComputer([RewardSpec("format", kwargs={"pattern": "0"}), {"model": rm_dir, "weight": 0.5}])
    computer.load_models(RewardModelContext())
    result = computer(PROMPTS, COMPLETIONS)
    name = rm_dir.rstrip("/").rsplit("/", 1)[-1]
    assert computer.names == ["format", name]
    scores = hand_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert result.per_function[name].tolist() == pytest.approx(scores, abs=1e-6)
    assert result.total.tolist() == pytest.approx([("0" in c) + 0.5 * s for c, s in zip(COMPLETIONS, scores)],
                                                  abs=1e-6)
    assert result.model_seconds > 0


def test_conversations_use_the_reward_models_chat_template(rm_dir):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    model = loaded(RewardModelSpec(rm_dir, batch_size=2))
    tokenizer = model.tokenizer
    rendered = [tokenizer.apply_chat_template(m + [{"role": "assistant", "content": c}], tokenize=False)
                for m, c in zip(conversations, COMPLETIONS)]
    assert rendered[0] == "<user>12+3=</><assistant>15</>"
    assert [text for text, _ in model.render(conversations, COMPLETIONS)] == rendered
    assert model(conversations, COMPLETIONS) == pytest.approx(
        hand_scores(rm_dir, rendered, add_special_tokens=False), abs=1e-6, rel=0)
    # data.as_chat and data.system_prompt: a string prompt is the user's turn after the system message.
    chat = loaded(RewardModelSpec(rm_dir), system_prompt="sys", as_chat=True)
    assert chat.render(["1+1="], ["2"])[0][0] == "<system>sys</><user>1+1=</><assistant>2</>"


def test_a_head_of_several_labels_needs_label_which_picks_its_logit(tmp_path):
    tokenizer = rm_tokenizer()
    model = build_reward_model(tokenizer, num_labels=3)
    model.config.id2label = {0: "bad", 1: "ok", 2: "good"}
    model.config.label2id = {"bad": 0, "ok": 1, "good": 2}
    folder = save_reward_model(tmp_path / "rm3", model, tokenizer)
    with pytest.raises(ConfigError, match=r"has a head of 3 labels \(0: bad, 1: ok, 2: good\); set label") as err:
        RewardModel(RewardModelSpec(folder))
    assert "\n" not in str(err.value)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert loaded(RewardModelSpec(folder, label=2))(PROMPTS, COMPLETIONS) == pytest.approx(
        hand_scores(folder, texts, label=2), abs=1e-6, rel=0)
    assert loaded(RewardModelSpec(folder, label="ok"))(PROMPTS, COMPLETIONS) == pytest.approx(
        hand_scores(folder, texts, label=1), abs=1e-6, rel=0)
    with pytest.raises(ConfigError, match="label 3 is out of range; its head has 3 label"):
        RewardModel(RewardModelSpec(folder, label=3))
    with pytest.raises(ConfigError, match="label 'great' is not one of its labels"):
        RewardModel(RewardModelSpec(folder, label="great"))


def test_a_folder_that_is_not_a_sequence_classifier_is_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="is not a sequence classifier: its config.json names the architectures "
                                          "LlamaForCausalLM") as err:
        RewardComputer([{"model": str(tiny_model_dir)}])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no such folder"):
        RewardComputer([{"model": str(tmp_path / "missing" / "rm")}])


def test_a_checkpoint_without_its_head_is_refused_when_it_loads(rm_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "headless"
    shutil.copytree(rm_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("score")}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model = RewardModel(RewardModelSpec(str(folder)))  # the config is a sequence classifier's
    with pytest.raises(ConfigError, match="its weights lack score.weight, which would start random"):
        model.load(RewardModelContext())


@pytest.mark.parametrize("entry, message", [
    ({"model": "x", "batch_size": 0}, r"rewards.functions\[0\]\.batch_size must be an integer >= 1, got 0"),
    ({"model": "x", "dtype": "fp8"}, r"rewards.functions\[0\]\.dtype is 'fp8'; choose one of: auto, float32, bfloat16, "
                                    "float16"),
    ({"model": "x", "max_length": -1}, "max_length must be an integer >= 0"),
    ({"model": "x", "label": -1}, "label must be a label index"),
    ({"model": "x", "kwargs": {}}, r"rewards.functions\[0\]: reward model entry .*: unknown key 'kwargs'; a reward "
                                  "model entry has model, weight, batch_size"),
    ({"model": "x", "weight": float("inf")}, "weight must be a finite number"),
])
def test_bad_reward_model_entries_are_refused_by_the_config_check(entry, message):
    cfg = GRPOConfig.from_dict({"data": {"source": "x.jsonl"}, "model": {"name_or_path": "m"},
                                "rewards": {"functions": [entry]}})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_says_so(tmp_path):
    tokenizer = rm_tokenizer(pad=False)
    folder = save_reward_model(tmp_path / "nopad", build_reward_model(tokenizer, seed=1), tokenizer)
    model = RewardModel(RewardModelSpec(folder, batch_size=len(PROMPTS)))
    with pytest.warns(KLGRPOWarning, match="has no pad token; padding with '<eos>'"):
        model.load(RewardModelContext())
    assert model.model.config.pad_token_id == model.tokenizer.eos_token_id
    # Unpadded single forwards read the last token; the padded batch must find the same one.
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS[:4])]
    assert model(PROMPTS[:4], COMPLETIONS[:4]) == pytest.approx(
        hand_scores(folder, texts, tokenizer=model.tokenizer), abs=1e-6, rel=0)


def test_an_input_longer_than_the_context_loses_the_left_of_its_prompt_said_once(rm_dir):
    model = loaded(RewardModelSpec(rm_dir, max_length=4, batch_size=2))
    with pytest.warns(KLGRPOWarning, match=r"completion 0 with its prompt is 7 tokens, more than the 4 of the "
                                           r"reward model .*said once") as record:
        scores = model(PROMPTS, COMPLETIONS)
    assert len([w for w in record if issubclass(w.category, KLGRPOWarning)]) == 1
    kept = [(p + c)[-4:] for p, c in zip(PROMPTS, COMPLETIONS[:4])]
    assert scores[:4] == pytest.approx(hand_scores(rm_dir, kept), abs=1e-6, rel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLGRPOWarning)
        model(PROMPTS, COMPLETIONS)  # said once: no second warning


def test_the_context_comes_from_the_model_when_max_length_is_unset(rm_dir):
    assert loaded(RewardModelSpec(rm_dir)).max_length == 64  # max_position_embeddings and model_max_length


def test_a_nan_score_is_refused_naming_the_completion(rm_dir):
    computer = RewardComputer([{"model": rm_dir}])
    computer.load_models(RewardModelContext())
    with torch.no_grad():
        computer.reward_models[0].model.score.weight[0, 0] = float("nan")
    with pytest.raises(RewardError, match=r"^reward model '.*' gave nan for completion 0 \('15'\); every reward "
                                          r"must be finite: check its weights, or score in float32"):
        computer(PROMPTS, COMPLETIONS)


def test_the_memory_check_counts_the_reward_models_weights(rm_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    computer = RewardComputer([{"model": rm_dir}, {"model": rm_dir, "dtype": "bfloat16"}])
    weights = sum(p.numel() for p in loaded(RewardModelSpec(rm_dir)).model.parameters())
    assert computer.reward_model_bytes(RewardModelContext()) == weights * 4 + weights * 2
    cfg = GRPOConfig.from_dict({"rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2}})
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    check_step_memory(cfg, policy, 4, available_bytes=10 ** 9, reward_model_bytes=10 ** 9 - 10 ** 7)
    with pytest.raises(ConfigError, match=r"the rollout needs at least .* \(with the reward models' 0.93 GiB\)"):
        check_step_memory(cfg, policy, 4, available_bytes=10 ** 9, reward_model_bytes=10 ** 9 - 10)
    with pytest.raises(ConfigError, match="the reward models' weights need 1.86 GiB but 0.93 GiB are free"):
        check_step_memory(cfg, policy, 4, available_bytes=10 ** 9, reward_model_bytes=2 * 10 ** 9)


def _count_scored_rows(trainer) -> list[int]:
    rows: list[int] = []
    model = trainer.grpo_step.rewards.reward_models[0].model
    model.register_forward_hook(lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]),
                                with_kwargs=True)
    return rows


def test_the_trainer_scores_each_completion_once_and_checkpoints_without_the_reward_model(
        rm_dir, tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", rewards={"functions": [
                          {"model": rm_dir, "batch_size": 5}]},
                      train={"steps": 4, "num_iterations": 2, "micro_batch_size": 4, "save_every": 4})
    trainer = GRPOTrainer(cfg, log=quiet)
    rows = _count_scored_rows(trainer)
    trainer.train()
    # 2 generated batches of 4 prompts x 4 completions, 5 per forward: 5 + 5 + 5 + 1 each, nothing scored twice.
    assert rows == [5, 5, 5, 1] * 2
    metrics = read_metrics(trainer.run_dir)
    name = names.reward_function(rm_dir.rstrip("/").rsplit("/", 1)[-1])
    generated = [m for m in metrics if names.TIME_REWARD_MODEL in m]
    assert [m["step"] for m in generated] == [1, 3] and all(m[names.TIME_REWARD_MODEL] > 0 for m in generated)
    assert all(name in m for m in metrics)
    files = sorted(p.name for p in (trainer.run_dir / "checkpoints" / "step_4").rglob("*") if p.is_file())
    for weights in (trainer.run_dir / "checkpoints" / "step_4").rglob("*.safetensors"):
        with safe_open(str(weights), "pt") as f:
            assert not [k for k in f.keys() if k.startswith("score")], files
    policy_keys = set(trainer.model.state_dict())
    assert not any(k.startswith("score") for k in policy_keys)


def test_grpo_learns_to_emit_the_token_the_reward_model_prefers(tiny_model_dir, addition_file, tmp_path):
    """The reward model scores the last character: 1 for "7", its embedding's cosine for the others."""
    tokenizer = rm_tokenizer()
    folder = save_reward_model(tmp_path / "rm7", prefers_token(build_reward_model(tokenizer), tokenizer), tokenizer)
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", rewards={"functions": [{"model": folder}]},
                      rollout={"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 4},
                      kl={"coef": 0.0}, train={"steps": 20})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    rewards = [m[names.REWARD] for m in read_metrics(trainer.run_dir)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward model run: mean reward of steps 1-3 {first:.3f}, of steps 18-20 {last:.3f}")
    assert last > first + 0.3 and last > 0.9


def test_the_trl_bridge_takes_a_reward_model_name_or_object_as_trl_does(rm_dir, tmp_path):
    trl = pytest.importorskip("trl")
    from klgrpo.trl import GRPOConfig as BridgeConfig
    from klgrpo.trl import GRPOTrainer as BridgeTrainer
    from tests.helpers.trl_setup import addition_prompts, char_tokenizer, run_args, save_tiny_model

    policy = save_tiny_model(tmp_path / "policy")

    def first_step(trainer_cls, config_cls, reward, out):
        trainer = trainer_cls(model=policy, reward_funcs=[reward], args=config_cls(**run_args(out, max_steps=1)),
                              train_dataset=addition_prompts(), processing_class=char_tokenizer())
        trainer.train()
        return trainer, trainer.state.log_history[0]

    name = rm_dir.rstrip("/").rsplit("/", 1)[-1]
    _, stock = first_step(trl.GRPOTrainer, trl.GRPOConfig, rm_dir, tmp_path / "stock")
    as_object = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    for reward in (rm_dir, as_object):
        bridge, logged = first_step(BridgeTrainer, BridgeConfig, reward, tmp_path / f"bridge_{type(reward).__name__}")
        assert bridge.reward_func_names == [name]
        assert bridge.reward_processing_classes[0].convert_tokens_to_ids("=") == 3  # its own tokenizer's ids
        # The first step samples before any update: the same completions, so the same scores as stock TRL.
        assert logged[f"rewards/{name}/mean"] == pytest.approx(stock[f"rewards/{name}/mean"], abs=1e-6)
        assert logged[f"rewards/{name}/std"] == pytest.approx(stock[f"rewards/{name}/std"], abs=1e-6)


@pytest.mark.slow
def test_two_processes_load_the_reward_model_once_each_and_score_alike(rm_dir, tiny_model_dir, addition_file,
                                                                        tmp_path):
    """accelerate launch, 2 CPU processes (gloo, DDP): each process loads the reward model's weights once for a
    2-step run, and after it both score the same texts with the same numbers, those of one process."""
    import json
    from pathlib import Path

    from tests.helpers.launch import Launch, accelerate_command, launch_env
    from tests.helpers.reward_model_dist_worker import COMPLETIONS as TEXTS_C
    from tests.helpers.reward_model_dist_worker import PROMPTS as TEXTS_P

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 2},
                      rewards={"functions": [{"model": rm_dir, "batch_size": 3}]})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    worker = str(Path(__file__).parent / "helpers" / "reward_model_dist_worker.py")
    done = Launch(accelerate_command("ddp", [worker, str(tmp_path / "cfg.json"), str(tmp_path / "out")]),
                  env=launch_env()).finish(timeout=300)
    assert done.returncode == 0 and not done.timed_out, done.output[-4000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["steps"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    assert [r["loads"] for r in ranks] == [[rm_dir], [rm_dir]]  # once per process, no reload across steps
    assert ranks[0]["scores"] == ranks[1]["scores"]
    one = loaded(RewardModelSpec(rm_dir, batch_size=3))(TEXTS_P, TEXTS_C)
    assert ranks[0]["scores"] == pytest.approx(one, abs=1e-6, rel=0)
    assert len(set(one)) == len(one)  # the texts score differently: equal lists are not a constant
