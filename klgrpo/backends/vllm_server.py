"""A vLLM server as the sampler (``rollout.sampler: vllm_server``): generation over HTTP on another process,
other GPUs or another machine, speaking the protocol of TRL 1.16's ``VLLMClient`` (vLLM's own OpenAI-compatible
server, which ``trl vllm-serve`` runs):

    GET  /health, /v1/models          is it up, and the served model's name
    POST /v1/completions              prompts as token ids, n = G, temperature, top_p, top_k, max_tokens,
                                      logprobs 0 (the sampled token's), return_token_ids,
                                      return_tokens_as_token_ids; plus klgrpo's stop rule (stop_token_ids = the
                                      run's EOS ids, ignore_eos) and a seed from torch's generator
    POST /collective_rpc              weights: vLLM's own ``reload_weights`` from a folder both sides see, into
                                      which the trainer writes the policy's safetensors whenever an optimizer
                                      step changed them (needs VLLM_SERVER_DEV_MODE=1, which both
                                      ``trl vllm-serve`` and ``python -m klgrpo.backends.vllm_server_main`` set)
    POST /reset_prefix_cache          after a reload: no cached prompt keeps the old weights' keys and values

or, with ``rollout.vllm.weight_transfer: nccl`` on CUDA, the weights broadcast tensor by tensor over the server's
NCCL weight-transfer engine (``--weight-transfer-config '{"backend": "nccl"}'``, which ``trl vllm-serve`` sets)
through TRL's own ``VLLMClient`` (``init_communicator`` once, then ``weight_update`` / ``update_named_params``):
no file, no folder both sides must see.

The server must log-prob the sampled tokens after temperature and the filters (``--logprobs-mode
processed_logprobs``, as both servers above do), so ``sampler_logp`` is the distribution drawn from, as the
colocated ``vllm`` sampler reports it.

A server that is down or stops answering: ``retries`` more tries with a growing pause, then one KLGRPOError
naming the URL and the fix. The rollout runs before the step's optimizer step, so a failed step changes nothing
and the last checkpoint stays as it was.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request

import torch
from torch import Tensor

from klgrpo.backends.sampling import SampledRollout, Sampler
from klgrpo.backends.vllm_sampler import vllm_filters, weights_state
from klgrpo.backends.weights import named_whole_weights, whole_weight_specs
from klgrpo.errors import ConfigError, KLGRPOError

#: rollout.vllm.server_timeout / server_retries defaults: seconds one request may take, tries after the first
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 3
#: rollout.vllm.group_port's default: TRL's vllm_group_port
DEFAULT_GROUP_PORT = 51216
#: the pause before retry i (0-based) is RETRY_PAUSE_S * 2**i
RETRY_PAUSE_S = 0.5
#: how to start a server, said in every "no answer" error
START_HINT = ("start one (python -m klgrpo.backends.vllm_server_main --model DIR --port PORT, or trl vllm-serve) "
              "or fix rollout.vllm.server_url")


class VLLMServerSampler(Sampler):
    """The registered ``vllm_server`` sampler; a run's instance (``open``: rollout.vllm's server fields) keeps one
    ``ServerClient`` (the weights it last sent). The weights are sent from the policy gathered whole for the
    rollout, inside ``sample``, when the step's weights version moved."""

    name = "vllm_server"

    def __init__(self, server_url: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
                 weights_dir: str = "", weight_transfer: str = "folder", group_port: int = DEFAULT_GROUP_PORT):
        super().__init__()
        self.server_url, self.timeout_s, self.retries, self.weights_dir = server_url, timeout_s, retries, weights_dir
        self.weight_transfer, self.group_port = weight_transfer, group_port
        self._client: ServerClient | None = None

    @classmethod
    def open(cls, settings=None) -> "VLLMServerSampler":
        """The run's sampler from rollout.vllm (server_url, server_timeout, server_retries, weights_dir,
        weight_transfer, group_port); refused without a server_url."""
        if settings is None or not settings.server_url:
            raise ConfigError("rollout.sampler vllm_server needs rollout.vllm.server_url (e.g. "
                              "http://127.0.0.1:8000): the address of a running vLLM server")
        return cls(settings.server_url, settings.server_timeout, settings.server_retries, settings.weights_dir,
                   settings.weight_transfer, settings.group_port)

    def supports(self, model, total_len: int, params) -> bool:
        return params.temperature > 0

    @property
    def client(self) -> "ServerClient":
        if self._client is None:
            self._client = ServerClient(self.server_url, self.timeout_s, self.retries, self.weights_dir,
                                        self.weight_transfer, self.group_port)
        return self._client

    def sample(self, model, prompt_ids: Tensor, prompt_mask: Tensor, params, pad_id: int,
               eos_ids: list[int]) -> SampledRollout:
        self.client.sync(model, self.weights_version)
        ids, logp = self.client.generate(prompt_ids, prompt_mask, params, pad_id, eos_ids, vocab_size(model))
        return SampledRollout(ids, logp, vllm_filters(params), self.weights_version)


