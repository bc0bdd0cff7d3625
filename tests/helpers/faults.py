"""Reward functions for the multi-process fault tests (loaded by path from a config's rewards / eval sets).

``fault``: a reward of 1 for a "0" in the completion, except that on process ``rank`` at its call number
``call`` (one call per generated batch: mid-step) it raises, SIGKILLs its own process or sleeps.
``kill_each_attempt``: a reward that SIGKILLs process ``rank`` at its call ``call`` of each attempt (a
launcher's restart is a new attempt) until ``kills_file`` lists ``times`` kills.
``completion_checksum``: an evaluation score that any change of a greedy completion changes.
"""

import os
import signal
import time

_calls = {"n": 0}


def fault(prompts, completions, kind="raise", rank=1, call=2, seconds=0.0, **_):
    _calls["n"] += 1
    if int(os.environ.get("RANK", "0")) == rank and _calls["n"] == call:
        print(f"fault injected: {kind} on rank {rank} at call {call} ({time.time():.3f})", flush=True)
        if kind == "raise":
            raise RuntimeError("injected failure on this rank")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sleep":
            time.sleep(seconds)
    return [1.0 if "0" in c else 0.0 for c in completions]


def completion_checksum(prompts, completions, **_):
    return [(sum(ord(ch) * (i + 1) for i, ch in enumerate(c)) % 101) / 100 for c in completions]


def kill_each_attempt(prompts, completions, kills_file, rank=1, call=3, times=2, **_):
    _calls["n"] += 1
    if int(os.environ.get("RANK", "0")) == rank and _calls["n"] == call:
        with open(kills_file, "a+") as f:
            f.seek(0)
            done = len(f.read().splitlines())
            if done < times:
                f.write(f"{time.time():.3f}\n")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    return [1.0 if "0" in c else 0.0 for c in completions]
