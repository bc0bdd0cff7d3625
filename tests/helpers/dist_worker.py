"""Run under ``accelerate launch`` with 2 CPU processes (an examples/accelerate config: DDP, FSDP2 or DeepSpeed).

``update CONFIG BATCH OUT``: each rank samples its slice of prompts under the engine's full weights, computes the
reference log-probs of its shard of a saved global batch, then runs one optimizer update on that shard through
the trainer's own path; rank 0 writes completions, reference log-probs, metrics, the full gradient, the
updated weights and the weights a vLLM engine would be pushed (gathered tensor by tensor) for the test to
compare with one process.

``train CONFIG OUT``: a 2-step run (checkpoint at the end), then a second trainer resumes it to step 3 on the
same 2 processes; rank 0 writes what the first run left in checkpoints/, and (OUT.whole.pt) the weights a vLLM
engine would have been pushed at the end of the first run.

``both UPDATE_CONFIG BATCH UPDATE_OUT TRAIN_CONFIG TRAIN_OUT``: the two above in one launch.

``deepspeed UPDATE_CONFIG BATCH UPDATE_OUT TRAIN_CONFIG TRAIN_OUT RESUMED_OUT``: ``both``, then a trainer resumes
the run's last checkpoint and runs one update on its shard of the saved global batch; rank 0 writes the weights
after the resume and after that update.

``sharded CONFIG ONE_CHECKPOINT OUT``: a 2-step run with train.sharded_checkpoints (step_1 sharded, step_2
whole); a second trainer resumes the sharded step_1 and rank 0 saves the full weights and AdamW moments it
holds; a third continues from step_1 to step 2 and rank 0 records whether its step_2 weights equal the first
run's bitwise; a fourth resumes ONE_CHECKPOINT (written by one process) and rank 0 saves what it holds.
"""

import json
import os
import sys

import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.core.rollout import SamplingParams, generate_groups
from klgrpo.run.trainer import GRPOTrainer

SAMPLING_SEED = 1234


def sample_slice(trainer, prompts, rank):
    """Completions of ``prompts`` (this rank's slice) from seed SAMPLING_SEED + rank."""
    cfg = trainer.cfg
    torch.manual_seed(SAMPLING_SEED + rank)
    with trainer.engine.full_weights(trainer.model):
        out = generate_groups(trainer.model, trainer.tokenizer, prompts, SamplingParams(
            group_size=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature))
    return out.completions


def full_gradients(model) -> dict[str, torch.Tensor]:
    """name -> full gradient (collective under FSDP2: every rank calls)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def full_weights(trainer) -> dict[str, torch.Tensor]:
    state = trainer.engine.full_state_dict(trainer.model)
    state = trainer.model.state_dict() if state is None else state
    return {k: v.detach().clone() for k, v in state.items()}


def whole_weights(trainer) -> dict[str, torch.Tensor]:
    """What a vLLM engine would be pushed: the engine's tensor-by-tensor gathering (collective under FSDP2)."""
    return {k: v.detach().clone() for k, v in trainer.engine.whole_weights(trainer.model)}


def update_metrics(trainer, batch) -> dict[str, float]:
    metrics, _ = trainer.grpo_step.update(batch)
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def run_update(config_file, batch_file, out_file):
    cfg = GRPOConfig.from_dict(json.loads(open(config_file).read()))
    trainer = GRPOTrainer(cfg, log=lambda *_: None)
    d = trainer.dist
    assert d.world_size == 2, f"expected 2 processes, got {d.world_size}"
    batch = torch.load(batch_file, weights_only=False)
    prompts = batch["prompts"]
    completions = d.gather_objects(sample_slice(trainer, prompts[d.local_slice(len(prompts))], d.rank))
    shard = batch["batch"].rows(d.local_slice(batch["batch"].rollout.size))
    ref_logp = trainer.reference.logprobs(shard.rollout, cfg.rollout.temperature, cfg.train.micro_batch_size)
    ref_logp = d.gather(ref_logp)
    metrics = update_metrics(trainer, shard)
    grads, weights = full_gradients(trainer.model), full_weights(trainer)
    whole = whole_weights(trainer)
    if d.is_main:
        torch.save({"kind": trainer.engine.kind, "world_size": d.world_size, "completions": completions,
                    "ref_logp": ref_logp, "metrics": metrics, "grads": grads, "weights": weights,
                    "whole_weights": whole}, out_file)


