"""
ECG heartbeat classification (MIT-BIH, 5 classes) with a 1D ResNet-style CNN.
Multi-GPU on one box via torch.multiprocessing.spawn (no torchrun on this cluster image).

    python 12_ecg_cnn_spawn.py --train_csv data/mitbih_train.csv --test_csv data/mitbih_test.csv
"""
import argparse
import os
import socket

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["N", "S", "V", "F", "Q"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_csv", default="data/mitbih_train.csv")
    ap.add_argument("--test_csv", default="data/mitbih_test.csv")
    ap.add_argument("--cache_dir", default="cache_ecg")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=7)
    ap.add_argument("--ckpt", default="ecg_cnn_best.pt")
    return ap.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def prepare_arrays(args):
    """Runs once in the parent process before any worker starts."""
    os.makedirs(args.cache_dir, exist_ok=True)
    for split, path in [("train", args.train_csv), ("test", args.test_csv)]:
        x_path = os.path.join(args.cache_dir, f"{split}_x.npy")
        if os.path.exists(x_path):
            continue
        arr = pd.read_csv(path, header=None).values.astype(np.float32)
        np.save(x_path, arr[:, :-1])
        np.save(os.path.join(args.cache_dir, f"{split}_y.npy"), arr[:, -1].astype(np.int64))


class ResBlock1d(nn.Module):
    def __init__(self, ch, k=5):
        super().__init__()
        self.c1 = nn.Conv1d(ch, ch, k, padding=k // 2)
        self.b1 = nn.BatchNorm1d(ch)
        self.c2 = nn.Conv1d(ch, ch, k, padding=k // 2)
        self.b2 = nn.BatchNorm1d(ch)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = self.b2(self.c2(h))
        return F.relu(x + h)


class ECGNet(nn.Module):
    def __init__(self, n_classes=5, ch=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(1, ch, 7, padding=3), nn.BatchNorm1d(ch), nn.ReLU())
        self.blocks = nn.Sequential(*[nn.Sequential(ResBlock1d(ch), nn.MaxPool1d(2)) for _ in range(5)])
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(ch * (187 // 32), 128), nn.ReLU(), nn.Dropout(0.3),
                                nn.Linear(128, n_classes))

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)))


def predict(model, loader, device):
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for x, y in loader:
            preds.append(model(x.to(device)).argmax(1).cpu())
            labels.append(y)
    return torch.cat(preds).numpy(), torch.cat(labels).numpy()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}")
    torch.manual_seed(0)

    x_tr = np.load(os.path.join(args.cache_dir, "train_x.npy"))
    y_tr = np.load(os.path.join(args.cache_dir, "train_y.npy"))
    x_te = np.load(os.path.join(args.cache_dir, "test_x.npy"))
    y_te = np.load(os.path.join(args.cache_dir, "test_y.npy"))
    train_ds = TensorDataset(torch.from_numpy(x_tr).unsqueeze(1), torch.from_numpy(y_tr))
    test_ds = TensorDataset(torch.from_numpy(x_te).unsqueeze(1), torch.from_numpy(y_te))

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=2048, shuffle=False, num_workers=2)

    model = ECGNet(len(CLASSES)).to(device)
    model = DDP(model, device_ids=[rank])

    # the classes are very imbalanced, inverse-frequency weights help S and F a lot
    counts = np.bincount(y_tr, minlength=len(CLASSES))
    weights = torch.tensor(counts.sum() / (len(CLASSES) * counts), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=weights)
    # per-GPU batch stays at the single-GPU value, so scale the lr with the global batch
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best_f1, wait = 0.0, 0
    stop = torch.zeros(1, device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(tot)

        if rank == 0:
            preds, labels = predict(model.module, test_loader, device)
            macro_f1 = f1_score(labels, preds, average="macro")
            print(f"epoch {epoch + 1:02d} loss {(tot[0] / tot[1]).item():.4f} macro-F1 {macro_f1:.4f}")
            if macro_f1 > best_f1:
                best_f1, wait = macro_f1, 0
                torch.save(model.module.state_dict(), args.ckpt)
            else:
                wait += 1
            stop.fill_(1.0 if wait >= args.patience else 0.0)

        # rank 0 decides, everybody follows
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stop after epoch {epoch + 1}")
            break

    dist.barrier()
    if rank == 0:
        model.module.load_state_dict(torch.load(args.ckpt, map_location=device))
        preds, labels = predict(model.module, test_loader, device)
        print(classification_report(labels, preds, target_names=CLASSES, digits=4))
        print(f"best macro-F1 {best_f1:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    prepare_arrays(args)
    n_gpus = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    print(f"spawning {n_gpus} workers on port {os.environ['MASTER_PORT']}")
    mp.spawn(worker, args=(n_gpus, args), nprocs=n_gpus, join=True)
