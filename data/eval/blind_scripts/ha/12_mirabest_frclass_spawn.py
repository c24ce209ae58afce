#!/usr/bin/env python
"""FR-I / FR-II radio galaxy classification on MiraBest (FIRST 150x150 cutouts).

Small dataset, so this runs on the 4 GPUs of a single workstation and spawns its
own workers (no torchrun needed):

    python 12_mirabest_frclass_spawn.py --data ~/data/mirabest/batches --gpus 4 --wandb
"""
import argparse
import os
import pickle
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

# MiraBest labels: 0-4 FR-I, 5-7 FR-II, 8-9 hybrid. Only the confident classes are used.
FR1_LABELS = {0, 1, 2}
FR2_LABELS = {5, 6}


def load_mirabest(root, train):
    names = [f"data_batch_{i}" for i in range(1, 8)] if train else ["test_batch"]
    data, labels = [], []
    for n in names:
        with open(os.path.join(root, n), "rb") as f:
            d = pickle.load(f, encoding="latin1")
        data.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 150, 150))
        labels.extend(d["labels"])
    data, labels = np.concatenate(data), np.asarray(labels)
    keep = np.isin(labels, list(FR1_LABELS | FR2_LABELS))
    y = np.isin(labels[keep], list(FR2_LABELS)).astype(np.int64)
    return data[keep], y


class RadioCutouts(Dataset):
    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


def small_cnn(n_classes=2):
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(1, 16), block(16, 32), block(32, 64), block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(128, n_classes))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed)

    run = None
    if rank == 0 and cfg.wandb:
        import wandb
        run = wandb.init(project="mirabest-fr", config=vars(cfg))

    tf_train = transforms.Compose([transforms.ToPILImage(), transforms.RandomRotation(180),
                                   transforms.RandomHorizontalFlip(), transforms.CenterCrop(100),
                                   transforms.ToTensor(), transforms.Normalize([0.0031], [0.0350])])
    tf_test = transforms.Compose([transforms.ToPILImage(), transforms.CenterCrop(100),
                                  transforms.ToTensor(), transforms.Normalize([0.0031], [0.0350])])
    x_tr, y_tr = load_mirabest(cfg.data, train=True)
    x_te, y_te = load_mirabest(cfg.data, train=False)
    train_ds = RadioCutouts(x_tr, y_tr, tf_train)
    test_ds = RadioCutouts(x_te[rank::world_size], y_te[rank::world_size], tf_test)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=2,
                          drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=64, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(small_cnn()).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.9, patience=2)
    ckpt_file = os.path.join(cfg.out, "mirabest_cnn.pt")

    best_acc, stale = 0.0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tr = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])

        net.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_dl:
                x, y = x.to(device), y.to(device)
                te[0] += (net(x).argmax(1) == y).sum()
                te[1] += len(y)
        dist.all_reduce(tr)
        dist.all_reduce(te)
        acc = (te[0] / te[1]).item()
        sched.step(acc)

        if acc > best_acc:
            best_acc, stale = acc, 0
            if rank == 0:
                torch.save(net.state_dict(), ckpt_file)
        else:
            stale += 1
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(tr[0] / tr[1]).item():.4f} test acc {acc:.4f}", flush=True)
            if run is not None:
                run.log({"loss": (tr[0] / tr[1]).item(), "test_acc": acc, "epoch": epoch})
        if stale >= cfg.patience:
            break

    dist.barrier()
    if rank == 0:
        print(f"best test accuracy {best_acc:.4f}, weights in {ckpt_file}")
        if run is not None:
            run.finish()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/mirabest/batches"))
    ap.add_argument("--out", default="runs/mirabest")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--wandb", action="store_true")
    cfg = ap.parse_args()

    os.makedirs(cfg.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(train_worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
