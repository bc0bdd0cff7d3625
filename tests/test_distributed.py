"""Two CPU processes under ``accelerate launch`` with the shipped DDP and FSDP2 configs, against one process on
the same global batch: the same completions from the same seed (FSDP2: sampled from the gathered weights), the
same reference log-probs (FSDP2: a sharded reference), and after one update the same loss, gradient norm, metrics,
gradient and weights (with the replay anchor on, so its once-per-step gradient is checked too). Then a 2-process
run that writes one checkpoint (full weights loadable by from_pretrained, the optimizer state in the
single-process layout), resumes on 2 processes and on 1; that run evaluates two eval sets before, during and
after training (rank 0 alone generates while the others wait), each number equal to one process evaluating the
same weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klgrpo.backends.weights import named_whole_weights
from klgrpo.config.schema import GRPOConfig
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.dist_worker import full_gradients, sample_slice, update_metrics

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"
EVAL_REWARD = f"{Path(__file__).parent / 'helpers' / 'faults.py'}:completion_checksum"
KINDS = {"ddp": ROOT / "examples" / "accelerate" / "ddp.yaml", "fsdp2": ROOT / "examples" / "accelerate" / "fsdp2.yaml"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config_file, args, timeout=240):
    """``accelerate launch --config_file CONFIG --num_processes 2`` on the CPU, on a port the OS picked; fails with
    the launcher's and the workers' output. No retry (the worker skips the interpreter's teardown, where gloo
    sometimes aborted a rank after its work: tests/helpers/dist_worker.py)."""
    # The CPU even where a GPU is visible: two processes on one GPU is not what these tests compare.
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"accelerate launch timed out after {timeout} s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"accelerate launch exited {proc.returncode}:\n{out[-6000:]}")
    return out


def config_dict(model_dir, reference_dir, data_file, out, **train):
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(data_file)},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
        "kl": {"coef": 0.1, "placement": "both", "reference": str(reference_dir),
               "replay": {"coef": 0.5, "source": str(data_file), "num_prompts": 4, "batch_size": 4}},
        "loss": {"advantage_scale": "batch"},  # needs the rewards of both ranks
        "optim": {"lr": 1e-2, "max_grad_norm": 1e9},
        "train": {"steps": 2, "output_dir": str(out), "micro_batch_size": 4, **train},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }


def single_process_update(cfg_dict, tmp_path):
    """One process: the global batch, the per-slice completions from the worker's seeds, one update."""
    single = GRPOTrainer(GRPOConfig.from_dict(cfg_dict), log=lambda *_: None)
    torch.manual_seed(0)
    batch = single.make_batch()
    assert batch.advantages.abs().sum() > 0
    prompts = [single.grpo_step.dataset[i]["prompt"] for i in range(4)]
    torch.save({"batch": batch, "prompts": prompts}, tmp_path / "batch.pt")
    completions = [sample_slice(single, prompts[2 * r:2 * r + 2], r) for r in range(2)]
    metrics = update_metrics(single, batch)
    return batch, completions, metrics, full_gradients(single.model), single.model.state_dict()


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])  # ddp in the default run
def test_two_processes_match_one_and_checkpoint_resumes_on_two_and_one(kind, perturbed_model_dir, tiny_model_dir,
                                                                        addition_file, tmp_path):
    """One launch per engine (process start-up costs seconds): the update comparison, then the 2-step run."""
    cfg_dict = config_dict(perturbed_model_dir, tiny_model_dir, addition_file, tmp_path / "run")
    single = single_process_update(cfg_dict, tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg_dict))
    train_dict = config_dict(perturbed_model_dir, tiny_model_dir, addition_file, tmp_path / "train_run")
    train_dict["kl"].update(sync_every=1, sync_alpha=1.0)  # the reference becomes the policy after each step
    train_dict["eval"] = {"every": 1, "sets": [
        {"name": "first", "source": str(addition_file), "limit": 6, "reward": EVAL_REWARD},
        {"name": "second", "source": str(addition_file), "limit": 3, "reward": EVAL_REWARD}]}
    (tmp_path / "train.json").write_text(json.dumps(train_dict))
    accelerate_launch(KINDS[kind], [str(WORKER), "both", str(tmp_path / "cfg.json"), str(tmp_path / "batch.pt"),
                                    str(tmp_path / "out.pt"), str(tmp_path / "train.json"),
                                    str(tmp_path / "train_out.json")])
    check_update_matches(kind, torch.load(tmp_path / "out.pt", weights_only=False), *single)
    check_checkpoint_and_resume(kind, train_dict, perturbed_model_dir, json.loads((tmp_path / "train_out.json")
                                                                                   .read_text()), tmp_path)
    check_evaluations_match_one_process(train_dict, perturbed_model_dir)


