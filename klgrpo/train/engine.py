"""Model and optimizer preparation on accelerate: DDP, FSDP2 or DeepSpeed ZeRO, chosen by ``accelerate launch``.

One plain process (no launcher) prepares nothing: ``Engine``'s model, optimizer and backward are torch's own. Under
a launcher ``start_engine`` builds one ``accelerate.Accelerator`` from the launcher's environment (the config
file's ``distributed_type``, ``fsdp_config``, ``deepspeed_config``) and the engine of that kind (``DDPEngine``,
``FSDP2Engine``, ``DeepSpeedEngine``: each overrides what it does differently) routes through it: ``prepare``
(wrap / shard model and optimizer), ``backward``, ``step`` (clip + optimizer step), the full state dict for
checkpoints and the full weights for sampling.

Gradients are SUMMED across ranks, not averaged: each rank's loss is already normalised by the global token /
sequence counts, so the single-process gradient is the sum of the ranks' gradients. DDP, FSDP2's
reduce-scatter and DeepSpeed all average, so ``backward`` multiplies the loss by the world size first
(exact for a power-of-two world size). A loss computed identically on every rank (the replay anchor) is
backpropagated unscaled: the average of equal gradients is that gradient.

FSDP2 on CPUs: accelerate 1.15 turns ``distributed_type: FSDP`` into plain multi-CPU data parallel when no GPU
is present (its state only honours FSDP for GPU-like devices), although torch's ``fully_shard`` runs on the
CPU over gloo. ``Engine`` then sets the state's FSDP plugin (parsed from the same launcher environment) and
distributed type itself, so accelerate's own FSDP2 path (``prepare``: auto-wrap policy, ``fully_shard`` of each
unit, the optimizer remapped to the sharded parameters; ``clip_grad_norm_``) is the one that runs -- and is
tested -- on CPUs. Full state dicts are gathered with torch's ``get_model_state_dict`` (what accelerate's
``get_state_dict`` calls on GPUs). DeepSpeed is demoted the same way and given back the same way; DeepSpeed itself
runs on the CPU (its CPU accelerator, gloo), so its branch is tested on CPUs too, not yet on GPUs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor

from klgrpo.backends.weights import check_weight_names, named_whole_weights
from klgrpo.errors import ConfigError
from klgrpo.store.sharded_checkpoint import load_sharded, save_sharded


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def launched_by_accelerate() -> bool:
    """A launcher started several processes, or an accelerate config asks for FSDP / DeepSpeed."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 or _env_flag("ACCELERATE_USE_FSDP")
            or _env_flag("ACCELERATE_USE_DEEPSPEED"))


def start_engine() -> "Engine":
    """The engine of this process: one of ``accelerate launch``'s (its environment says which), else one plain
    process's."""
    return _accelerated_engine() if launched_by_accelerate() else Engine()


def _accelerated_engine() -> "Engine":
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from klgrpo.train.deepspeed_config import check_deepspeed_settings

    check_deepspeed_settings()  # every process alike, before a process group exists: no rank left waiting
    on_cpu = not torch.cuda.is_available()
    if on_cpu and _env_flag("ACCELERATE_USE_DEEPSPEED"):  # its process group compiles a C++ op on first use
        from klgrpo.train.deepspeed_op import ensure_shm_op

        ensure_shm_op(log=lambda line: print(line, file=sys.stderr, flush=True))
    acc = Accelerator(cpu=on_cpu)
    if acc.distributed_type == DistributedType.MULTI_CPU:
        _restore_cpu_engine(acc)
    kind = acc.distributed_type
    if kind == DistributedType.FSDP:
        if acc.state.fsdp_plugin.fsdp_version != 2:
            raise ConfigError("the accelerate config's fsdp_config.fsdp_version is 1; klgrpo supports FSDP2 "
                              "only: set fsdp_version: 2 (see examples/accelerate/fsdp2.yaml)")
        return FSDP2Engine(acc)
    if kind == DistributedType.DEEPSPEED:
        return DeepSpeedEngine(acc)
    return Engine() if kind == DistributedType.NO else DDPEngine(acc)


