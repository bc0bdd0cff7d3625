"""``klgrpo eval CHECKPOINT_OR_MODEL [--config FILE] [--set NAME ...] [--json FILE [--overwrite]]
[--group.field VALUE ...]``: the evaluation sets of a config (``eval.sets``) on any model folder, greedy,
without training.

The numbers are the ones training logs as ``eval/<name>`` for that checkpoint: the same sets, prompt templating,
greedy decoding, length limit and reward (the trainer's ``evaluate_sets``). Without ``--config`` a checkpoint
inside a run folder (``<run>/checkpoints/step_N``) uses the run's config.yaml.
"""

from __future__ import annotations

import json

from klgrpo.errors import ConfigError

USAGE = """usage: klgrpo eval CHECKPOINT_OR_MODEL [--config FILE] [--set NAME ...] [--json FILE [--overwrite]] \
[--group.field VALUE ...]

Greedy accuracy of a model folder (a checkpoint, a merged export, a hub name) on the eval.sets of a config,
the same numbers `klgrpo train` logs as eval/<name> for that checkpoint.

  CHECKPOINT_OR_MODEL  runs/<name>/checkpoints/step_N, a transformers model folder, or a hub name
  --config FILE        the YAML whose eval.sets (and data.as_chat, system_prompt, eval.max_new_tokens, model.dtype
                       and device) apply; default: the run's config.yaml when the model is a run's checkpoint
  --set NAME           evaluate only this set (repeat for several); default: all of eval.sets
  --json FILE          also write the results as JSON (never over the model, the config or an eval set)
  --overwrite          let --json replace an existing file
  --group.field VALUE  override a config field, as in klgrpo train (e.g. --eval.max_new_tokens 16)
"""


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0 if argv else 2
    return 0 if run(argv) is not None else 1


def parse(argv: list[str]):
    """(model path, config, config source, set names, json path, overwrite)."""
    from klgrpo.apps.args import read_argv
    from klgrpo.apps.models import checkpoint_run_config
    from klgrpo.config.entries import eval_set_specs

    model_path = argv[0]
    if model_path.startswith("--"):
        raise ConfigError("klgrpo eval needs the model first: klgrpo eval CHECKPOINT_OR_MODEL --config FILE")
    command = read_argv(argv[1:], own=("set", "json"))
    if command.resume or command.print_config:
        raise ConfigError(f"klgrpo eval takes no --{'resume' if command.resume else 'print-config'}: it evaluates "
                          f"the model given first (see klgrpo eval --help)")
    sets, json_path = command.own.get("set", []), (command.own.get("json") or [None])[-1]
    if command.config_file:
        cfg, source = command.config(), command.config_file
    else:
        base, source = checkpoint_run_config(model_path)
        if base is None:
            raise ConfigError(f"no config for {model_path}: pass --config FILE (its eval.sets are evaluated); a "
                              f"checkpoint inside a run folder uses the run's config.yaml")
        cfg = command.config(base)
    if not cfg.eval.sets:
        raise ConfigError(f"{source} has no eval.sets: add a list of {{name, source}} entries (klgrpo train --help, "
                          f"group eval)")
    names = [spec.name for spec in eval_set_specs(cfg.eval.sets)]
    unknown = [s for s in sets if s not in names]
    if unknown:
        raise ConfigError(f"--set {unknown[0]}: no such set in eval.sets of {source}; the sets are {', '.join(names)}")
    return model_path, cfg, str(source), sets, json_path, command.overwrite


def _for_evaluation(cfg, chosen: list[str]):
    """A changed copy of ``cfg`` (the config itself stays as read): only the ``chosen`` sets (all when none), and
    no progress bar."""
    from dataclasses import replace

    from klgrpo.config.entries import eval_set_specs

    sets = cfg.eval.sets
    if chosen:
        sets = [entry for entry, spec in zip(sets, eval_set_specs(sets)) if spec.name in chosen]
    return replace(cfg, eval=replace(cfg.eval, sets=sets), logging=replace(cfg.logging, progress=False))


def run(argv: list[str], out=print) -> dict | None:
    from klgrpo.apps.models import load_model_for_inference
    from klgrpo.apps.outputs import check_output, write_text_file
    from klgrpo.config.entries import eval_set_specs
    from klgrpo.core.rollout import context_overflow, encode_prompts
    from klgrpo.run.evaluation import evaluate_sets, load_eval_sets
    from klgrpo.train.metric_names import eval_entropy, eval_set

    model_path, cfg, source, chosen, json_path, overwrite = parse(argv)
    cfg = _for_evaluation(cfg, chosen)
    sets = load_eval_sets(cfg)
    if json_path is not None:
        inputs = {"the model": model_path, "the config": source,
                  **{f"eval set {spec.name}": spec.source for spec in eval_set_specs(cfg.eval.sets)}}
        check_output(json_path, "--json", inputs, overwrite)
    model, tokenizer = load_model_for_inference(model_path, cfg.model, field="CHECKPOINT_OR_MODEL")
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    for name, s in sets.items():
        texts = encode_prompts(tokenizer, s["prompts"], cfg.data.system_prompt, cfg.data.as_chat)
        if (over := context_overflow(model, tokenizer, texts, max_new)) is not None:
            raise ConfigError(f"prompt {over[0]} of eval set {name} has {over[1]} tokens: with {max_new} new tokens "
                              f"(eval.max_new_tokens, else rollout.max_new_tokens) it needs more positions than the "
                              f"model's context of {over[2]} (max_position_embeddings); lower eval.max_new_tokens")
    results = evaluate_sets(model, tokenizer, sets, cfg)
    out(f"klgrpo eval {model_path}  (eval.sets of {source}; greedy, {max_new} new tokens)")
    width = max(len(n) for n in sets)
    with_entropy = cfg.train.entropy_metrics
    out(f"  {'set':<{width}}  prompts  accuracy" + ("  entropy" if with_entropy else ""))
    for name, s in sets.items():
        entropy = f"  {results[eval_entropy(name)]:7.4f}" if with_entropy else ""
        out(f"  {name:<{width}}  {len(s['prompts']):>7}  {results[eval_set(name)]:8.4f}{entropy}")
    if json_path:
        payload = {"model": model_path, "config": source, "max_new_tokens": max_new,
                   "results": results, "prompts": {n: len(s["prompts"]) for n, s in sets.items()}}
        write_text_file(json_path, json.dumps(payload, indent=2), "--json")
        out(f"  written to {json_path}")
    return results
