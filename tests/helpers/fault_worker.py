"""``python -m accelerate.commands.launch ... fault_worker.py CONFIG``: train through the Python API (no CLI
checks before the trainer), print each rank's klgrpo error as the CLI would and exit 2."""

import json
import sys
import time

from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import KLGRPOError
from klgrpo.run.trainer import GRPOTrainer

if __name__ == "__main__":
    trainer = GRPOTrainer(GRPOConfig.from_dict(json.loads(open(sys.argv[1]).read())), log=lambda *_: None)
    assert trainer.dist.world_size == 2, f"expected 2 processes, got {trainer.dist.world_size}"
    try:
        trainer.train()
    except KLGRPOError as exc:
        print(f"rank {trainer.dist.rank}: error: {exc}", flush=True)
        print(f"refused on rank {trainer.dist.rank} ({time.time():.3f})", flush=True)
        sys.exit(2)
