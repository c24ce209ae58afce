"""Cross-subject emotion recognition on SEED with a DGCNN over DE features.

Features: differential entropy of 62 channels x 5 bands (delta..gamma) on 1-s
windows, smoothed with a linear dynamic system, stored per subject/session as
    de_LDS/{sub}_{session}.npz  ->  X (n_windows, 62, 5), y (n_windows,) in {0,1,2}

The held-out subject (--test_subject) is never seen during training; the
remaining 14 subjects are pooled for training.
"""
import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/SEED/de_LDS")
    p.add_argument("--test_subject", type=int, default=1)
    p.add_argument("--sessions", type=int, nargs="+", default=[1])
    p.add_argument("--k", type=int, default=2, help="Chebyshev order")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--logdir", default="logs/seed_dgcnn")
    return p


class SEEDWindows(Dataset):
    def __init__(self, root, subjects, sessions):
        xs, ys = [], []
        for sub in subjects:
            for ses in sessions:
                d = np.load(Path(root) / f"{sub}_{ses}.npz")
                x = d["X"].astype(np.float32)
                # per-subject/session standardisation of each channel-band feature
                x = (x - x.mean(0, keepdims=True)) / (x.std(0, keepdims=True) + 1e-5)
                xs.append(x)
                ys.append(d["y"].astype(np.int64))
        self.x = torch.from_numpy(np.concatenate(xs))
        self.y = torch.from_numpy(np.concatenate(ys))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def normalize_adj(A):
    A = F.relu(A)
    d = A.sum(1)
    d_inv_sqrt = torch.pow(d + 1e-10, -0.5)
    return d_inv_sqrt[:, None] * A * d_inv_sqrt[None, :]


class ChebConv(nn.Module):
    def __init__(self, in_f, out_f, k):
        super().__init__()
        self.k = k
        self.weights = nn.ParameterList([nn.Parameter(torch.empty(in_f, out_f)) for _ in range(k)])
        for w in self.weights:
            nn.init.xavier_normal_(w)

    def forward(self, x, L):
        n = L.shape[0]
        Tk = [torch.eye(n, device=x.device), L]
        for _ in range(2, self.k):
            Tk.append(2 * L @ Tk[-1] - Tk[-2])
        out = 0
        for i in range(self.k):
            out = out + torch.einsum("nm,bmf->bnf", Tk[i], x) @ self.weights[i]
        return out


class DGCNN(nn.Module):
    def __init__(self, n_chans=62, in_f=5, hidden=64, k=2, n_classes=3):
        super().__init__()
        self.A = nn.Parameter(torch.empty(n_chans, n_chans))
        nn.init.xavier_normal_(self.A)
        self.bn = nn.BatchNorm1d(in_f)
        self.gc = ChebConv(in_f, hidden, k)
        self.fc = nn.Sequential(nn.Linear(n_chans * hidden, 64), nn.ReLU(), nn.Dropout(0.3),
                                nn.Linear(64, n_classes))

    def forward(self, x):  # (B, C, F)
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        L = normalize_adj(self.A)
        h = F.relu(self.gc(x, L))
        return self.fc(h.flatten(1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.numel()
    return loss_sum / total, correct / total


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    subjects = list(range(1, 16))
    train_subjects = [s for s in subjects if s != args.test_subject]
    train_ds = SEEDWindows(args.root, train_subjects, args.sessions)
    test_ds = SEEDWindows(args.root, [args.test_subject], args.sessions)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=1024, sampler=test_sampler)

    model = DGCNN(hidden=args.hidden, k=args.k).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)

    writer = None
    if rank == 0:
        logdir = Path(args.logdir) / f"test_sub{args.test_subject:02d}"
        logdir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(logdir))

    best_acc, best_epoch = 0.0, -1
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_loss = 0.0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            # L1 sparsity on the learned adjacency
            loss = loss + 1e-4 * model.module.A.abs().sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()

        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            writer.add_scalar("train/loss", epoch_loss / len(train_loader), epoch)
            writer.add_scalar("test/loss", test_loss, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            if test_acc > best_acc:
                best_acc, best_epoch = test_acc, epoch
                torch.save(model.module.state_dict(), logdir / "best.pt")
            if epoch % 10 == 0:
                print(f"[sub {args.test_subject}] epoch {epoch} loss {epoch_loss / len(train_loader):.4f} "
                      f"test acc {test_acc:.4f} (best {best_acc:.4f} @ {best_epoch})")

    if rank == 0:
        with open(Path(args.logdir) / "results.csv", "a") as f:
            f.write(f"{args.test_subject},{best_acc:.4f},{best_epoch}\n")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
