"""Your own loss: the two signatures klgrpo calls, and how a name in the config becomes a function.

Typed (the trainer's):   loss_fn(inp: LossInput) -> (loss, metrics)
    one call per micro-batch; ``inp.logp`` carries the gradient, everything else is data. Reduce per-token
    values with ``inp.aggregate(values_BT)`` (the configured aggregation over the step's GLOBAL counts), and the
    gradient does not depend on the micro-batch size.

Datum (hosted training APIs'):   loss_fn(data: list[Datum], logprobs_list: list[Tensor]) -> (loss, metrics)
    ``data[i].model_input`` is completion i's whole sequence (prompt + completion token ids), the loss is on
    its last n tokens: ``data[i].loss_fn_inputs`` holds per-token tensors over them ("target_tokens",
    "advantages", "logprobs" = the sampling policy's, "ref_logprobs", "mask"), ``logprobs_list[i]`` the current
    policy's log-probs of the same tokens, with gradient. Rows with no token in the loss give no datum.
    :func:`as_typed` runs such a function on a LossInput; :func:`build_datums` is the one builder, used by it
    and by klgrpo.custom.datums_from_batch. The trainer also passes the step's beta as the function's
    KL-coefficient keyword (``kl_coef=``, ``beta=``, ...: :data:`COEFFICIENT_NAMES`) when it has one.

``metrics`` is a dict of name -> number (float or 0-d tensor); the trainer logs each as ``custom/<name>``,
averaged over the micro-batches of the step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from klgrpo.core.rewards.loading import load_user_function
from klgrpo.errors import ConfigError
from klgrpo.math.aggregation import Normalizer, aggregate

SIGNATURES = ("typed", "datum")
#: Keyword names read as a datum-signature loss's KL coefficient: the trainer passes the step's beta to the first
#: one the function takes, and ``verify-kl --loss`` scales it.
COEFFICIENT_NAMES = ("kl_coef", "beta", "kl_beta", "kl_weight", "kl_coeff", "coef")


@dataclass(frozen=True)
class LossInput:
    """One micro-batch, as the custom loss sees it (B sequences, T completion positions)."""

    logp: Tensor                  # [B, T] log pi(y_t | y_<t), current policy, WITH gradient
    old_logp: Tensor              # [B, T] the sampling policy's log-probs (= logp.detach() on-policy)
    ref_logp: Tensor | None       # [B, T] the reference's, computed once per batch; None without a reference
    advantages: Tensor            # [B]
    mask: Tensor                  # [B, T] 1 on completion tokens that enter the loss
    beta: float                   # the KL coefficient at this step (kl.coef, or the controller's value)
    normalizer: Normalizer        # the step's global counts (sequences, tokens, L_max)
    aggregation: str = "token_mean"  # loss.aggregation
    tokens: Tensor | None = None  # [B, T] completion token ids
    prompt_ids: Tensor | None = None   # [B, P] prompt token ids, left-padded (None: no prompt, e.g. the verifier)
    prompt_mask: Tensor | None = None  # [B, P] 1 on prompt tokens, 0 on padding

    def aggregate(self, values_BT: Tensor) -> Tensor:
        """Masked reduction of per-token values to this micro-batch's share of the step's scalar."""
        return aggregate(values_BT, self.mask, self.aggregation, self.normalizer)


@dataclass
class Datum:
    """One completion in the datum shape: token ids and per-token tensors for the loss function."""

    model_input: Tensor                                          # [L] token ids (prompt + completion)
    loss_fn_inputs: dict[str, Tensor] = field(default_factory=dict)  # per completion token, each [n]


def load_loss_function(name: str, what: str = "loss.function") -> Callable:
    """``loss.function``: ``"module.path:function"`` or ``"path/to/file.py:function"`` (the reward loader);
    errors name ``what``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{what} must be a non-empty string, got {name!r}")
    fn = load_user_function(name.strip(), what, ConfigError)
    signature_of(fn, name)
    return fn


def signature_of(fn: Callable, name: str = "") -> str:
    """"typed" for ``fn(inp)``, "datum" for ``fn(data, logprobs_list, ...)``, read off the positional
    parameters without defaults."""
    label = name or getattr(fn, "__name__", repr(fn))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ConfigError(f"loss function {label}: its signature cannot be read; wrap it in a def") from None
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    if len(required) == 1:
        return "typed"
    if len(required) == 2:
        return "datum"
    raise ConfigError(f"loss function {label} takes {len(required)} required arguments {inspect.signature(fn)}; "
                      f"write fn(inp: LossInput) or fn(data, logprobs_list) (docs/custom_loss.md)")


