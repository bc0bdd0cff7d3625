"""Run under ``accelerate launch`` with 2 CPU processes: ``shared_cache_worker.py CACHE RUN``. Every rank asks for
the demo assets (tiny settings) in CACHE, then builds a trainer with the replay anchor in RUN (under DDP every
rank builds the anchor); each prints what it did, prefixed by its rank."""

import os
import sys

from klgrpo.apps.demo.assets import prepare_demo_assets
from klgrpo.config.schema import GRPOConfig
from klgrpo.run.trainer import GRPOTrainer
from tests.test_shared_caches import TINY_DEMO

rank = os.environ.get("RANK", "0")


def log(message: str) -> None:
    print(f"rank {rank}: {message}", flush=True)


assets = prepare_demo_assets(seed=0, cache_dir=sys.argv[1], settings=TINY_DEMO, log=log)
cfg = GRPOConfig.from_dict({
    "model": {"name_or_path": str(assets.model_dir), "device": "cpu", "dtype": "float32"},
    "data": {"source": str(assets.train_file)},
    "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
    "rewards": {"functions": [{"name": "exact_match"}]},
    "kl": {"coef": 0.1, "replay": {"coef": 1.0, "source": str(assets.replay_file), "num_prompts": 4,
                                   "completions_per_prompt": 2, "batch_size": 4}},
    "train": {"steps": 1, "output_dir": sys.argv[2], "torch_threads": 1},
})
GRPOTrainer(cfg, log=log)
log("done")
sys.stdout.flush()
os._exit(0)  # past gloo's teardown, which sometimes aborts a finished rank (docs/reliability.md)
