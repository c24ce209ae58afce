"""Fall armyworm leaf damage scoring in maize (Davis scale binned to 4 classes) from drone plot crops.

Config via OmegaConf: base YAML + dotlist overrides on the command line.

    torchrun --nproc_per_node=4 16_armyworm_damage_omegaconf.py configs/faw_r50.yaml train.epochs=30
"""
import os
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision.transforms import v2 as T

DEFAULTS = OmegaConf.create({
    "data": {"csv": "/data/faw/plots.csv", "root": "/data/faw/crops", "size": 384, "workers": 8},
    "model": {"arch": "resnet50", "dropout": 0.2},
    "train": {"epochs": 40, "batch_size": 32, "lr": 0.01, "momentum": 0.9, "wd": 1e-4, "warmup_epochs": 2,
              "label_smoothing": 0.1},
    "out_dir": "runs/faw",
})
DAMAGE = ["none", "low", "medium", "high"]


def load_cfg():
    cfg = DEFAULTS
    args = sys.argv[1:]
    if args and args[0].endswith((".yaml", ".yml")):
        cfg = OmegaConf.merge(cfg, OmegaConf.load(args[0]))
        args = args[1:]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(args))


class DamageCrops(Dataset):
    def __init__(self, df, root, tf):
        self.df = df.reset_index(drop=True)
        self.root = root
        self.tf = tf

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, r.file)).convert("RGB")
        return self.tf(img), int(r.damage_class)


def make_transforms(size):
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = T.Compose([
        T.PILToTensor(),
        T.RandomResizedCrop(size, scale=(0.4, 1.0), antialias=True),
        T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
        T.RandomChoice([T.RandomRotation((0, 0)), T.RandomRotation((90, 90)),
                        T.RandomRotation((180, 180)), T.RandomRotation((270, 270))]),
        T.TrivialAugmentWide(),
        T.ToDtype(torch.float32, scale=True),
        norm,
    ])
    val = T.Compose([T.PILToTensor(), T.Resize((size, size), antialias=True),
                     T.ToDtype(torch.float32, scale=True), norm])
    return train, val


def build_model(cfg):
    m = getattr(torchvision.models, cfg.model.arch)(weights="DEFAULT")
    m.fc = nn.Sequential(nn.Dropout(cfg.model.dropout), nn.Linear(m.fc.in_features, len(DAMAGE)))
    return m


def lr_at(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + np.cos(np.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    cm = torch.zeros(len(DAMAGE), len(DAMAGE), device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(x).argmax(1)
        cm += torch.bincount(y * len(DAMAGE) + pred, minlength=len(DAMAGE) ** 2).view(len(DAMAGE), -1)
    dist.all_reduce(cm)
    acc = cm.diag().sum().item() / max(cm.sum().item(), 1)
    # quadratic weighted kappa, the usual metric for ordinal damage scores
    k = len(DAMAGE)
    w = torch.tensor([[(i - j) ** 2 / (k - 1) ** 2 for j in range(k)] for i in range(k)], device=device)
    o = cm.float() / cm.sum()
    e = torch.outer(o.sum(1), o.sum(0))
    qwk = 1 - (w * o).sum() / (w * e).sum()
    return acc, qwk.item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1000 + rank)

    df = pd.read_csv(cfg.data.csv)
    train_tf, val_tf = make_transforms(cfg.data.size)
    train_ds = DamageCrops(df[df.split == "train"], cfg.data.root, train_tf)
    val_ds = DamageCrops(df[df.split == "val"], cfg.data.root, val_tf)

    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, shuffle=True,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                            num_workers=cfg.data.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(cfg)).to(device)
    model = DDP(net, device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in net.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": cfg.train.wd},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=cfg.train.lr, momentum=cfg.train.momentum, nesterov=True)
    steps_per_epoch = len(train_loader)
    total_steps = cfg.train.epochs * steps_per_epoch
    warmup_steps = cfg.train.warmup_epochs * steps_per_epoch

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out_dir, "config.yaml"))
        writer = SummaryWriter(cfg.out_dir)

    step, best_qwk = 0, -1.0
    for epoch in range(cfg.train.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, y in train_loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total_steps, warmup_steps, cfg.train.lr)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.train.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)

        acc, qwk = evaluate(net, val_loader, device)
        if rank == 0:
            writer.add_scalar("train/loss", (stats[0] / stats[1]).item(), epoch)
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("val/qwk", qwk, epoch)
            print(f"epoch {epoch:02d} loss {(stats[0] / stats[1]).item():.4f} acc {acc:.4f} qwk {qwk:.4f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            if qwk > best_qwk:
                best_qwk = qwk
                torch.save({"model": net.state_dict(), "epoch": epoch, "qwk": qwk,
                            "cfg": OmegaConf.to_container(cfg)}, os.path.join(cfg.out_dir, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