def run_train(config_file, out_file):
    raw = json.loads(open(config_file).read())
    trainer = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    summary = trainer.train()
    whole = whole_weights(trainer)
    if trainer.dist.is_main:
        torch.save(whole, out_file + ".whole.pt")
    folders = sorted(os.listdir(trainer.run_dir / "checkpoints"))
    raw["train"]["steps"] = 3
    resumed = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    resumed.train(resume="latest")
    if trainer.dist.is_main:
        with open(out_file, "w") as f:
            json.dump({"kind": trainer.engine.kind, "summary": summary, "checkpoints_after_run": folders}, f)


def run_both(update_config, batch_file, update_out, train_config, train_out):
    """Both in one launch (each launch costs seconds of process start-up)."""
    run_update(update_config, batch_file, update_out)
    run_train(train_config, train_out)


def run_resumed_update(config_file, batch_file, out_file):
    """Resume the run's latest checkpoint, then one update on this rank's shard of the saved global batch; rank 0
    writes the weights right after the resume and after the update."""
    cfg = GRPOConfig.from_dict(json.loads(open(config_file).read()))
    trainer = GRPOTrainer(cfg, log=lambda *_: None)
    trainer.resume("latest")
    resumed = full_weights(trainer)
    moments = trainer.engine.optimizer_state_dict(trainer.optimizer).get("state", {})  # collective under ZeRO
    d = trainer.dist
    batch = torch.load(batch_file, weights_only=False)["batch"]
    metrics = update_metrics(trainer, batch.rows(d.local_slice(batch.rollout.size)))
    updated = full_weights(trainer)
    if d.is_main:
        torch.save({"resumed": resumed, "moments": moments, "metrics": metrics, "weights": updated}, out_file)


def run_deepspeed(update_config, batch_file, update_out, train_config, train_out, resumed_out):
    """``both``, then an update after resuming the 2-process run's last checkpoint, in one launch."""
    run_both(update_config, batch_file, update_out, train_config, train_out)
    run_resumed_update(train_config, batch_file, resumed_out)


def full_training_state(trainer) -> dict:
    """The full weights and the optimizer state in the single-process layout (collective under FSDP2)."""
    return {"weights": full_weights(trainer),
            "optimizer": trainer.engine.optimizer_state_dict(trainer.optimizer)["state"]}


def run_sharded(config_file, one_checkpoint, out_file):
    from safetensors.torch import load_file

    raw = json.loads(open(config_file).read())
    first = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    assert first.dist.world_size == 2
    first.train()
    run = first.run_dir / "checkpoints"
    layout = {name: sorted(os.listdir(run / name)) for name in sorted(os.listdir(run))}
    uninterrupted = load_file(str(run / "step_2" / "model.safetensors"))
    at_step_1 = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    at_step_1.resume(str(run / "step_1"))
    two = full_training_state(at_step_1)
    again = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    again.train(resume=str(run / "step_1"))
    continued = load_file(str(run / "step_2" / "model.safetensors"))
    from_one = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
    from_one.resume(one_checkpoint)
    one = full_training_state(from_one)
    if first.dist.is_main:
        torch.save({"layout": layout, "two_at_step_1": two, "one_resumed_on_two": one,
                    "continued_equals_uninterrupted": uninterrupted.keys() == continued.keys() and all(
                        torch.equal(uninterrupted[k], continued[k]) for k in uninterrupted)}, out_file)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"update": run_update, "train": run_train, "both": run_both, "sharded": run_sharded,
     "deepspeed": run_deepspeed}[mode](*args)
    # Every result is written: leave without the interpreter's teardown. On these 2-core machines one rank
    # sometimes aborts there, after its work ("terminate called without an active exception": gloo's threads
    # torn down; seen in about 1 of 20 launches under load, also with the process group destroyed first), and
    # the launcher then reports the whole launch failed. docs/reliability.md lists it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
