"""A stand-in for accelerate's Accelerator in one process, for calling TRL's GRPOTrainer._compute_loss on a
minimal trainer object (tests/test_migration.py, tests/test_explain_exact.py)."""


class OneProcessAccelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x
