"""Federated human-activity recognition on UCI-HAR: one client per subject (30 subjects).

The inertial windows (9 channels x 128 steps) are classified by a 2-layer LSTM.
Subjects have very different amounts of data, so the server averages with
sample-count weights.

    torchrun --nproc_per_node=4 10_fedavg_har_lstm.py --har-dir "/data/UCI HAR Dataset"
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SIGNALS = ["body_acc_x", "body_acc_y", "body_acc_z", "body_gyro_x", "body_gyro_y", "body_gyro_z",
           "total_acc_x", "total_acc_y", "total_acc_z"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--har-dir", default="/data/UCI HAR Dataset")
    ap.add_argument("--out", default="out/har_fedavg")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--clients-per-round", type=int, default=12)
    ap.add_argument("--local-epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def load_split(root, split):
    sig = [np.loadtxt(os.path.join(root, split, "Inertial Signals", f"{s}_{split}.txt")) for s in SIGNALS]
    x = np.stack(sig, axis=-1).astype(np.float32)           # (N, 128, 9)
    y = np.loadtxt(os.path.join(root, split, f"y_{split}.txt")).astype(np.int64) - 1
    subj = np.loadtxt(os.path.join(root, split, f"subject_{split}.txt")).astype(np.int64)
    return x, y, subj


class HARLSTM(nn.Module):
    def __init__(self, n_in=9, hidden=128, n_classes=6):
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, num_layers=2, batch_first=True, dropout=0.2)
        self.head = nn.Sequential(nn.Linear(hidden, 64), nn.ReLU(), nn.Linear(64, n_classes))

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def train_local(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    total, n = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += loss.item() * len(y)
            n += len(y)
    return total / max(n, 1)


@torch.no_grad()
def test_global(model, x, y, rank, world, device):
    model.eval()
    xs, ys = x[rank::world].to(device), y[rank::world].to(device)
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for xb, yb in zip(xs.split(1024), ys.split(1024)):
        correct += (model(xb).argmax(1) == yb).sum()
        count += len(yb)
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    x_tr, y_tr, s_tr = load_split(args.har_dir, "train")
    x_te, y_te, _ = load_split(args.har_dir, "test")
    mu, sd = x_tr.reshape(-1, 9).mean(0), x_tr.reshape(-1, 9).std(0) + 1e-6
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd

    subjects = sorted(np.unique(s_tr).tolist())
    client_data = {}
    for s in subjects:
        m = s_tr == s
        client_data[s] = TensorDataset(torch.from_numpy(x_tr[m]), torch.from_numpy(y_tr[m]))
    x_te_t, y_te_t = torch.from_numpy(x_te), torch.from_numpy(y_te)

    global_model = HARLSTM(hidden=args.hidden).to(device)
    local_model = HARLSTM(hidden=args.hidden).to(device)
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)

    history = []
    for rnd in range(args.rounds):
        t0 = time.time()
        rng = np.random.RandomState(args.seed * 1000 + rnd)
        chosen = rng.choice(subjects, size=args.clients_per_round, replace=False)
        mine = chosen[rank::world]

        weighted = [torch.zeros_like(p) for p in global_model.parameters()]
        n_local = 0
        loss_local = 0.0
        for s in mine:
            local_model.load_state_dict(global_model.state_dict())
            loader = DataLoader(client_data[s], batch_size=args.batch_size, shuffle=True)
            l = train_local(local_model, loader, args.local_epochs, args.lr, device)
            n = len(client_data[s])
            for w, p in zip(weighted, local_model.parameters()):
                w.add_(p.detach(), alpha=n)
            n_local += n
            loss_local += l * n

        stats = torch.tensor([float(n_local), loss_local])
        dist.all_reduce(stats)
        for w in weighted:
            dist.all_reduce(w)
        n_total, loss_total = stats[0].item(), stats[1].item()
        with torch.no_grad():
            for p, w in zip(global_model.parameters(), weighted):
                p.copy_(w / n_total)
        global_model.lstm.flatten_parameters()

        acc = test_global(global_model, x_te_t, y_te_t, rank, world, device)
        history.append({"round": rnd + 1, "train_loss": loss_total / n_total, "test_acc": acc})
        if rank == 0 and (rnd + 1) % 10 == 0:
            print(f"round {rnd + 1:3d}  loss {loss_total / n_total:.4f}  acc {acc:.4f}  "
                  f"({time.time() - t0:.2f}s)", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(global_model.state_dict(), os.path.join(args.out, "har_lstm.pt"))
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
