"""Task-incremental Split-CIFAR100 with Learning without Forgetting (LwF).

Shared ResNet backbone, one classification head per task.  Tasks are trained
one after another; when training task t the outputs of the previous heads on the
new data are distilled towards the responses recorded before the task started.

    python lwf_multihead_lightning.py --gpus 4 --n-tasks 5
"""
import argparse
import copy
import os

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Subset


class TaskView(torch.utils.data.Dataset):
    """Subset of CIFAR-100 returning (image, label inside its task, task id)."""

    def __init__(self, base, indices, lookup):
        self.base, self.indices, self.lookup = base, indices, lookup

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, y = self.base[int(self.indices[i])]
        t, j = self.lookup[y]
        return x, j, t


class SplitCIFAR100(pl.LightningDataModule):
    def __init__(self, root, n_tasks, batch_size, seed):
        super().__init__()
        self.root, self.n_tasks, self.bs, self.seed = root, n_tasks, batch_size, seed
        self.task = 0
        mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
        self.train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                                   T.ToTensor(), T.Normalize(mean, std)])
        self.test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    def prepare_data(self):
        torchvision.datasets.CIFAR100(self.root, train=True, download=True)
        torchvision.datasets.CIFAR100(self.root, train=False, download=True)

    def setup(self, stage=None):
        self.train_full = torchvision.datasets.CIFAR100(self.root, True, self.train_tf)
        self.test_full = torchvision.datasets.CIFAR100(self.root, False, self.test_tf)
        order = np.random.RandomState(self.seed).permutation(100)
        self.classes = np.array_split(order, self.n_tasks)
        # class -> (task id, local label)
        self.lookup = {int(c): (t, j) for t, cs in enumerate(self.classes) for j, c in enumerate(cs)}
        ytr, yte = np.array(self.train_full.targets), np.array(self.test_full.targets)
        self.train_idx = [np.where(np.isin(ytr, cs))[0] for cs in self.classes]
        self.test_idx = [np.where(np.isin(yte, cs))[0] for cs in self.classes]

    def _wrap(self, ds, idx):
        return TaskView(ds, idx, self.lookup)

    def train_dataloader(self):
        return DataLoader(self._wrap(self.train_full, self.train_idx[self.task]),
                          batch_size=self.bs, shuffle=True, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=False)

    def val_dataloader(self):
        return [DataLoader(self._wrap(self.test_full, self.test_idx[t]), batch_size=256,
                           num_workers=4) for t in range(self.task + 1)]


class LwF(pl.LightningModule):
    def __init__(self, n_tasks, classes_per_task, lr=0.05, epochs=60, lwf_lambda=1.0, T=2.0):
        super().__init__()
        self.save_hyperparameters()
        bb = torchvision.models.resnet18()
        bb.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        bb.maxpool = nn.Identity()
        bb.fc = nn.Identity()
        self.backbone = bb
        self.heads = nn.ModuleList([nn.Linear(512, classes_per_task) for _ in range(n_tasks)])
        self.current_task = 0
        self.old_backbone = None
        self.old_heads = None

    def forward(self, x, task):
        return self.heads[task](self.backbone(x))

    def start_task(self, task):
        self.old_backbone, self.old_heads = None, None
        if task > 0:
            self.old_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
            self.old_heads = copy.deepcopy(self.heads).requires_grad_(False)
        self.current_task = task

    def on_train_epoch_start(self):
        # the frozen copy always runs with its recorded BN statistics
        if self.old_backbone is not None:
            self.old_backbone.eval()
            self.old_heads.eval()

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        feats = self.backbone(x)
        logits = self.heads[self.current_task](feats)
        loss = F.cross_entropy(logits, y)
        if self.old_backbone is not None:
            T = self.hparams.T
            with torch.no_grad():
                old_feats = self.old_backbone(x)
            distill = 0.0
            for t in range(self.current_task):
                distill = distill + F.kl_div(
                    F.log_softmax(self.heads[t](feats) / T, 1),
                    F.softmax(self.old_heads[t](old_feats) / T, 1),
                    reduction="batchmean") * T * T
            loss = loss + self.hparams.lwf_lambda * distill
            self.log("train/distill", distill, sync_dist=True)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y, t = batch
        acc = (self(x, int(t[0])).argmax(1) == y).float().mean()
        self.log(f"val/acc_task{dataloader_idx}", acc, sync_dist=True,
                 add_dataloader_idx=False)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9,
                              weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.hparams.epochs)
        return [opt], [sched]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--out", default="lightning_logs/lwf")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--n-tasks", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    pl.seed_everything(args.seed, workers=True)
    dm = SplitCIFAR100(args.root, args.n_tasks, args.batch_size, args.seed)
    model = LwF(args.n_tasks, 100 // args.n_tasks, lr=args.lr, epochs=args.epochs)
    logger = CSVLogger(args.out, name="lwf")

    for task in range(args.n_tasks):
        dm.task = task
        model.start_task(task)
        ckpt_cb = ModelCheckpoint(dirpath=os.path.join(args.out, f"task{task}"),
                                  filename="{epoch:02d}", save_last=True, every_n_epochs=10)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=args.gpus,
            strategy="ddp",
            max_epochs=args.epochs,
            precision="16-mixed",
            sync_batchnorm=True,
            logger=logger,
            callbacks=[ckpt_cb, LearningRateMonitor("epoch")],
            check_val_every_n_epoch=10,
            enable_progress_bar=False,
        )
        trainer.fit(model, datamodule=dm)
        results = trainer.validate(model, datamodule=dm, verbose=False)
        if trainer.is_global_zero:
            accs = [r[f"val/acc_task{t}"] for t, r in enumerate(results)]
            print(f"after task {task}: " + " ".join(f"{a:.3f}" for a in accs)
                  + f" | avg {np.mean(accs):.4f}", flush=True)


if __name__ == "__main__":
    main()
