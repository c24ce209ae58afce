"""Multi-subject MEG decoder with subject-specific input layers.

Each subject gets its own 1x1 spatial projection (sensor -> shared virtual
channels) followed by a shared dilated conv encoder and a classifier over the
image categories shown during the recording.  Epoched data per subject:

    <root>/sub-XX/epochs.npy   (n_epochs, n_sensors, n_times) float32, 120 Hz
    <root>/sub-XX/labels.npy   (n_epochs,) int64
    <root>/sub-XX/split.npy    (n_epochs,) 0 train / 1 val / 2 test (by run)

Launch:  torchrun --nproc_per_node=8 02_meg_subject_layer_decoder.py --config cfg.yaml
"""
import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset


DEFAULTS = dict(
    root="/data/things-meg/derivatives/epochs",
    cache_dir="/data/things-meg/derivatives/cache",
    out_dir="checkpoints/meg_subject_layer",
    subjects=["01", "02", "03", "04"],
    n_classes=27,
    virtual_chans=270,
    hidden=320,
    epochs=60,
    batch_size=128,
    lr=3e-4,
    weight_decay=1e-2,
    clamp=20.0,
    workers=6,
    amp=True,
    wandb_project="meg-decoding",
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=str, default=None)
    p.add_argument("--resume", type=str, default=None)
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return cfg


def robust_stats(root, cache_dir, sub):
    """Per-subject, per-sensor median / IQR computed on the training runs only."""
    path = Path(cache_dir) / f"sub-{sub}_robust.npz"
    if not path.exists():
        X = np.load(Path(root) / f"sub-{sub}" / "epochs.npy", mmap_mode="r")
        split = np.load(Path(root) / f"sub-{sub}" / "split.npy")
        Xtr = np.asarray(X[split == 0])
        med = np.median(Xtr, axis=(0, 2))
        q75, q25 = np.percentile(Xtr, [75, 25], axis=(0, 2))
        np.savez(path, median=med, iqr=q75 - q25)
    d = np.load(path)
    return d["median"].astype(np.float32), d["iqr"].astype(np.float32)


class SubjectEpochs(Dataset):
    def __init__(self, root, sub, subject_idx, split_id, median, iqr, clamp):
        X = np.load(Path(root) / f"sub-{sub}" / "epochs.npy", mmap_mode="r")
        y = np.load(Path(root) / f"sub-{sub}" / "labels.npy")
        split = np.load(Path(root) / f"sub-{sub}" / "split.npy")
        self.idx = np.flatnonzero(split == split_id)
        self.X, self.y = X, y
        self.subject_idx = subject_idx
        self.median = median[:, None]
        self.iqr = iqr[:, None] + 1e-8
        self.clamp = clamp

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = self.idx[i]
        x = (np.asarray(self.X[j], dtype=np.float32) - self.median) / self.iqr
        x = np.clip(x, -self.clamp, self.clamp)
        return torch.from_numpy(x), int(self.y[j]), self.subject_idx


class DilatedBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.conv1 = nn.Conv1d(ch, ch, 3, padding=dilation, dilation=dilation)
        self.bn1 = nn.BatchNorm1d(ch)
        self.conv2 = nn.Conv1d(ch, ch, 3, padding=dilation, dilation=dilation)
        self.bn2 = nn.BatchNorm1d(ch)

    def forward(self, x):
        h = F.gelu(self.bn1(self.conv1(x)))
        h = F.gelu(self.bn2(self.conv2(h)))
        return x + h


class SubjectLayerDecoder(nn.Module):
    def __init__(self, n_sensors, n_subjects, virtual_chans, hidden, n_classes):
        super().__init__()
        self.subject_layers = nn.ModuleList(
            [nn.Conv1d(n_sensors, virtual_chans, 1) for _ in range(n_subjects)]
        )
        self.stem = nn.Conv1d(virtual_chans, hidden, 1)
        self.blocks = nn.Sequential(*[DilatedBlock(hidden, 2 ** (k % 5)) for k in range(5)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(hidden, n_classes))

    def forward(self, x, subject):
        out = x.new_empty(x.size(0), self.subject_layers[0].out_channels, x.size(2))
        for s in subject.unique().tolist():
            m = subject == s
            out[m] = self.subject_layers[s](x[m])
        return self.head(self.blocks(self.stem(out)))


def build_split(cfg, split_id, stats):
    parts = []
    for k, sub in enumerate(cfg["subjects"]):
        med, iqr = stats[sub]
        parts.append(SubjectEpochs(cfg["root"], sub, k, split_id, med, iqr, cfg["clamp"]))
    return ConcatDataset(parts)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss, correct, count
    for x, y, s in loader:
        x, y, s = x.to(device, non_blocking=True), y.to(device), s.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x, s)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 computes the robust scaling statistics on first use; the others wait for it
    dist.init_process_group("nccl", timeout=timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    if rank == 0:
        Path(cfg["cache_dir"]).mkdir(parents=True, exist_ok=True)
        Path(cfg["out_dir"]).mkdir(parents=True, exist_ok=True)
        stats = {sub: robust_stats(cfg["root"], cfg["cache_dir"], sub) for sub in cfg["subjects"]}
    dist.barrier()
    if rank != 0:
        stats = {sub: robust_stats(cfg["root"], cfg["cache_dir"], sub) for sub in cfg["subjects"]}

    train_ds = build_split(cfg, 0, stats)
    val_ds = build_split(cfg, 1, stats)
    n_sensors = train_ds[0][0].shape[0]

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # unpadded validation shards (DistributedSampler would repeat samples to even out ranks)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, cfg["batch_size"], shuffle=False,
                            num_workers=cfg["workers"], pin_memory=True)

    model = SubjectLayerDecoder(n_sensors, len(cfg["subjects"]), cfg["virtual_chans"],
                                cfg["hidden"], cfg["n_classes"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # a batch rarely contains every subject, so some subject layers get no gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                steps_per_epoch=steps_per_epoch, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])
    start_epoch, best_acc = 0, 0.0

    if cfg["resume"]:
        ckpt = torch.load(cfg["resume"], map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    if rank == 0:
        wandb.init(project=cfg["wandb_project"], config=cfg)

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y, s) in enumerate(train_loader):
            x, y, s = x.to(device, non_blocking=True), y.to(device), s.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                loss = F.cross_entropy(model(x, s), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]},
                          step=epoch * steps_per_epoch + step)

        # plain module: shards differ in length by one, so no DDP forward collectives here
        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/acc": val_acc, "epoch": epoch},
                      step=(epoch + 1) * steps_per_epoch)
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)")
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_acc": max(best_acc, val_acc), "cfg": cfg}
            torch.save(state, Path(cfg["out_dir"]) / "last.pt")
            if val_acc > best_acc:
                torch.save(state, Path(cfg["out_dir"]) / "best.pt")
        best_acc = max(best_acc, val_acc)

    if rank == 0:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
