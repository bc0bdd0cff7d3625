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

A server that is down, stops answering or answers 5xx: ``retries`` more tries with a growing pause (capped at
RETRY_PAUSE_MAX_S), then one KLGRPOError naming the URL and the fix. An answer that is the same on every try (an
address that is no URL, a 4xx, an answer that is not JSON) is not tried again. ``timeout_s`` bounds the whole of
one request (connecting, the answer's head and body), so a server trickling its answer is cut off at it. The
rollout runs before the step's optimizer step, so a failed step changes nothing and the last checkpoint stays as
it was.
"""

from __future__ import annotations

import atexit
import errno
import functools
import http.client
import json
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import torch
from torch import Tensor

from klgrpo.backends.sampling import SampledRollout, Sampler
from klgrpo.backends.vllm_sampler import vllm_filters, weights_state
from klgrpo.backends.weights import named_whole_weights, whole_weight_specs
from klgrpo.errors import ConfigError, KLGRPOError, first_line

#: rollout.vllm.server_timeout / server_retries defaults: seconds one request may take, tries after the first
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 3
#: rollout.vllm.group_port's default: TRL's vllm_group_port
DEFAULT_GROUP_PORT = 51216
#: the pause before retry i (0-based) is RETRY_PAUSE_S * 2**i, at most RETRY_PAUSE_MAX_S (retry_pauses)
RETRY_PAUSE_S = 0.5
RETRY_PAUSE_MAX_S = 4.0
#: how to start a server, said in every "no answer" error
START_HINT = ("start one (python -m klgrpo.backends.vllm_server_main --model DIR --port PORT, or trl vllm-serve) "
              "or fix rollout.vllm.server_url")


#: what a server_url refusal says to give instead
URL_FORM = "give the server's address as http://HOST:PORT (e.g. http://127.0.0.1:8000; an IPv6 host in brackets, " \
           "http://[::1]:8000)"


def server_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as rollout.vllm.server_url (urllib.parse's reading of it), None where nothing
    is: an http or https URL with a host, a port (if any) in 1-65535, no query or fragment (the request's path
    is appended to it), no space or control character."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "has a space or a control character in it"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # "Invalid IPv6 URL", "Port could not be cast to integer value as 'x'", out of range
        return f"is not a valid URL ({e})"
    if "://" not in url:
        return "has no scheme (http:// or https://) in front"
    if parts.scheme not in ("http", "https"):
        return f"has the scheme {parts.scheme}://, not http:// or https://"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "has the port 0, which no server listens on"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "has a query or a fragment (?... or #...), which the request paths cannot follow"
    return None


def check_server_url(url: str) -> None:
    """Refuse (ConfigError, one line naming rollout.vllm.server_url and the fix) an empty or malformed address."""
    if not url:
        raise ConfigError("rollout.sampler vllm_server needs rollout.vllm.server_url (e.g. "
                          "http://127.0.0.1:8000): the address of a running vLLM server")
    problem = server_url_problem(url)
    if problem is not None:
        raise ConfigError(f"rollout.vllm.server_url {url!r} {problem}: {URL_FORM}")


def retry_pauses(retries: int) -> list[float]:
    """The pauses (seconds) before each of ``retries`` tries after the first: 0.5, 1, 2, 4, 4, ..."""
    return [min(RETRY_PAUSE_S * 2 ** i, RETRY_PAUSE_MAX_S) for i in range(retries)]


def longest_wait_s(retries: int, timeout_s: float) -> float:
    """The longest a request can take before its failure is said: every try running into ``timeout_s``, and the
    pauses between them."""
    return (retries + 1) * timeout_s + sum(retry_pauses(retries))


class _Deadline:
    """One request's time limit over all of it (connecting, sending, the answer's head and body): when it passes
    a timer thread shuts the connection's socket, which ends a read blocked on it or fed a byte at a time (a
    socket timeout alone bounds each read, not their sum)."""

    def __init__(self, seconds: float):
        self.passed, self._sock, self._lock = False, None, threading.Lock()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *_) -> None:
        self._timer.cancel()

    def attach(self, sock) -> None:
        """The connection's socket, once connected (shut at once where the deadline already passed)."""
        with self._lock:
            self._sock = sock
            if self.passed:
                _shut(sock)

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            if self._sock is not None:
                _shut(self._sock)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _Attached:
    """An http.client connection that hands its socket to a _Deadline when it connects."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.deadline.attach(self.sock)


class _Connection(_Attached, http.client.HTTPConnection):
    pass


class _SecureConnection(_Attached, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.HTTPHandler):
    """urllib's handler of http:// (proxies and redirects as urlopen's), its connections under a deadline."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_Connection, deadline=self.deadline), req)


