"""klgrpo's decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3; LoRA-wrapped or not).

It runs the model's own modules (embeddings, norms, projections, MLP, rotary embedding, head) over a preallocated
KV cache, with only the attention and the cache written here, so that sampling (``KVSampler.sample``) avoids
``generate``'s per-step machinery and the log-prob forward (``teacher_forced_logits``) runs each prompt once per
group. ``decoder_parts`` refuses anything it does not reproduce exactly (other architectures, rope types
that depend on the sequence length, a sliding window that matters); callers then use transformers.
tests/test_rollout_sampler.py checks logits, gradients and sampled tokens against transformers.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from klgrpo.backends.weights import base_model
from klgrpo.math.truncation import kept_counts, truncate_scores

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only


def filter_logits(logits_BV: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> Tensor:
    """float32 scores logits / temperature with -inf outside the kept set of top-k, then top-p, then min-p, as
    transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper in that order
    (klgrpo.math.truncation.truncate_scores)."""
    scores = logits_BV.float()
    if temperature != 1.0:
        scores = scores / temperature
    return truncate_scores(scores, top_k, top_p, min_p)


def sample_next_token(logits_BV: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> Tensor:
    """One token per row drawn from softmax(filter_logits(...)), [B] int64 (one torch.multinomial call, as
    ``generate`` draws)."""
    return draw_next_token(logits_BV, temperature, top_k, top_p, min_p)[0]


def draw_next_token(logits_BV: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``sample_next_token``'s token (the same draw), its log-probability under the distribution drawn from,
    float32 [B] (the sampler's own log mu of the token, read off the probabilities it sampled with), and the size
    of the kept set it was drawn from, int32 [B] (the vocabulary's size where no filter is on)."""
    scores = filter_logits(logits_BV, temperature, top_k, top_p, min_p)
    probs = scores.softmax(dim=-1)
    token = torch.multinomial(probs, 1)
    return token.squeeze(-1), probs.gather(-1, token).squeeze(-1).log(), kept_counts(scores)


def _linear(module, x: Tensor) -> Tensor:
    """A plain nn.Linear without its module call overhead; anything else (a LoRA layer) through its own call."""
    return F.linear(x, module.weight, module.bias) if type(module) is torch.nn.Linear else module(x)


#: The loop fuses each layer's q/k/v and gate/up projections into one matrix each (a copy of those weights per
#: rollout) only while the copies stay below this size: the calls they save matter for small models, whose
#: steps are dominated by per-operation overhead, and the copies would cost memory for large ones.
FUSE_MAX_BYTES = 256 * 2 ** 20
_SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


class _FusedLayer(NamedTuple):
    """One layer's weights for ``_fused_layer``: q/k/v and gate/up concatenated, each scaled by the RMSNorm weight
    in front of it (W (w * x) = (W diag(w)) x)."""

    qkv: Tensor
    qkv_bias: Tensor | None
    eps_in: float
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    eps_post: float
    down: Tensor
    down_bias: Tensor | None
    q_norm: Tensor | None   # Qwen3: RMSNorm weights over each head of q and k
    k_norm: Tensor | None
    eps_qk: float


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def _attend(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, start: int | Tensor, mask: Tensor,
            scale: float) -> Tensor:
    """Write k, v [B, KV, S, D] into the cache at columns start..start+S-1; q's attention over the cache so far,
    [B, S, H * D]. ``start`` an int: the cache is sliced to its filled columns (eager). ``start`` a one-element
    tensor (S = 1): the whole cache under ``mask`` [B, 1, 1, L], so shapes never change (torch.compile)."""
    b, h, s, d = q.shape
    if isinstance(start, int):
        end = start + s
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        k_all, v_all, gqa = keys[:, :, :end], values[:, :, :end], h != k.shape[1]
        if torch.compiler.is_compiling():
            # Under train.compile, once the width goes dynamic, inductor's backward took these slices of the
            # cache for contiguous tensors and failed its own stride check (torch 2.13, the CPU): give it copies.
            k_all, v_all = k_all.contiguous(), v_all.contiguous()
        if gqa and q.is_cuda:
            # CUDA's fused SDPA kernels refuse enable_gqa together with a mask and fall back to the math kernel,
            # which materialises the [B, H, S, L] scores in float32 and runs far slower on a GQA model:
            # each query head gets its K/V head copied instead, as transformers' repeat_kv does.
            k_all, v_all, gqa = k_all.repeat_interleave(h // k.shape[1], 1), v_all.repeat_interleave(
                h // k.shape[1], 1), False
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(b, s, h * d)
    keys.index_copy_(2, start, k)
    values.index_copy_(2, start, v)
    q = q.reshape(b, keys.shape[1], -1, d)  # the heads sharing a KV head side by side (s = 1)
    weights = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf")).softmax(-1)
    return torch.matmul(weights, values).reshape(b, s, h * d)


def _fused_layer(w: _FusedLayer, h: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                 start: int | Tensor, mask: Tensor, n_heads: int, scale: float) -> Tensor:
    """A decoder layer on h [B, S, d] with fused projections: one matmul for q/k/v, one rotary for q and k
    together, one matmul for gate/up; tensors only, so torch.compile traces it once for every rollout."""
    b, s, d = h.shape
    head_dim = cos.shape[-1]
    n_kv = (w.qkv.shape[0] // head_dim - n_heads) // 2
    nqk = n_heads + n_kv
    x = F.rms_norm(h, (d,), None, w.eps_in)
    qkv = F.linear(x, w.qkv, w.qkv_bias).view(b, s, nqk + n_kv, head_dim)
    qk = qkv[:, :, :nqk]
    if w.q_norm is not None:
        qk = torch.cat([F.rms_norm(qk[:, :, :n_heads], (head_dim,), w.q_norm, w.eps_qk),
                        F.rms_norm(qk[:, :, n_heads:], (head_dim,), w.k_norm, w.eps_qk)], dim=2)
    qk = _rotary(qk.transpose(1, 2), cos, sin)
    o = _attend(qk[:, :n_heads], qk[:, n_heads:], qkv[:, :, nqk:].transpose(1, 2), keys, values, start, mask, scale)
    h = h + F.linear(o, w.o, w.o_bias)
    x = F.rms_norm(h, (d,), None, w.eps_post)
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate).mul_(up), w.down, w.down_bias)


