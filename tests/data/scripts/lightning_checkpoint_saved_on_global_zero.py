"""A Lightning callback that saves an extra checkpoint on global rank zero only.

Trainer.save_checkpoint() ends in strategy.barrier(): rank 0 waits there for
ranks that never call it (and under FSDP or DeepSpeed every rank must write its
shard). Lightning's own ModelCheckpoint calls it on every rank and lets the
strategy pick the writer. Lint only (Lightning is not installed here).
"""

import lightning as L


class SaveEveryEpoch(L.Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            path = f"{self.folder}/epoch{trainer.current_epoch}.ckpt"
            trainer.save_checkpoint(path)  # expect: collective-mismatch