class _SecureHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_SecureConnection, deadline=self.deadline), req,
                            context=self._context)


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
        weight_transfer, group_port); refused without a server_url or with a malformed one (``check_server_url``,
        which the config's validation runs too)."""
        check_server_url("" if settings is None else settings.server_url)
        if settings.weights_dir and settings.weight_transfer == "folder":
            check_weights_dir(settings.weights_dir)
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
    """HTTP to one vLLM server, and the weights last sent to it. ``sleep`` waits out the pauses between tries."""

    def __init__(self, url: str, timeout_s: float, retries: int, weights_dir: str = "",
                 weight_transfer: str = "folder", group_port: int = DEFAULT_GROUP_PORT, sleep=time.sleep):
        check_server_url(url)
        self.url, self.timeout_s, self.retries = url.rstrip("/"), timeout_s, retries
        self.weight_transfer, self.group_port, self.sleep = weight_transfer, group_port, sleep
        if not weights_dir and weight_transfer == "folder":  # a policy-sized file: removed when the process ends
            weights_dir = tempfile.mkdtemp(prefix="klgrpo-vllm-weights-")
            atexit.register(shutil.rmtree, weights_dir, ignore_errors=True)
        self.weights_dir = weights_dir
        self.sent: tuple | None = None  # weights_state of the policy at the last reload
        self.reloads = 0
        self._model_name: str | None = None
        self._nccl = None  # TRL's VLLMClient, its communicator open (weight_transfer nccl)

    def request(self, path: str, body: dict | None = None):
        """The JSON answer of GET (``body`` None) or POST ``path``. A refused or failed connection, a try that ran
        out of ``timeout_s`` or a 5xx answer is tried again up to ``retries`` times after ``retry_pauses``, then a
        KLGRPOError says so; an answer that would be the same again (``_try``) is a KLGRPOError at once."""
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        reason = ""
        for pause in [0.0, *retry_pauses(self.retries)]:
            if pause:
                self.sleep(pause)
            answered, value = self._try(path, data, headers)
            if answered:
                return value
            reason = value
        raise KLGRPOError(f"the vLLM server at {self.url} gave no answer to {path} after {self.retries + 1} "
                          f"tries ({reason}): {START_HINT}")

    def _try(self, path: str, data: bytes | None, headers: dict) -> tuple[bool, object]:
        """One try: (True, the answer's JSON), or (False, why another try may get one: refused, reset, a name
        that did not resolve, no whole answer within ``timeout_s``, a 5xx). A 4xx (a redirect urllib does not
        follow included), an address urllib cannot open, an answer that is not JSON would be the same again: a
        KLGRPOError now."""
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        timed_out = (f"no whole answer within rollout.vllm.server_timeout {self.timeout_s:g} s; raise it if the "
                     f"server is only slow")
        with _Deadline(self.timeout_s) as deadline:
            opener = urllib.request.build_opener(_Handler(deadline), _SecureHandler(deadline))
            try:
                with opener.open(req, timeout=self.timeout_s) as answer:
                    text = answer.read()
            except urllib.error.HTTPError as e:
                if e.code < 500 and not deadline.passed:
                    raise KLGRPOError(self._refused(path, e)) from None
                return False, timed_out if deadline.passed else f"HTTP {e.code}"
            except urllib.error.URLError as e:
                if not isinstance(e.reason, OSError) and not deadline.passed:  # urllib refused the address itself
                    raise KLGRPOError(f"the vLLM server at {self.url} cannot be reached at {path} ({e.reason}): "
                                      f"{URL_FORM}") from None
                return False, timed_out if deadline.passed else str(e.reason)
            except (OSError, http.client.HTTPException) as e:  # reset, timed out, an answer cut short
                return False, timed_out if deadline.passed else first_line(e)
        if deadline.passed:  # the socket was shut at the deadline: what was read may be a part
            return False, timed_out
        return True, self._parsed(path, text)

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
                 vocab_size: int | None = None, seed: int | None = None) -> tuple[Tensor, Tensor]:
        """(completion ids, their log-probs) of the prompts; ``seed`` the request's (None: drawn from the run's
        torch generator, so a resume draws the same)."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)))
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


#: what a weights_dir refusal says to give instead
WEIGHTS_DIR_FIX = ("give a writable folder that the trainer and the server both see (made if missing), or leave "
                   "rollout.vllm.weights_dir empty for a temporary one")


def check_weights_dir(folder: str) -> None:
    """rollout.vllm.weights_dir before anything is written into it (the config's validation, the sampler's open):
    a folder, or a path one can be made at; writable (a probe file made and removed); a model.safetensors there
    readable and klgrpo's. One ConfigError line naming the field and the fix otherwise."""
    where = os.path.abspath(folder)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)  # the nearest part that exists: the rest is made at the first write
    if not os.path.isdir(where):
        raise ConfigError(f"rollout.vllm.weights_dir {folder} is not a folder ({where} is a file or a device): "
                          f"{WEIGHTS_DIR_FIX}")
    if where != os.path.abspath(folder):
        if not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"rollout.vllm.weights_dir {folder} cannot be made ({where} is not writable): "
                              f"{WEIGHTS_DIR_FIX}")
        return
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".klgrpo-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"rollout.vllm.weights_dir {folder} cannot be written ({e.strerror or first_line(e)}): "
                          f"{WEIGHTS_DIR_FIX}") from None
    _check_existing_weights(folder)


