"""The frozen reference model behind a small interface: log-probs of a batch, optional sync, checkpointing.

Kinds:
    FrozenCopyReference   a copy of the initial policy (or another checkpoint), eval mode, no grad
    (LoRA: the policy with adapters disabled slots in behind the same interface; AdapterDisabledReference below)

Reference log-probs are computed once per generated batch without gradient and reused across
num_iterations and micro-batches.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from klgrpo.backends.lora import (
    ADAPTER_WEIGHTS,
    REFERENCE_ADAPTER,
    adapter_params,
    is_up_factor,
    keep_requires_grad,
    load_adapter_file,
    require_peft_model,
)
from klgrpo.core.batch import micro_slices
from klgrpo.core.forward import completion_logprobs, position_ids_from_mask
from klgrpo.core.full_kl import capture_head_inputs
from klgrpo.core.rollout import RolloutBatch


class Reference(Protocol):
    def logprobs(self, batch: RolloutBatch, temperature: float, micro_batch_size: int = 0) -> Tensor: ...

    def logits(self, input_ids: Tensor, attention_mask: Tensor, keep: int = 0) -> Tensor:
        """Full next-token logits [B, L, V] of the reference (no grad), e.g. for the exact replay KL; ``keep`` > 0:
        those of the last ``keep`` positions only."""
        ...

    def head_inputs(self, input_ids: Tensor, attention_mask: Tensor, keep: int) -> tuple[Tensor, torch.nn.Module]:
        """(input of the output layer at the last ``keep`` positions [B, keep, H], that layer), no grad: the
        reference's logits rebuilt block by block for kl.estimator full (core.full_kl)."""
        ...

    def sync(self, policy, alpha: float) -> None: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...