def build_datums(completion_ids_BT: Tensor, mask_BT: Tensor, advantages_B: Tensor, old_logp_BT: Tensor,
                 ref_logp_BT: Tensor | None = None, prompt_ids_BP: Tensor | None = None,
                 prompt_mask_BP: Tensor | None = None) -> tuple[list[Datum], list[int]]:
    """One Datum per row with tokens in the loss, and the rows they come from (a row with an empty mask gives
    none: there is nothing to train on). ``model_input`` is the row's prompt (padding removed) followed by its
    loss tokens; without ``prompt_ids_BP`` it is the loss tokens alone."""
    data, rows = [], []
    for i in range(mask_BT.shape[0]):
        keep = mask_BT[i].bool()
        n = int(keep.sum())
        if n == 0:
            continue
        completion = completion_ids_BT[i, keep]
        prompt = (prompt_ids_BP[i][prompt_mask_BP[i].bool()] if prompt_ids_BP is not None
                  else completion.new_zeros(0))
        fields = {"target_tokens": completion, "advantages": advantages_B[i].expand(n),
                  "logprobs": old_logp_BT[i, keep].detach(), "mask": torch.ones(n, dtype=old_logp_BT.dtype)}
        if ref_logp_BT is not None:
            fields["ref_logprobs"] = ref_logp_BT[i, keep].detach()
        data.append(Datum(model_input=torch.cat([prompt.to(completion.device), completion]), loss_fn_inputs=fields))
        rows.append(i)
    return data, rows


def datums_from_input(inp: LossInput) -> tuple[list[Datum], list[Tensor]]:
    """The micro-batch as datums (:func:`build_datums`) and each datum's current log-probs, with gradient."""
    tokens = inp.tokens if inp.tokens is not None else torch.zeros_like(inp.mask, dtype=torch.long)
    data, rows = build_datums(tokens, inp.mask, inp.advantages, inp.old_logp, inp.ref_logp, inp.prompt_ids,
                              inp.prompt_mask)
    return data, [inp.logp[i, inp.mask[i].bool()] for i in rows]


def as_typed(fn: Callable) -> Callable[[LossInput], tuple]:
    """A typed loss that runs the datum-signature ``fn`` on the micro-batch's datums (:func:`datums_from_input`)."""
    def typed(inp: LossInput):
        return fn(*datums_from_input(inp))
    typed.__name__ = getattr(fn, "__name__", "loss")
    return typed


def call_loss(fn: Callable, inp: LossInput, name: str = "") -> tuple[Tensor, dict[str, Tensor]]:
    """Run a typed loss and check what it returned: a scalar tensor and a dict of numbers."""
    label = name or getattr(fn, "__name__", "loss")
    out = fn(inp)
    loss, metrics = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ConfigError(f"loss function {label} must return (loss, metrics) with loss a scalar tensor, got "
                          f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}")
    if not isinstance(metrics, dict):
        raise ConfigError(f"loss function {label} returned metrics of type {type(metrics).__name__}; return a "
                          f"dict of name -> number")
    clean = {}
    for key, value in metrics.items():
        value = torch.as_tensor(value.detach() if isinstance(value, Tensor) else value, dtype=torch.float64)
        if value.numel() != 1:
            raise ConfigError(f"loss function {label}: metric {key!r} has {value.numel()} values; return one number")
        clean[str(key)] = value.reshape(())
    return loss.reshape(()), clean


def resolve_loss_function(config_name: str, loss_fn: Callable | None = None,
                          warn: Callable[[str], None] | None = None) -> Callable[[LossInput], tuple] | None:
    """The typed loss the trainer calls: ``loss_fn`` (Python) or ``loss.function`` (config), datum-signature
    functions wrapped so that they receive the step's beta as their coefficient keyword (``warn`` is told when
    such a function has none); None for the built-in objective."""
    if loss_fn is not None and config_name:
        raise ConfigError(f"both loss.function={config_name!r} and GRPOTrainer(loss_fn=...) are set; keep one")
    fn = loss_fn if loss_fn is not None else (load_loss_function(config_name) if config_name else None)
    if fn is None:
        return None
    if signature_of(fn, config_name) == "typed":
        return fn
    coef = coefficient_name(fn)
    if not coef:
        if warn is not None:
            warn(f"the loss function {config_name or getattr(fn, '__name__', 'loss')} takes no KL-coefficient "
                 f"keyword ({', '.join(COEFFICIENT_NAMES)}): kl.coef and the controller's beta do not reach it")
        return as_typed(fn)

    def with_beta(inp: LossInput):  # the step's beta (kl.coef or the controller's value), not fn's own default
        return fn(*datums_from_input(inp), **{coef: inp.beta})
    with_beta.__name__ = getattr(fn, "__name__", "loss")
    with_beta.coefficient = coef
    return with_beta


def coefficient_name(fn: Callable) -> str:
    """The first of :data:`COEFFICIENT_NAMES` that ``fn`` takes as a keyword, or ""."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ""
    return next((n for n in COEFFICIENT_NAMES if n in params
                 and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)), "")