def _check_existing_weights(folder: str) -> None:
    """A model.safetensors in ``folder`` is klgrpo's own (replaced), else refused: another's, or unreadable."""
    from safetensors import SafetensorError, safe_open

    target = os.path.join(folder, "model.safetensors")
    if not os.path.lexists(target):
        return
    try:
        with safe_open(target, "pt") as existing:
            writer = (existing.metadata() or {}).get(WRITER[0])
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"rollout.vllm.weights_dir {folder} holds a model.safetensors that cannot be read "
                          f"({first_line(e)}): remove it, or give an empty folder for the weights sent to the vLLM "
                          f"server") from None
    if writer != WRITER[1]:
        raise ConfigError(f"rollout.vllm.weights_dir {folder} holds a model.safetensors klgrpo did not "
                          "write: give an empty folder for the weights sent to the vLLM server")


def _os_error_code(exc: BaseException) -> int | None:
    """The errno of an OSError, or the "(os error N)" that safetensors' own SafetensorError says."""
    code = getattr(exc, "errno", None)
    if code is None and (m := re.search(r"\(os error (\d+)\)", str(exc))):
        code = int(m.group(1))
    return code


def write_weights(model, folder: str) -> None:
    """The policy's weights (a LoRA policy merged) as ``folder``/model.safetensors, written to a temporary name
    and renamed, so the server never reads half a file. Tensors sharing storage (tied embeddings) are copied:
    safetensors stores each once. A model.safetensors there that klgrpo did not write (a model folder given as
    rollout.vllm.weights_dir) or cannot read is refused, never overwritten. A write that fails (a full disk, a
    read-only folder) leaves no partial file and is one ConfigError line naming rollout.vllm.weights_dir."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if os.path.exists(folder) and not os.path.isdir(folder):
        check_weights_dir(folder)  # refuses it, in the words of the up-front check
    if os.path.isdir(folder):
        _check_existing_weights(folder)
    tensors, seen = {}, set()
    for name, value in named_whole_weights(model):
        value = value.detach().cpu().contiguous()
        tensors[name] = value.clone() if value.data_ptr() in seen else value
        seen.add(value.data_ptr())
    partial = os.path.join(folder, "model.safetensors.partial")
    try:
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, partial, metadata={"format": "pt", WRITER[0]: WRITER[1]})
        os.replace(partial, os.path.join(folder, "model.safetensors"))
    except (OSError, SafetensorError) as e:
        if os.path.lexists(partial):
            os.remove(partial)
        if _os_error_code(e) in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(f"rollout.vllm.weights_dir {folder}: no space left on the device for the policy's "
                              f"weights: free space there, or point rollout.vllm.weights_dir at a folder on another "
                              f"disk") from None
        reason = getattr(e, "strerror", None) or first_line(e)
        raise ConfigError(f"rollout.vllm.weights_dir {folder}: cannot write the policy's weights ({reason}): "
                          f"{WEIGHTS_DIR_FIX}") from None
