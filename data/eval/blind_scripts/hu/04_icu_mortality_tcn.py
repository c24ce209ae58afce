"""
ICU mortality (48h) from hourly-binned vitals/labs with a temporal conv net.

Irregular measurements are binned to 1h; each variable comes with a mask channel and
a hours-since-last-observation channel (GRU-D style inputs, but a TCN on top).

Run (1 node, 4 GPUs):
    torchrun --nproc_per_node 4 04_icu_mortality_tcn.py --config configs/tcn_mort48.yaml
"""
import argparse
import dataclasses
import logging
import os
import random
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn import metrics as skm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


@dataclass
class Config:
    data_root: str = "/mnt/shared/mimic4_derived/mort48"
    output_dir: str = "/mnt/shared/experiments/tcn_mort48"
    n_hours: int = 48
    channels: List[int] = field(default_factory=lambda: [128, 128, 128, 128])
    kernel_size: int = 3
    dropout: float = 0.2
    batch_size: int = 64
    lr: float = 1e-3
    epochs: int = 30
    num_workers: int = 4
    seed: int = 7


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


class HourlyStays(Dataset):
    """values/mask/delta arrays of shape [N, T, V], labels [N]."""

    def __init__(self, root, split, n_hours):
        d = np.load(os.path.join(root, f"{split}.npz"))
        self.values = d["values"][:, :n_hours].astype(np.float32)
        self.mask = d["mask"][:, :n_hours].astype(np.float32)
        self.delta = d["delta"][:, :n_hours].astype(np.float32)
        self.static = d["static"].astype(np.float32)
        self.y = d["label"].astype(np.float32)

    @property
    def n_vars(self):
        return self.values.shape[-1]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = np.concatenate([self.values[i], self.mask[i], np.log1p(self.delta[i])], axis=-1)
        return torch.from_numpy(x), torch.from_numpy(self.static[i]), torch.tensor(self.y[i])


class CausalBlock(nn.Module):
    def __init__(self, cin, cout, k, dilation, dropout):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv1 = nn.utils.weight_norm(nn.Conv1d(cin, cout, k, dilation=dilation))
        self.conv2 = nn.utils.weight_norm(nn.Conv1d(cout, cout, k, dilation=dilation))
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.drop(F.relu(self.conv1(F.pad(x, (self.pad, 0)))))
        h = self.drop(F.relu(self.conv2(F.pad(h, (self.pad, 0)))))
        return F.relu(h + self.skip(x))


class TCN(nn.Module):
    def __init__(self, in_ch, n_static, channels, k, dropout):
        super().__init__()
        blocks, c = [], in_ch
        for i, ch in enumerate(channels):
            blocks.append(CausalBlock(c, ch, k, 2 ** i, dropout))
            c = ch
        self.tcn = nn.Sequential(*blocks)
        self.static_mlp = nn.Sequential(nn.Linear(n_static, 32), nn.ReLU())
        self.head = nn.Linear(c + 32, 1)

    def forward(self, x, s):
        h = self.tcn(x.transpose(1, 2))[:, :, -1]
        return self.head(torch.cat([h, self.static_mlp(s)], dim=-1)).squeeze(-1)


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_auc):
    torch.save(
        {
            "epoch": epoch,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "best_auc": best_auc,
        },
        path,
    )


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    preds, labels = [], []
    for x, s, y in loader:
        p = torch.sigmoid(model(x.to(device), s.to(device)))
        preds.extend(p.cpu().tolist())
        labels.extend(y.tolist())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (preds, labels))
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    return skm.roc_auc_score(y, p), skm.average_precision_score(y, p)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cfg = load_config(parser.parse_args().config)

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    train_ds = HourlyStays(cfg.data_root, "train", cfg.n_hours)
    val_ds = HourlyStays(cfg.data_root, "val", cfg.n_hours)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    # unpadded, disjoint shard per rank so every stay is scored exactly once
    val_shard = Subset(val_ds, range(rank, len(val_ds), dist.get_world_size()))
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False,
                            num_workers=cfg.num_workers, pin_memory=True)

    model = TCN(3 * train_ds.n_vars, train_ds.static.shape[1], cfg.channels, cfg.kernel_size,
                cfg.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    pos_weight = torch.tensor((1 - train_ds.y.mean()) / train_ds.y.mean(), device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(train_loader))

    os.makedirs(cfg.output_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f)

    best_auc = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for x, s, y in train_loader:
            x, s, y = x.to(device, non_blocking=True), s.to(device, non_blocking=True), y.to(device)
            logit = model(x, s)
            loss = F.binary_cross_entropy_with_logits(logit, y, pos_weight=pos_weight)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        auc, ap = run_eval(model.module, val_loader, device)
        log.info("epoch %d | train_loss %.4f | val AUROC %.4f AUPRC %.4f",
                 epoch, (loss_acc[0] / loss_acc[1]).item(), auc, ap)

        save_checkpoint(os.path.join(cfg.output_dir, "last.pt"), model, optimizer, scheduler,
                        epoch, max(best_auc, auc))
        if auc > best_auc:
            best_auc = auc
            save_checkpoint(os.path.join(cfg.output_dir, "best.pt"), model, optimizer, scheduler,
                            epoch, best_auc)

    log.info("done, best val AUROC %.4f", best_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