class FrozenCopyReference:
    """A separate frozen model: a deep copy of the policy at start, or weights loaded from elsewhere.
    ``fast_path``: its log-probs through klgrpo's decoder where it reproduces the model (model.fast_path)."""

    def __init__(self, model, fast_path: bool = True):
        self.model = model
        self.fast_path = fast_path
        self.model.eval()
        self.model.requires_grad_(False)
        self.synced = False  # once synced, checkpoints must carry the reference's own weights
        self.forward_model = model  # what logprobs runs: the model, or its compiled wrapper (compile())

    def compile(self) -> None:
        """Run ``logprobs`` through torch.compile(model) (train.compile): same weights, so ``sync`` still applies."""
        self.forward_model = torch.compile(self.model)

    @classmethod
    def copy_of(cls, policy, fast_path: bool = True) -> "FrozenCopyReference":
        return cls(copy.deepcopy(policy), fast_path)

    def logprobs(self, batch: RolloutBatch, temperature: float, micro_batch_size: int = 0) -> Tensor:
        # inference_mode skips autograd's version counting and view tracking, which no_grad keeps; the result
        # is copied out of it as a normal tensor, which the loss may save for its backward.
        with torch.inference_mode():
            parts = [completion_logprobs(self.forward_model, batch, temperature, rows=sl,
                                         fast_path=self.fast_path)[0]
                     for sl in micro_slices(batch.size, micro_batch_size)]
            out = torch.cat(parts, dim=0)
        return out.clone()

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor, keep: int = 0) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                          logits_to_keep=keep).logits

    def head_inputs(self, input_ids: Tensor, attention_mask: Tensor, keep: int):
        return capture_head_inputs(self.model, input_ids, attention_mask, keep)

    @torch.no_grad()
    def sync(self, policy, alpha: float = 1.0) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (alpha = 1: a copy), parameter by parameter."""
        ref_params = dict(self.model.named_parameters())
        for name, p in policy.named_parameters():  # by name: FSDP2 may list a sharded model's parameters in
            p_ref = ref_params[name]               # another order than the reference's
            # Sharded (FSDP2, laid out alike): each rank mixes its own shards. Their first forward ran under
            # ``logprobs``' inference_mode, which left inference tensors, updatable in place only in that mode.
            ref, src = _local(p_ref), _local(p.detach())
            with torch.inference_mode(ref.is_inference()):
                ref.mul_(1.0 - alpha).add_(src.to(ref.dtype), alpha=alpha)
        self.synced = True

    def save(self, folder: Path, state_dict: dict | None = None) -> None:
        """``state_dict``: the full weights of a sharded reference, gathered by the caller."""
        if self.synced:
            self.model.save_pretrained(folder / "reference", state_dict=state_dict)

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_model

        path = folder / "reference" / "model.safetensors"
        if path.exists():
            load_model(self.model, str(path), strict=False)
            self.synced = True


def _local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (under no_grad: the tensor itself, not a copy); any other tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


# ------------------------------------------------------------------------------------------ LoRA
class AdapterDisabledReference:
    """The reference of a LoRA policy, sharing every base tensor with it.

    Before any sync the reference is the base model: the policy's forward inside ``disable_adapter()``
    (exactly the base, since the initial adapter is a zero delta). ``sync`` creates a frozen adapter
    ``"reference"`` beside the trainable one; from then on the reference forward switches to it and back.
    """

    def __init__(self, model, fast_path: bool = True):
        require_peft_model(model, "AdapterDisabledReference")
        self.model = model
        self.fast_path = fast_path
        self.policy_adapter = model.active_adapter
        self.synced = False  # once synced, the reference adapter exists and goes into checkpoints

    @contextmanager
    def sampling_model(self):
        """The policy module switched to the reference (for the duration of the block); yields the model."""
        with keep_requires_grad(self.model):
            if not self.synced:
                with self.model.disable_adapter():
                    yield self.model
                return
            self.model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield self.model
            finally:
                self.model.set_adapter(self.policy_adapter)

    @torch.no_grad()
    def logprobs(self, batch: "RolloutBatch", temperature: float, micro_batch_size: int = 0) -> Tensor:
        with self.sampling_model() as model:
            parts = [completion_logprobs(model, batch, temperature, rows=sl, fast_path=self.fast_path)[0]
                     for sl in micro_slices(batch.size, micro_batch_size)]
        return torch.cat(parts, dim=0)

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor, keep: int = 0) -> Tensor:
        with self.sampling_model() as model:
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                         logits_to_keep=keep).logits

    def head_inputs(self, input_ids: Tensor, attention_mask: Tensor, keep: int):
        """The output layer is the base model's, shared with the policy (core.full_kl checks the rebuilt
        log-probs, so an adapter on that layer is caught)."""
        with self.sampling_model() as model:
            return capture_head_inputs(model, input_ids, attention_mask, keep)

    def _ensure_reference_adapter(self) -> None:
        if REFERENCE_ADAPTER in self.model.peft_config:
            return
        cfg = copy.deepcopy(self.model.peft_config[self.policy_adapter])
        cfg.lora_dropout = 0.0  # the reference forward is deterministic
        cfg.inference_mode = True
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        # The new adapter's random init would draw from the global RNG and shift sampling after a sync;
        # its values are overwritten right away, so draw from a forked RNG.
        with keep_requires_grad(self.model), torch.random.fork_rng(devices=devices):
            self.model.add_adapter(REFERENCE_ADAPTER, cfg)
        for p in adapter_params(self.model, REFERENCE_ADAPTER).values():
            p.requires_grad_(False)

    @torch.no_grad()
    def sync(self, policy, alpha: float = 1.0) -> None:
        """reference <- alpha * policy + (1 - alpha) * reference, on the adapter only.

        First sync (reference = base, delta_ref = 0): the reference adapter becomes the policy adapter with
        its B factors scaled by alpha, so delta_ref = B_ref A_ref = alpha * B A exactly, which is what mixing
        full weights would give. Later syncs mix A and B parameter-wise (A_ref <- alpha A + (1 - alpha) A_ref,
        same for B); delta = B A is bilinear, so this is the usual adapter-space EMA, exact at alpha = 1.
        """
        if policy is not self.model:
            raise ValueError("AdapterDisabledReference.sync: the policy must be the PeftModel it was built on")
        first = not self.synced
        self._ensure_reference_adapter()
        src = adapter_params(self.model, self.policy_adapter)
        dst = adapter_params(self.model, REFERENCE_ADAPTER)
        if src.keys() != dst.keys():
            raise RuntimeError("the reference adapter does not mirror the policy adapter")
        for name, p in src.items():
            q, value = dst[name], p.detach().to(dst[name].dtype)
            if first:
                q.copy_(value)
                if is_up_factor(name) and alpha != 1.0:
                    q.mul_(alpha)
            else:
                q.mul_(1.0 - alpha).add_(value, alpha=alpha)
        self.synced = True

    def save(self, folder: Path) -> None:
        """Once synced: <folder>/reference/ holds the reference adapter in peft's format."""
        if not self.synced:
            return
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out = Path(folder) / REFERENCE_ADAPTER
        out.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=REFERENCE_ADAPTER)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        self.model.peft_config[REFERENCE_ADAPTER].save_pretrained(str(out))

    def load(self, folder: Path) -> None:
        path = Path(folder) / REFERENCE_ADAPTER / ADAPTER_WEIGHTS
        if not path.exists():
            return
        self._ensure_reference_adapter()
        load_adapter_file(self.model, path, REFERENCE_ADAPTER)
        for p in adapter_params(self.model, REFERENCE_ADAPTER).values():
            p.requires_grad_(False)
        self.synced = True



def build_reference(policy, own_model=None, *, adapter: bool = False, fast_path: bool = True) -> Reference:
    """The frozen reference: ``own_model`` (the model at kl.reference) when given, else the policy with its LoRA
    adapter off (``adapter``), else a copy of the policy."""
    if own_model is None and not adapter:
        own_model = copy.deepcopy(policy)
    if own_model is not None:
        return FrozenCopyReference(own_model, fast_path)
    return AdapterDisabledReference(policy, fast_path)