def check_evaluations_match_one_process(cfg_dict, base_model_dir):
    """Each logged evaluation equals one process's evaluation of the same weights: the base model before
    training, the checkpoint of the step after it (the score is a checksum of every greedy completion)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klgrpo.run.evaluation import evaluate_sets, load_eval_sets

    run = Path(cfg_dict["train"]["output_dir"])
    cfg = GRPOConfig.from_dict(cfg_dict)
    sets = load_eval_sets(cfg)
    rows = [r for r in read_metrics(run) if "eval/first" in r]
    # before, at step 1 (eval.every), after step 2; the resumed run: after step 3
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        if row["step"] == 1:
            continue  # no checkpoint of step 1 to evaluate
        folder = base_model_dir if row["step"] == 0 else run / "checkpoints" / f"step_{row['step']}"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        expected = evaluate_sets(model, AutoTokenizer.from_pretrained(folder), sets, cfg)
        assert {k: row[k] for k in expected} == expected, row["step"]
    assert len({(r["eval/first"], r["eval/second"]) for r in rows}) > 1  # the numbers follow the weights


def check_update_matches(kind, out, batch, completions, metrics, grads, weights):
    assert metrics["kl/replay"] > 0 and metrics["grad_norm"] > 0
    assert (out["kind"], out["world_size"]) == (kind, 2)
    assert out["completions"] == completions  # same seed, same weights: the same tokens
    # FSDP2's reference runs transformers' forward, one process klgrpo's fast path: float32 rounding of two
    # computations of log-probs of size ~3, measured up to 5e-5 apart.
    torch.testing.assert_close(out["ref_logp"], batch.ref_logp, rtol=0, atol=2e-4)
    assert out["metrics"].keys() == metrics.keys()
    for k, v in metrics.items():
        assert out["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert out["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(out["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    print(f"\n{kind} 2 vs 1 process, max abs diff: loss {abs(out['metrics']['train/loss'] - metrics['train/loss']):.3g}"
          f", grad_norm {abs(out['metrics']['grad_norm'] - metrics['grad_norm']):.3g}, gradient "
          f"{max((out['grads'][n] - g).abs().max().item() for n, g in grads.items()):.3g}, weights "
          f"{max((out['weights'][n] - w).abs().max().item() for n, w in weights.items()):.3g}")
    # AdamW's first step moves each weight by lr * g / (|g| + 1e-8), ~1e-2 here: entries whose gradient is near 0
    # turn the ~3e-8 gradient differences into up to ~3e-5. 1e-4 is 1% of a step; a rank's missing or doubled
    # update would be off by ~1e-2.
    for name, w in weights.items():
        torch.testing.assert_close(out["weights"][name], w, rtol=0, atol=1e-4, msg=name)
    # What a vLLM engine is pushed, gathered one tensor at a time, is the full state dict bitwise.
    assert sorted(out["whole_weights"]) == sorted(out["weights"])
    assert all(torch.equal(out["whole_weights"][n], w) for n, w in out["weights"].items())


def check_checkpoint_and_resume(kind, cfg_dict, perturbed_model_dir, out, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = Path(cfg_dict["train"]["output_dir"])
    assert out["kind"] == kind and out["summary"]["world_size"] == 2
    assert out["checkpoints_after_run"] == ["step_2"]  # one folder, written by rank 0
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2, 3]  # resumed on 2 processes
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]

    ckpt = run / "checkpoints" / "step_2"
    # kl.sync_every=1 with alpha 1: the (sharded, under FSDP2) reference was set to the policy after step 2, and
    # the checkpoint holds its gathered weights, which equal the policy's bitwise.
    for step in (2, 3):
        folder = run / "checkpoints" / f"step_{step}"
        synced, policy = load_file(str(folder / "reference" / "model.safetensors")), load_file(
            str(folder / "model.safetensors"))
        assert synced.keys() == policy.keys() and all(torch.equal(synced[k], policy[k]) for k in policy), step
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # the full weights
    reference = AutoModelForCausalLM.from_pretrained(perturbed_model_dir, dtype=torch.float32)
    shapes = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in loaded.state_dict().items()} == shapes
    assert any(not torch.equal(a, b) for a, b in zip(loaded.parameters(), reference.parameters()))  # it trained

    # Resume the 2-process checkpoint on 1 process: weights and full-size AdamW moments load as written.
    one = dict(cfg_dict, train={**cfg_dict["train"], "steps": 3, "output_dir": str(tmp_path / "one")})
    shutil.copytree(run / "checkpoints" / "step_2", tmp_path / "one" / "checkpoints" / "step_2")
    shutil.copy(run / "config.yaml", tmp_path / "one" / "config.yaml")  # the run's record, which a resume continues
    trainer = GRPOTrainer(GRPOConfig.from_dict(one), log=lambda *_: None)
    trainer.resume("latest")
    saved = load_file(str(ckpt / "model.safetensors"))
    for name, p in trainer.model.named_parameters():
        if name in saved:
            assert torch.equal(p.detach(), saved[name]), name
    assert trainer.reference.synced  # and its weights are the synced ones, not kl.reference's
    for name, p in trainer.reference.model.named_parameters():
        if name in saved:
            assert torch.equal(p.detach(), saved[name]), name
    moments = trainer.optimizer.state_dict()["state"]
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(moments) == len(params)
    assert all(moments[i]["exp_avg"].shape == p.shape and moments[i]["exp_avg"].abs().sum() > 0
               for i, p in enumerate(params))
    trainer.train(resume="latest")  # the folder holds a run: continuing it is explicit
    assert [r["step"] for r in read_metrics(tmp_path / "one")][-1] == 3


@pytest.mark.slow
def test_lora_under_fsdp2_trains_checkpoints_and_resumes_on_two_and_one(tiny_model_dir, addition_file, tmp_path):
    """LoRA under FSDP2: the reference is the sharded policy with its adapter disabled; the checkpoint holds the
    adapter (peft format), which resumes on 2 processes and, bitwise, on 1."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    cfg_dict = config_dict(tiny_model_dir, "", addition_file, run)
    cfg_dict["model"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    del cfg_dict["kl"]["replay"], cfg_dict["kl"]["reference"]
    (tmp_path / "cfg.json").write_text(json.dumps(cfg_dict))
    accelerate_launch(KINDS["fsdp2"], [str(WORKER), "train", str(tmp_path / "cfg.json"), str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["kind"] == "fsdp2" and out["checkpoints_after_run"] == ["step_2"]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    adapter = load_file(str(run / "checkpoints" / "step_2" / "adapter_model.safetensors"))
    assert sorted(k.rsplit(".", 2)[-2] for k in adapter) == ["lora_A", "lora_A", "lora_B", "lora_B"]
    assert all(v.abs().sum() > 0 for k, v in adapter.items())  # B starts at 0: trained

    one = dict(cfg_dict, train={**cfg_dict["train"], "steps": 3, "output_dir": str(tmp_path / "one")})
    shutil.copytree(run / "checkpoints" / "step_2", tmp_path / "one" / "checkpoints" / "step_2")
    shutil.copy(run / "config.yaml", tmp_path / "one" / "config.yaml")  # the run's record, which a resume continues
    trainer = GRPOTrainer(GRPOConfig.from_dict(one), log=lambda *_: None)
    trainer.resume("latest")  # load_adapter_weights checks every tensor bitwise
    # The merged weights a vLLM engine was pushed under FSDP2 (each factor gathered on its own) are one
    # process's merge of the same checkpoint, bitwise.
    pushed, merged = torch.load(tmp_path / "out.json.whole.pt"), dict(named_whole_weights(trainer.model))
    assert list(pushed) == list(merged) and all(torch.equal(pushed[n], v) for n, v in merged.items())
    assert trainer.train(resume="latest")["steps"] == 3


@pytest.mark.slow
def test_the_demo_under_fsdp2_evaluates_like_one_process(tmp_path, monkeypatch, capsys):
    """The demo (`klgrpo train`, no model configured: two eval sets, the replay anchor, an adaptive KL) on 2
    processes under fsdp2.yaml runs to the end (it once hung at its first evaluation). Its evaluation before
    training equals one process's (same SFT model), and its evaluation after equals one process evaluating the
    2-process run's final checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klgrpo.apps.cli import main
    from klgrpo.run.evaluation import evaluate_sets, load_eval_sets
    from tests.helpers.launch import Launch, accelerate_command, launch_env

    monkeypatch.setenv("KLGRPO_CACHE", str(tmp_path / "cache"))
    args = ["--train.steps", "2", "--logging.progress", "false", "--logging.plots", "false"]
    assert main(["train", "--output-dir", str(tmp_path / "one"), *args]) == 0  # builds the demo's assets once
    capsys.readouterr()
    run = tmp_path / "two"
    done = Launch(accelerate_command("fsdp2", ["-m", "klgrpo", "train", "--output-dir", str(run), *args]),
                  env=launch_env(KLGRPO_CACHE=str(tmp_path / "cache"))).finish(timeout=600)
    assert done.returncode == 0 and not done.timed_out, done.output[-4000:]
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((run / "summary.json").read_text())
    assert two["world_size"] == 2 and two["steps"] == 2
    assert two["eval_before"] == one["eval_before"] and set(two["eval_before"]) == {"addition", "subtraction"}
    cfg = GRPOConfig.from_yaml(run / "config.yaml")
    final = run / "checkpoints" / "step_2"
    expected = evaluate_sets(AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32),
                             AutoTokenizer.from_pretrained(final), load_eval_sets(cfg), cfg)
    assert {k.removeprefix("eval/"): v for k, v in expected.items() if not k.endswith("/entropy")} == two["eval_after"]