def _decode_step(token_B: Tensor, cos: Tensor, sin: Tensor, column: Tensor, keys_valid: Tensor, done: Tensor,
                 caches, layers: list[_FusedLayer], head: tuple, n_heads: int, scale: float, sampling: tuple,
                 eos: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One step of the fused loop as a function of tensors only (what train.compile compiles): feed token_B at
    cache ``column``, draw the next token as ``sample_next_token`` does; returns (token, done, its log-prob, the
    size of its kept set)."""
    embed, norm, norm_eps, lm_head, lm_head_bias = head
    temperature, top_k, top_p, min_p, pad_id = sampling
    h = F.embedding(token_B[:, None], embed)
    mask = (keys_valid & (torch.arange(keys_valid.shape[1], device=column.device) <= column))[:, None, None]
    for w, (keys, values) in zip(layers, caches):
        h = _fused_layer(w, h, cos, sin, keys, values, column, mask, n_heads, scale)
    logits = F.linear(F.rms_norm(h[:, -1], (h.shape[-1],), norm, norm_eps), lm_head, lm_head_bias)
    token, logp, kept = draw_next_token(logits, temperature, top_k, top_p, min_p)
    token = token.masked_fill(done, pad_id)
    return token, done | torch.isin(token, eos), logp, kept


_compiled_decode_steps: dict[tuple, object] = {}


def _compiled_step(architecture: tuple):
    """``_decode_step`` under torch.compile, one per model architecture, each with its own code object and so
    its own compilation cache: within one, only the cache length varies (a second width recompiles it once with
    that dimension dynamic), while a cache shared by two models made every dimension dynamic and the kernels
    100x slower. Random ops stay torch's own, so a seed draws the same tokens as the eager loop."""
    if architecture not in _compiled_decode_steps:
        code = _decode_step.__code__.replace(co_name=f"_decode_step_{len(_compiled_decode_steps)}")
        step = types.FunctionType(code, _decode_step.__globals__, code.co_name, _decode_step.__defaults__)
        _compiled_decode_steps[architecture] = torch.compile(step, options={"fallback_random": True})
    return _compiled_decode_steps[architecture]


def decoder_parts(model, total_len: int):
    """(base model, decoder) when klgrpo's decoder reproduces ``model``'s forward over ``total_len`` positions, else
    None: the one capability check behind the KV-loop sampler and the log-prob fast path."""
    base = base_model(model)
    cfg = getattr(base, "config", None)
    decoder = getattr(base, "model", None)
    if getattr(cfg, "model_type", None) not in _SUPPORTED_MODEL_TYPES or not hasattr(base, "lm_head"):
        return None
    if not all(hasattr(decoder, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if getattr(decoder.rotary_emb, "rope_type", "default") not in _STATIC_ROPE_TYPES:
        return None
    for layer in decoder.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if cfg.model_type == "mistral":
            window = getattr(cfg, "sliding_window", None)
        if window is not None and window < total_len:
            return None  # a sliding window that matters: leave it to transformers
    return base, decoder


class KVSampler:
    """A decoder-only transformer (Llama family) run step by step over a preallocated KV cache.

    It calls the model's own modules (embeddings, norms, projections, MLP, rotary embedding, head), so LoRA
    layers apply; only the attention and the cache are written here: scaled_dot_product_attention over the
    cache with a key mask (left padding), causal inside the prompt. ``logits`` equals the model's forward
    (up to float rounding): tests/test_rollout_sampler.py checks it on Llama, Qwen2 (GQA, q/k/v biases), Qwen3
    (q/k norms) and LoRA. For small float32 models with plain linear layers the projections run fused
    (``_fused_layer``), and ``sample(compiled=True)`` runs each step through torch.compile.
    """

    def __init__(self, model, decoder, total_len: int, fuse: bool = True):
        self.model, self.decoder = model, decoder
        cfg = model.config
        attn = decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.total_len = total_len
        self.dtype = decoder.embed_tokens.weight.dtype
        self.device = decoder.embed_tokens.weight.device
        positions = torch.arange(total_len, device=self.device)[None]
        cos, sin = decoder.rotary_emb(decoder.embed_tokens.weight[:1], positions)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin[:D/2], sin[D/2:]]: two operations fewer per use
        half = self.head_dim // 2
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [L, head_dim]
        self.fast_norm = self.dtype == torch.float32
        self.layers = list(decoder.layers)
        mlp_names = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
        self.gated_mlp = all(type(layer.mlp).__name__ in mlp_names for layer in self.layers)
        self.fused = self._fuse_projections() if fuse else None

    @classmethod
    def for_model(cls, model, total_len: int, fuse: bool = True) -> "KVSampler | None":
        """The loop for ``model``, or None when its architecture is not one the loop reproduces exactly.
        ``fuse=False``: the modules' own projections (the fused copies pay for themselves over a rollout's many
        steps, not in one teacher-forced pass)."""
        found = decoder_parts(model, total_len)
        return cls(*found, total_len, fuse) if found is not None else None

    def _is_rms_norm(self, module) -> bool:
        return (self.fast_norm and getattr(module, "variance_epsilon", None) is not None
                and type(module).__name__.endswith("RMSNorm"))

    def _fuse_projections(self) -> list[_FusedLayer] | None:
        """The layers' weights for ``_fused_layer``, or None (the modules run as they are) unless the model is
        float32 with plain linear projections, a SiLU-gated MLP without gate/up biases, RMSNorms, and the copies
        fit in FUSE_MAX_BYTES (LoRA layers, other dtypes and big models keep the modules)."""
        if not self.gated_mlp:
            return None
        total = 0
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, attn.o_proj, mlp.down_proj)
            if not all(type(m) is torch.nn.Linear for m in linears):
                return None  # LoRA layers (or anything else) keep their own call
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
            if not all(self._is_rms_norm(n) for n in norms) or type(mlp.act_fn).__name__ not in _SILU_ACTIVATIONS:
                return None
            if len({m.bias is None for m in linears[:3]}) > 1 or mlp.gate_proj.bias is not None \
                    or mlp.up_proj.bias is not None:
                return None
            total += sum(m.weight.numel() * m.weight.element_size() for m in linears[:5])
        if total > FUSE_MAX_BYTES:
            return None
        fused = []
        with torch.no_grad():  # the sampling loop needs no gradient
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
                bias = (None if attn.q_proj.bias is None
                        else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                qk_norm = hasattr(attn, "q_norm")
                fused.append(_FusedLayer(
                    qkv.mul_(layer.input_layernorm.weight), bias, layer.input_layernorm.variance_epsilon,
                    attn.o_proj.weight, attn.o_proj.bias, gate_up.mul_(layer.post_attention_layernorm.weight),
                    layer.post_attention_layernorm.variance_epsilon, mlp.down_proj.weight, mlp.down_proj.bias,
                    attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None,
                    attn.q_norm.variance_epsilon if qk_norm else 0.0))
        return fused

    def _norm(self, module, x: Tensor) -> Tensor:
        if self._is_rms_norm(module):
            return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
        return module(x)

    def _layer(self, layer, h: Tensor, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor], start: int,
               mask: Tensor) -> Tensor:
        b, s, _ = h.shape
        attn, mlp = layer.self_attn, layer.mlp
        x = self._norm(layer.input_layernorm, h)
        q = _linear(attn.q_proj, x).reshape(b, s, self.n_heads, self.head_dim)
        k = _linear(attn.k_proj, x).reshape(b, s, self.n_kv, self.head_dim)
        v = _linear(attn.v_proj, x).reshape(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rotary(q.transpose(1, 2), cos, sin)
        k = _rotary(k.transpose(1, 2), cos, sin)
        h = h + _linear(attn.o_proj, _attend(q, k, v, *cache, start, mask, self.scaling))
        x = self._norm(layer.post_attention_layernorm, h)
        if self.gated_mlp:  # down(act(gate(x)) * up(x)), as Llama/Mistral/Qwen's MLP computes it
            return h + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)).mul_(_linear(mlp.up_proj, x)))
        return h + mlp(x)

    def logits(self, ids_BS: Tensor, positions_BS: Tensor, start: int, mask: Tensor, caches) -> Tensor:
        """Next-token logits after the last of ``ids_BS`` (placed at cache columns start..start+S-1), [B, V]."""
        cos, sin = self.cos[positions_BS].unsqueeze(1), self.sin[positions_BS].unsqueeze(1)  # [B, 1, S, D]
        return self._logits(ids_BS, cos, sin, start, mask, caches)

    def _logits(self, ids_BS: Tensor, cos: Tensor, sin: Tensor, start: int, mask: Tensor, caches,
                last_only: bool = True) -> Tensor:
        """Logits after the last of ``ids_BS`` [B, V], or after each of them [B, S, V] (``last_only=False``)."""
        h = self.decoder.embed_tokens(ids_BS)
        if self.fused is not None:
            for w, (keys, values) in zip(self.fused, caches):
                h = _fused_layer(w, h, cos, sin, keys, values, start, mask, self.n_heads, self.scaling)
        else:
            for layer, cache in zip(self.layers, caches):
                h = self._layer(layer, h, cos, sin, cache, start, mask)
        return self.model.lm_head(self._norm(self.decoder.norm, h[:, -1] if last_only else h))

    def teacher_forced_logits(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                              group_size: int | Tensor = 1) -> tuple[Tensor, Tensor]:
        """The model's next-token logits over given completions, as its forward on prompt + completion gives them
        at positions P-1 .. P+T-2, with each distinct prompt run once: rows [i*G, (i+1)*G) of ``completion_ids``
        [B, T] continue ``prompt_ids[i]`` (``group_size`` G), or row r continues ``prompt_ids[group_size[r]]``
        (``group_size`` a tensor of prompt indices [B]). Returns (logits predicting completion token 0 [B, V], logits
        predicting tokens 1..T-1 [B, T-1, V], None when T = 1); differentiable when gradients are on."""
        caches, first, keys_valid, last = self.prefill_groups(prompt_ids, prompt_mask, group_size)
        (b, t), p = completion_ids.shape, prompt_ids.shape[1]
        if t == 1:
            return first, None
        steps = last + 1 + torch.arange(t - 1, device=self.device)
        cos, sin = self.cos[steps].unsqueeze(1), self.sin[steps].unsqueeze(1)
        # completion query i sees the valid prompt keys and completion keys 0..i
        causal = torch.ones(t - 1, t - 1, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([keys_valid[:, None, :p].expand(b, t - 1, p), causal.expand(b, t - 1, t - 1)], dim=-1)
        rest = self._logits(completion_ids[:, :-1], cos, sin, p, mask[:, None], caches, last_only=False)
        return first, rest

    def _compilable(self) -> tuple | None:
        """(embedding, final norm weight, its eps, head weight, head bias) when the whole step is tensors only:
        fused layers, plain embedding and head without hooks, an RMSNorm at the end; else None."""
        embed, head, norm = self.decoder.embed_tokens, self.model.lm_head, self.decoder.norm
        if self.fused is None or type(embed) is not torch.nn.Embedding or type(head) is not torch.nn.Linear:
            return None
        if embed.max_norm is not None or not self._is_rms_norm(norm):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in (embed, head, norm)):
            return None
        return embed.weight, norm.weight, norm.variance_epsilon, head.weight, head.bias

    def new_caches(self, batch: int):
        shape = (batch, self.n_kv, self.total_len, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, caches) -> tuple[Tensor, Tensor, Tensor]:
        """Run the (left-padded) prompts; returns (next-token logits, key mask [B, L], last positions [B, 1])."""
        b, p = prompt_ids.shape
        keys_valid = torch.ones(b, self.total_len, dtype=torch.bool, device=self.device)
        keys_valid[:, :p] = prompt_mask.bool()
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        # A padding query attends to itself only (a fully masked row would give NaN); no real token sees it.
        mask = (causal & keys_valid[:, None, :p]) | torch.eye(p, dtype=torch.bool, device=self.device)
        return self.logits(prompt_ids, positions, 0, mask[:, None], caches), keys_valid, positions[:, -1:]

    def prefill_groups(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int | Tensor):
        """:meth:`prefill` on each distinct prompt once, then its caches, next-token logits, key mask and last
        position copied to its ``group_size`` rows: (caches, logits [B*G, V], key mask [B*G, L], [B*G, 1]).
        ``group_size`` a tensor [B]: row r gets prompt ``group_size[r]``'s."""
        caches = self.new_caches(prompt_ids.shape[0])
        logits, keys_valid, last = self.prefill(prompt_ids, prompt_mask, caches)
        if isinstance(group_size, Tensor):
            caches = [(k.index_select(0, group_size), v.index_select(0, group_size)) for k, v in caches]
            logits, keys_valid, last = (x.index_select(0, group_size) for x in (logits, keys_valid, last))
        elif group_size > 1:
            caches = [(k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)) for k, v in caches]
            logits, keys_valid, last = (x.repeat_interleave(group_size, 0) for x in (logits, keys_valid, last))
        return caches, logits, keys_valid, last

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, temperature: float,
               top_p: float, top_k: int, pad_id: int, eos_ids: list[int], group_size: int = 1,
               compiled: bool = False, with_logprobs: bool = False, min_p: float = 0.0
               ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Completion ids [B * group_size, n], n <= max_new_tokens (the loop stops once every row has emitted an
        EOS), rows [i*G, (i+1)*G) continuing prompt i; after its EOS a row holds ``pad_id``, as ``generate`` pads
        it. Each prompt is prefilled once and its cache copied to its G rows. ``compiled``: the steps after the
        first run through torch.compile (``_decode_step``) where the model allows it (``_compilable``).
        ``with_logprobs``: (ids, the tokens' log-probs under the distribution drawn from, float32 [B * G, n], the
        size of the kept set each was drawn from, int32 [B * G, n])."""
        caches, logits, keys_valid, last = self.prefill_groups(prompt_ids, prompt_mask, group_size)
        b, p = keys_valid.shape[0], prompt_ids.shape[1]
        # cos/sin of every step's position at once: [B, 1, steps, D], one column per step
        steps = last + 1 + torch.arange(max_new_tokens, device=self.device)
        cos, sin = self.cos[steps].unsqueeze(1), self.sin[steps].unsqueeze(1)
        out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=self.device)
        kept = torch.zeros((b, max_new_tokens), dtype=torch.int32, device=self.device)
        eos = torch.tensor(eos_ids or [-1], device=self.device)
        head = self._compilable() if compiled else None
        if head is not None:
            step = _compiled_step((tuple(w.shape for w in head if isinstance(w, Tensor)), len(self.fused),
                                   self.fused[0].qkv.shape, self.fused[0].down.shape, self.dtype, self.device))
        columns = torch.arange(p, p + max_new_tokens, device=self.device)
        token, logp, count = draw_next_token(logits, temperature, top_k, top_p, min_p)
        done = torch.isin(token, eos)
        n = 0
        for t in range(max_new_tokens):
            out[:, t], logps[:, t], kept[:, t], n = token, logp, count, t + 1
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            if head is not None:
                token, done, logp, count = step(token, cos[:, :, t:t + 1], sin[:, :, t:t + 1], columns[t:t + 1],
                                         keys_valid, done, caches, self.fused, head, self.n_heads,
                                         self.scaling, (temperature, top_k, top_p, min_p, pad_id), eos)
            else:
                logits = self._logits(token[:, None], cos[:, :, t:t + 1], sin[:, :, t:t + 1], p + t,
                                      keys_valid[:, None, None, :p + t + 1], caches)
                token, logp, count = draw_next_token(logits, temperature, top_k, top_p, min_p)
                token = token.masked_fill(done, pad_id)
                done = done | torch.isin(token, eos)
        return (out[:, :n], logps[:, :n], kept[:, :n]) if with_logprobs else out[:, :n]