class Engine:
    """One plain process: the model, optimizer and backward are torch's own. Each engine of a launcher is a
    subclass (``DDPEngine``, ``FSDP2Engine``, ``DeepSpeedEngine``) that overrides the calls it does differently;
    ``kind`` names it in messages."""

    kind = "single"
    #: Parameters live in shards (FSDP2, ZeRO-3): a forward needs every rank, and klgrpo's fast path, which reads
    #: the weights directly, cannot run on them outside ``full_weights``.
    shards_parameters = False
    #: The loss forward must go through the engine's module (its hooks gather shards or reduce gradients), so
    #: klgrpo's log-prob fast path, which reads the weights directly, is off for it (and for a sharded reference);
    #: sampling runs inside ``full_weights``. (DDP's wrapper hides the model, so the capability check
    #: ``teacher_forcing_model`` already refuses it.)
    fast_path_outside_loss_only = False
    zero_stage = 0

    def __init__(self, accelerator=None):
        self.accelerator = accelerator

    @property
    def world_size(self) -> int:
        return 1

    def check(self, cfg) -> None:
        """Settings this engine cannot honour, as one line each."""

    # --------------------------------------------------------------------------------------- preparing
    def prepare(self, model, optimizer):
        """(what the loss's forward runs, the optimizer to step). ``model`` stays the module itself for
        sampling, evaluation and checkpoints: FSDP2 shards it in place, DDP and DeepSpeed wrap it."""
        return model, optimizer

    def prepare_reference(self, reference) -> None:
        """A frozen copy is sharded like the policy under FSDP2 / ZeRO-3 (a full copy per rank otherwise); the
        LoRA reference is the policy itself with adapters off, sharded with it."""
        from klgrpo.core.reference import FrozenCopyReference

        if not self.shards_parameters or reference is None:
            return
        reference.fast_path = False  # its forward must run the sharded module's hooks (also the LoRA policy's)
        if isinstance(reference, FrozenCopyReference):
            reference.model = reference.forward_model = self._shard_frozen(reference.model)

    def _shard_frozen(self, model):
        """A frozen model (the reference) sharded as the policy is."""
        return model

    def sync_reference(self, reference, model, alpha: float) -> None:
        """kl.sync_every's ``reference.sync(model, alpha)``."""
        reference.sync(model, alpha)

    # ------------------------------------------------------------------------------------------ a step
    def backward(self, loss: Tensor, *, same_on_every_rank: bool = False, last: bool = True) -> None:
        """loss.backward() leaving the SUM over ranks of each rank's gradient in .grad (see the module doc);
        ``same_on_every_rank``: a loss every rank computes identically, whose gradient is taken once. ``last``:
        no other backward follows before ``step`` (DeepSpeed reduces the accumulated gradients only then)."""
        loss.backward()

    def step(self, model, optimizer, max_norm: float, allow=None) -> tuple[Tensor, bool]:
        """Clip the gradient to ``max_norm`` (inf: measure only) and step, unless ``allow(norm)`` is False (the
        trainer's guard against a non-finite step). Returns the gradient norm before clipping (the same number
        on every rank) and whether the optimizer stepped."""
        norm = self._clip(model, max_norm)
        if allow is not None and not allow(norm):
            return norm, False
        optimizer.step()
        return norm, True

    def _clip(self, model, max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @contextmanager
    def full_weights(self, model):
        """Every rank enters: inside, ``model`` holds its full weights as ordinary tensors and its forward runs
        no collective, so ranks may sample prompts of different lengths for different numbers of steps (and
        rank 0 alone may evaluate)."""
        yield model

    def whole_weights(self, model) -> Iterator[tuple[str, Tensor]]:
        """Every rank iterates it in step: the policy's (name, whole tensor) one parameter gathered at a time, for
        a sampler that holds its own copy of the weights (vLLM): the whole model is never gathered on a rank."""
        return named_whole_weights(model)

    # ------------------------------------------------------------------------------------- checkpoints
    def full_state_dict(self, model) -> dict[str, Tensor] | None:
        """Every rank calls this. The full (unsharded) state dict for rank 0's save_pretrained, or None where
        the module's own state dict is already full (one process, DDP)."""
        return None

    def optimizer_state_dict(self, optimizer) -> dict:
        """Every rank calls this. The optimizer state in the single-process layout (full tensors, parameters
        numbered in order), so a checkpoint resumes on any number of processes."""
        return getattr(optimizer, "optimizer", optimizer).state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """The inverse of ``optimizer_state_dict`` (each rank keeps its shard of every full tensor)."""
        getattr(optimizer, "optimizer", optimizer).load_state_dict(state)

    def save_sharded(self, folder: Path, model, optimizer) -> None:
        save_sharded(folder, model, optimizer)

    def load_sharded(self, folder: Path, model, optimizer) -> None:
        load_sharded(folder, model, optimizer)

    def load_adapter(self, model, ckpt: Path) -> None:
        """Load a checkpoint's trainable LoRA adapter into the live PeftModel."""
        from klgrpo.backends.lora import load_adapter_weights

        load_adapter_weights(model, ckpt)

    def load_model_file(self, model, path: Path, device) -> None:
        """Load a full safetensors state dict into ``model``: every weight must be in the file, except the second
        name of a tied weight (save_pretrained writes it once); a missing or unknown name is a ConfigError."""
        from safetensors.torch import load_file

        weights = load_file(str(path), device=str(device))
        check_weight_names(model, weights.keys(), path, fix="resume from an intact checkpoint of this run")
        self._load_full_state(model, weights)

    def _load_full_state(self, model, weights: dict[str, Tensor]) -> None:
        model.load_state_dict(weights, strict=False)  # strict=False for the tied names only (checked by the caller)


class _LaunchedEngine(Engine):
    """An engine of ``accelerate launch``: one ``accelerate.Accelerator`` built from the launcher's environment,
    through which the model and optimizer are prepared, the loss backpropagated and the gradient clipped."""

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    def check(self, cfg) -> None:
        if cfg.train.compile:
            raise ConfigError(f"train.compile with {self.kind}: not supported; set train.compile: false")

    def prepare(self, model, optimizer):
        return self.accelerator.prepare(model, optimizer)

    def backward(self, loss: Tensor, *, same_on_every_rank: bool = False, last: bool = True) -> None:
        self.accelerator.backward(loss * (1.0 if same_on_every_rank else float(self.world_size)))

    def _clip(self, model, max_norm: float) -> Tensor:
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class DDPEngine(_LaunchedEngine):
    """DistributedDataParallel: every rank holds the whole model; DDP averages the gradients."""

    kind = "ddp"


class FSDP2Engine(_LaunchedEngine):
    """FSDP2 (torch's ``fully_shard``, through accelerate): parameters, gradients and AdamW moments in shards."""

    kind = "fsdp2"
    shards_parameters = True
    fast_path_outside_loss_only = True

    def _shard_frozen(self, model):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(self.accelerator, model)  # in place; no optimizer to remap

    def sync_reference(self, reference, model, alpha: float) -> None:
        """Both models resharded first (a unit kept gathered after its forward holds full tensors where the other
        holds shards), then each rank mixes its own shards, which are laid out alike."""
        from torch.distributed.fsdp import FSDPModule

        for module in (model, getattr(reference, "model", model)):
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        reference.sync(model, alpha)

    @contextmanager
    def full_weights(self, model):
        """Each FSDP unit unsharded, with resharding after forward off."""
        with _fsdp2_unsharded(model):
            yield model

    def whole_weights(self, model) -> Iterator[tuple[str, Tensor]]:
        return named_whole_weights(model, _whole_dtensor)  # each DTensor's full_tensor

    def full_state_dict(self, model) -> dict[str, Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered on rank 0's CPU only (the other ranks get {}).
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, optimizer) -> dict:
        state = super().optimizer_state_dict(optimizer)
        return {**state, "state": {i: {k: _full(v) for k, v in s.items()} for i, s in state["state"].items()}}

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if state.get("state"):
            params = [p for group in inner.param_groups for p in group["params"]]
            state = {**state, "state": {i: {k: _shard_like(v, params[int(i)]) for k, v in s.items()}
                                        for i, s in state["state"].items()}}
        inner.load_state_dict(state)

    def load_adapter(self, model, ckpt: Path) -> None:
        _load_sharded_adapter(model, ckpt)

    def _load_full_state(self, model, weights: dict[str, Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


class DeepSpeedEngine(_LaunchedEngine):
    """DeepSpeed ZeRO (stage 1-3, from the accelerate config's deepspeed_config): DeepSpeed's engine wraps the
    model and clips and steps in one call."""

    kind = "deepspeed"
    fast_path_outside_loss_only = True

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self._ds_engine = None

    @property
    def zero_stage(self) -> int:
        return int(self.accelerator.state.deepspeed_plugin.zero_stage)

    @property
    def shards_parameters(self) -> bool:
        return self.zero_stage == 3

    def check(self, cfg) -> None:
        if self.zero_stage == 3 and cfg.kl.sync_every:
            raise ConfigError(f"kl.sync_every={cfg.kl.sync_every} with DeepSpeed ZeRO-3: the reference's synced "
                              "weights cannot be checkpointed; set kl.sync_every: 0 or use "
                              "examples/accelerate/fsdp2.yaml")
        if cfg.train.sharded_checkpoints:
            raise ConfigError("train.sharded_checkpoints with DeepSpeed: not supported; set "
                              "train.sharded_checkpoints: false")
        super().check(cfg)
        if cfg.kl.replay.coef > 0:
            raise ConfigError("kl.replay with DeepSpeed is not supported; set kl.replay.coef: 0 or use "
                              "examples/accelerate/fsdp2.yaml")
        self._configure(cfg)

    def _configure(self, cfg) -> None:
        """klgrpo's settings win over the DeepSpeed config's: clipping (DeepSpeed clips, not klgrpo), and the
        batch-size fields DeepSpeed insists on although klgrpo feeds it no data loader."""
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        ds["gradient_clipping"] = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else 0.0
        ds["gradient_accumulation_steps"] = 1
        ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size or cfg.rollout.group_size
        ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * self.world_size
        ds["zero_allow_untested_optimizer"] = True  # klgrpo's torch AdamW

    def prepare(self, model, optimizer):
        wrapped, optimizer = super().prepare(model, optimizer)
        self._ds_engine = wrapped
        return wrapped, optimizer

    def _shard_frozen(self, model):
        """ZeRO-3 partitioning of a frozen model (no optimizer), from the run's DeepSpeed config."""
        import copy

        import deepspeed

        config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if config.get(key) == "auto":
                config[key] = 1 if key != "train_batch_size" else self.world_size
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    def backward(self, loss: Tensor, *, same_on_every_rank: bool = False, last: bool = True) -> None:
        # Its config says one micro-batch per step (gradient_accumulation_steps 1), so without this every
        # backward is a boundary, and ZeRO-2 then keeps only part of the step's gradient (tested on CPUs).
        self._ds_engine.set_gradient_accumulation_boundary(last)
        # accelerate's backward would also run the DeepSpeed step; the step waits for ``step`` below.
        self._ds_engine.backward(loss * (1.0 if same_on_every_rank else float(self.world_size)))

    def step(self, model, optimizer, max_norm: float, allow=None) -> tuple[Tensor, bool]:
        """DeepSpeed clips ("gradient_clipping" of its config) and steps in one call, so the step is always
        taken (DeepSpeed's own loss scaler skips overflowing fp16 steps)."""
        self._ds_engine.step()
        norm = self._ds_engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else float(norm)), True

    @contextmanager
    def full_weights(self, model):
        """ZeRO-3: parameters gathered with DeepSpeed's partitioning hooks removed, so klgrpo's KV loop may
        sample."""
        with _zero3_gathered(self._ds_engine) if self.zero_stage == 3 else nullcontext():
            yield model

    def whole_weights(self, model) -> Iterator[tuple[str, Tensor]]:
        if self.zero_stage == 3:  # DeepSpeed's GatheredParameters, one parameter each
            return named_whole_weights(model, _whole_zero3)
        return named_whole_weights(model)

    def full_state_dict(self, model) -> dict[str, Tensor] | None:
        return self.accelerator.get_state_dict(self._ds_engine)  # ZeRO-3: needs zero3_save_16bit_model

    def optimizer_state_dict(self, optimizer) -> dict:
        return _zero_optimizer_state(self._ds_engine)

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        _load_zero_optimizer_state(self._ds_engine, state)

    def _load_full_state(self, model, weights: dict[str, Tensor]) -> None:
        _load_into_zero(self._ds_engine, model, weights, self.zero_stage)


def _load_into_zero(ds_engine, model, weights: dict[str, Tensor], zero_stage: int) -> None:
    """Full weights into a model under DeepSpeed: ZeRO-3 gathers its partitioned parameters to load them (and
    partitions them again on leaving); then the optimizer's own fp32 copy of the partitions is refreshed from
    them, or its next step would write the weights it held before back into the model."""
    import deepspeed

    params = list(model.parameters()) if zero_stage == 3 else []
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero_stage == 3):
        model.load_state_dict(weights, strict=False)  # strict=False for the tied names only (checked above)
    ds_engine.optimizer.refresh_fp32_params()


#: AdamW's per-parameter state that ZeRO partitions (the step count is one number per flat group).
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_flat_groups(zero_optimizer) -> list[Tensor]:
    """The flat fp32 partitions ZeRO's base optimizer steps (ZeRO-1/2 and ZeRO-3 name them differently)."""
    return list(getattr(zero_optimizer, "single_partition_of_fp32_groups", None)
                or zero_optimizer.fp32_partitioned_groups_flat)


def _zero_optimizer_state(ds_engine) -> dict:
    """Every rank calls this (each moment is gathered from the ranks' partitions). ZeRO's AdamW state in the
    single-process layout: {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}, parameter i
    being the i-th trainable parameter of the model, full tensors on the CPU; {} before the first step."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = ds_engine.optimizer
    base = zero.optimizer
    flats = [f for f in _zero_flat_groups(zero) if base.state.get(f)]
    if not flats:
        return {}
    step = base.state[flats[0]]["step"]
    params = [p for p in ds_engine.module.parameters() if p.requires_grad]
    state = {i: {"step": torch.as_tensor(step, dtype=torch.float32).detach().cpu().clone(),
                 **{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in _ADAM_MOMENTS}}
             for i, p in enumerate(params)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(params)))}
              for g in base.param_groups[:1]]
    return {"state": state, "param_groups": groups}


def _load_zero_optimizer_state(ds_engine, state: dict) -> None:
    """The inverse of ``_zero_optimizer_state``, before the first step of a resumed run: ZeRO's base optimizer
    holds no state yet, so it gets zero moments over its flat partitions (through its own load_state_dict, which
    places the step count as the optimizer wants it), ZeRO-1/2 links each parameter's fragment to them, and every
    rank copies its partition of each full moment in. A checkpoint written without moments ({}) leaves AdamW to
    start afresh, as those runs did."""
    from deepspeed.utils import safe_set_full_optimizer_state

    if not state.get("state"):
        return
    zero = ds_engine.optimizer
    base = zero.optimizer
    params = [p for p in ds_engine.module.parameters() if p.requires_grad]
    if len(state["state"]) != len(params):
        raise ConfigError(f"the checkpoint's optimizer state has {len(state['state'])} parameters and the model "
                          f"{len(params)} trainable ones; resume with the model and LoRA settings it was written with")
    entries = {int(i): s for i, s in state["state"].items()}  # a checkpoint's JSON turns the numbers into text
    step = entries[0]["step"]
    saved = (state.get("param_groups") or [{}])[0]
    # ZeRO-3 hands its base optimizer the flat partitions only for the length of a step: hand them over here too.
    lend = not any(g["params"] for g in base.param_groups) and hasattr(zero, "_set_fp32_optimizer_param_groups")
    if lend:
        zero._set_fp32_optimizer_param_groups()
    try:
        flats = [p for group in base.param_groups for p in group["params"]]
        base_state = base.state_dict()
        base_state["state"] = {i: {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                   **{k: torch.zeros_like(flat) for k in _ADAM_MOMENTS}}
                               for i, flat in enumerate(flats)}
        for group in base_state["param_groups"]:  # the learning rate and the rest as the checkpoint had them
            group.update({k: v for k, v in saved.items() if k in group and k != "params"})
        base.load_state_dict(base_state)
    finally:
        if lend:
            zero._clear_fp32_optimizer_param_groups()
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: fragments point into the new state
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    for i, p in enumerate(params):
        for k in _ADAM_MOMENTS:
            safe_set_full_optimizer_state(p, entries[i][k].to(p.device, torch.float32), k)


def _restore_cpu_engine(acc) -> None:
    """accelerate 1.15 turns FSDP and DeepSpeed into plain multi-CPU data parallel when no GPU is present (see
    the module doc); give the state back the engine the launcher asked for, its plugin parsed from the same
    launcher variables, over the gloo process group accelerate already started."""
    from accelerate import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

    if _env_flag("ACCELERATE_USE_FSDP"):
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # reads the launcher's FSDP_* variables
        kind = DistributedType.FSDP
    elif _env_flag("ACCELERATE_USE_DEEPSPEED"):
        plugin = DeepSpeedPlugin()  # reads the launcher's ACCELERATE_DEEPSPEED_* variables
        plugin.set_mixed_precision(acc.state.mixed_precision)
        plugin.select(_from_accelerator_state=True)
        acc.state.deepspeed_plugins = plugin
        kind = DistributedType.DEEPSPEED
    else:
        return
    # Both shared states: every later AcceleratorState() (DeepSpeed's prepare makes one) copies PartialState's
    # distributed type over its own.
    acc.state.distributed_type = PartialState().distributed_type = kind


def _load_sharded_adapter(model, ckpt: Path) -> None:
    """FSDP2: the trainable LoRA adapter of a checkpoint (peft's key format) into the sharded PeftModel."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from klgrpo.backends.lora import ADAPTER_WEIGHTS

    saved = load_file(str(Path(ckpt) / ADAPTER_WEIGHTS))
    tag = f".{model.active_adapter}."
    live = {name: name.replace(tag, ".") for name, _ in model.named_parameters() if tag in name}
    if set(live.values()) != set(saved):
        raise ConfigError(f"{ckpt} does not match the live LoRA adapter (different model.lora.r, target_modules or "
                          f"base model); resume with the model.lora settings the checkpoint was trained with")
    set_model_state_dict(model, {name: saved[key] for name, key in live.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _whole_dtensor(value: Tensor) -> Tensor:
    return _full(value.detach())


def _whole_zero3(param: Tensor) -> Tensor:
    """A copy of one ZeRO-3 parameter gathered from every rank (a buffer, never partitioned, as it is)."""
    if not hasattr(param, "ds_id"):
        return param.detach()
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def _shard_like(value, param):
    """This rank's shard of the full tensor ``value`` laid out as the DTensor ``param`` (state of that shape)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


@contextmanager
def _fsdp2_unsharded(model):
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # FSDP2 finds its root at the first forward; unsharding before any forward would leave every unit a root.
    model._get_fsdp_state()._lazy_init()
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    # Each unit's own resharding choice (accelerate keeps the last unit gathered), restored afterwards.
    reshard_meshes = [g.post_forward_mesh_info if g is not None else None for g in groups]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit, group, mesh in zip(units, groups, reshard_meshes):
            unit.reshard()
            if group is not None:
                group.post_forward_mesh_info = mesh


@contextmanager
def _zero3_gathered(ds_engine):
    """ZeRO-3: gather every parameter and take DeepSpeed's forward hooks off (they would release the gathered
    parameters after each submodule, and the root's start-of-forward hook runs a collective at every forward,
    which hangs when one rank evaluates alone or the ranks sample for different numbers of tokens), then put
    them back, the start-of-forward hook first as DeepSpeed orders them."""
    import deepspeed

    offload = ds_engine.optimizer.parameter_offload
    module = offload.module
    start = getattr(offload, "fwd_pre_hook", None)  # kept by recent DeepSpeed (0.19.8 tested); absent: nothing to do
    start_fn = module._forward_pre_hooks.get(start.id) if start is not None else None
    with deepspeed.zero.GatheredParameters(list(ds_engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks + ([start] if start_fn is not None else []):
            hook.remove()
        offload.forward_hooks.clear()
        offload.backward_hooks.clear()
        try:
            yield
        finally:
            if start_fn is not None:
                offload.fwd_pre_hook = module.register_forward_pre_hook(start_fn)
            # the method's name differs between DeepSpeed versions
            register = getattr(offload, "_register_deepspeed_module", None) or offload._register_hooks_recursively
            register(module)