class ServerClient:
    """HTTP to one vLLM server, and the weights last sent to it."""

    def __init__(self, url: str, timeout_s: float, retries: int, weights_dir: str = "",
                 weight_transfer: str = "folder", group_port: int = DEFAULT_GROUP_PORT):
        self.url, self.timeout_s, self.retries = url.rstrip("/"), timeout_s, retries
        self.weight_transfer, self.group_port = weight_transfer, group_port
        if not weights_dir and weight_transfer == "folder":  # a policy-sized file: removed when the process ends
            weights_dir = tempfile.mkdtemp(prefix="klgrpo-vllm-weights-")
            atexit.register(shutil.rmtree, weights_dir, ignore_errors=True)
        self.weights_dir = weights_dir
        self.sent: tuple | None = None  # weights_state of the policy at the last reload
        self.reloads = 0
        self._model_name: str | None = None
        self._nccl = None  # TRL's VLLMClient, its communicator open (weight_transfer nccl)

    def request(self, path: str, body: dict | None = None):
        """The JSON answer of GET (``body`` None) or POST ``path``; a refused or failed connection, a timeout or
        a 5xx answer is tried again up to ``retries`` times, then a KLGRPOError says so."""
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(self.url + path, data=data, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout_s) as answer:
                    text = answer.read()
                return self._parsed(path, text)
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise KLGRPOError(self._refused(path, e)) from None
                reason = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
                reason = str(getattr(e, "reason", e))
        raise KLGRPOError(f"the vLLM server at {self.url} gave no answer to {path} after {self.retries + 1} "
                          f"tries ({reason}): {START_HINT}")

    def _parsed(self, path: str, text: bytes):
        """The JSON of an answer (None for an empty one); an answer that is not JSON is refused in one line."""
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise KLGRPOError(self.wrong(path, f"its answer is not JSON ({text[:80]!r})")) from None

    def wrong(self, path: str, what: str) -> str:
        """The one line saying that the server's answer to ``path`` cannot be used, and why."""
        return f"the vLLM server at {self.url} answered {path} with something klgrpo cannot use: {what}"

    def _refused(self, path: str, error) -> str:
        detail = error.read().decode(errors="replace").replace("\n", " ")[:200]
        if error.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
            return (f"the vLLM server at {self.url} has no {path} (HTTP 404): start it with VLLM_SERVER_DEV_MODE=1 "
                    "(python -m klgrpo.backends.vllm_server_main and trl vllm-serve set it)")
        return f"the vLLM server at {self.url} refused {path} (HTTP {error.code}: {detail})"

    @property
    def model_name(self) -> str:
        if self._model_name is None:
            self.request("/health")
            models = self.request("/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
                raise KLGRPOError(self.wrong("/v1/models", "it lists no served model (no data[0].id)"))
            self._model_name = data[0]["id"]
        return self._model_name

    def sync(self, model, version: int = 0) -> bool:
        """Send ``model``'s weights when they changed since the last send (``weights_state``: the step's weights
        ``version``, a load into the parameters, another policy); returns whether it sent."""
        state = weights_state(model, version)
        if state == self.sent:
            return False
        _ = self.model_name  # the server is up before the weights are written
        if self.weight_transfer == "nccl":
            self.broadcast_weights(model)
        else:
            write_weights(model, self.weights_dir)
            self.request("/collective_rpc", {"method": "reload_weights",
                                             "kwargs": {"weights_path": self.weights_dir}})
        self.request("/reset_prefix_cache", {})
        self.sent, self.reloads = state, self.reloads + 1
        return True

    def broadcast_weights(self, model) -> None:
        """``model``'s weights (a LoRA policy merged) over the server's NCCL weight-transfer engine, through TRL
        1.16's own client: the names, dtypes and shapes announced first, then one tensor after another."""
        if self._nccl is None:
            device = next(model.parameters()).device
            if device.type != "cuda":
                raise ConfigError(f"rollout.vllm.weight_transfer nccl needs the policy on a CUDA device (it is on "
                                  f"{device.type}): use rollout.vllm.weight_transfer folder")
            try:  # TRL's client needs vllm and requests beside it
                from trl.generation.vllm_client import VLLMClient

                client = VLLMClient(base_url=self.url, group_port=self.group_port, connection_timeout=self.timeout_s)
            except ImportError as e:
                raise ConfigError(f"rollout.vllm.weight_transfer nccl talks to the server through TRL's VLLMClient, "
                                  f"which could not start ({e}): pip install 'trl[vllm]', or use "
                                  "rollout.vllm.weight_transfer folder") from None
            client.init_communicator(device)  # the server's error names a missing --weight-transfer-config
            self._nccl = client
        announced = [(name, str(dtype).removeprefix("torch."), shape)
                     for name, dtype, shape in whole_weight_specs(model)]
        with self._nccl.weight_update():
            self._nccl.update_named_params(announced, named_whole_weights(model))

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params, pad_id: int, eos_ids: list[int],
                 vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # from the run's generator: a resume draws the same
        body = {"model": self.model_name, "prompt": prompts, "n": params.group_size,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "min_p": params.min_p, "max_tokens": params.max_new_tokens, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "stop_token_ids": list(eos_ids), "ignore_eos": True,
                "seed": seed}
        answer = self.request("/v1/completions", body)
        choices = checked_choices(answer, len(prompts) * params.group_size, vocab_size,
                                  lambda what: self.wrong("/v1/completions", what))
        return completions_to_tensors(choices, pad_id, prompt_ids.device)


def checked_choices(answer, rows: int, vocab_size: int | None, wrong) -> list[dict]:
    """The completions answer's choices in order, each checked before any is used: ``rows`` of them (G per
    prompt), token ids that are integers inside the policy's vocabulary, one finite log-prob <= 0 per token.
    ``wrong(what)`` makes the one-line message of what is not so (raised as a KLGRPOError)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != rows:
        got = len(choices) if isinstance(choices, list) else "no"
        raise KLGRPOError(wrong(f"{got} choices where {rows} were asked for (G per prompt)"))
    try:
        choices = sorted(choices, key=lambda c: c["index"])
    except (KeyError, TypeError):
        raise KLGRPOError(wrong("a choice without an index")) from None
    for c in choices:
        ids = c.get("token_ids")
        logps = (c.get("logprobs") or {}).get("token_logprobs") if isinstance(c.get("logprobs"), dict) else None
        where = f"choice {c['index']}"
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise KLGRPOError(wrong(f"{where} has no list of integer token_ids"))
        if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise KLGRPOError(wrong(f"{where} has token id {bad}, outside the policy's vocabulary of {vocab_size} "
                                    f"(is it serving another model?)"))
        if not isinstance(logps, list) or len(logps) != len(ids):
            n = len(logps) if isinstance(logps, list) else "no"
            raise KLGRPOError(wrong(f"{where} has {n} log-probs for its {len(ids)} tokens (logprobs 0 asks for "
                                    f"one per token)"))
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v > 0
               for v in logps):
            bad = next(v for v in logps if not isinstance(v, (int, float)) or isinstance(v, bool)
                       or not math.isfinite(v) or v > 0)
            raise KLGRPOError(wrong(f"{where} has the log-prob {bad!r}, not a finite number <= 0"))
    return choices


def vocab_size(model) -> int | None:
    """The number of token ids the policy scores (its output embedding's rows), None where it has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None and hasattr(head, "weight") else None


def completions_to_tensors(choices: list[dict], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(ids [rows, T] padded with ``pad_id``, the sampled tokens' log-probs [rows, T], 0 after the end) of the
    server's choices in order (prompt-major: the G completions of a prompt together)."""
    width = max(len(c["token_ids"]) for c in choices)
    ids = torch.full((len(choices), width), pad_id, dtype=torch.long)
    logp = torch.zeros((len(choices), width), dtype=torch.float32)
    for i, c in enumerate(choices):
        n = len(c["token_ids"])
        ids[i, :n] = torch.tensor(c["token_ids"], dtype=torch.long)
        logp[i, :n] = torch.tensor(c["logprobs"]["token_logprobs"][:n], dtype=torch.float32)
    return ids.to(device), logp.to(device)


#: the metadata entry marking a weights file as klgrpo's: only such a file is ever overwritten
WRITER = ("written_by", "klgrpo vllm_server")


def write_weights(model, folder: str) -> None:
    """The policy's weights (a LoRA policy merged) as ``folder``/model.safetensors, written to a temporary name
    and renamed, so the server never reads half a file. Tensors sharing storage (tied embeddings) are copied:
    safetensors stores each once. A model.safetensors there that klgrpo did not write (a model folder given as
    rollout.vllm.weights_dir) is refused, never overwritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = os.path.join(folder, "model.safetensors")
    if os.path.exists(target):
        with safe_open(target, "pt") as existing:
            if (existing.metadata() or {}).get(WRITER[0]) != WRITER[1]:
                raise ConfigError(f"rollout.vllm.weights_dir {folder} holds a model.safetensors klgrpo did not "
                                  "write: give an empty folder for the weights sent to the vLLM server")

    tensors, seen = {}, set()
    for name, value in named_whole_weights(model):
        value = value.detach().cpu().contiguous()
        tensors[name] = value.clone() if value.data_ptr() in seen else value
        seen.add(value.data_ptr())
    os.makedirs(folder, exist_ok=True)
    partial = os.path.join(folder, "model.safetensors.partial")
    save_file(tensors, partial, metadata={"format": "pt", WRITER[0]: WRITER[1]})
    os.replace(partial, target)
