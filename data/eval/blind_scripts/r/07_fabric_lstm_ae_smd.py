# LSTM autoencoder for multivariate anomaly detection on SMD (Server Machine Dataset)
# Fabric, 4 GPUs:  python 07_fabric_lstm_ae_smd.py --machines machine-1-1 machine-1-2 ... --devices 4
import argparse
import glob
import json
import os

import numpy as np
import torch
import torch.nn as nn
from lightning.fabric import Fabric
from sklearn.metrics import f1_score, precision_recall_curve
from torch.utils.data import ConcatDataset, DataLoader, Dataset

WINDOW = 100


class Windows(Dataset):
    def __init__(self, arr, window=WINDOW, stride=1):
        self.x = torch.from_numpy(arr.astype(np.float32))
        self.window, self.stride = window, stride

    def __len__(self):
        return (len(self.x) - self.window) // self.stride + 1

    def __getitem__(self, i):
        s = i * self.stride
        return self.x[s:s + self.window]


def load_machine(root, name):
    train = np.loadtxt(os.path.join(root, "train", f"{name}.txt"), delimiter=",")
    test = np.loadtxt(os.path.join(root, "test", f"{name}.txt"), delimiter=",")
    label = np.loadtxt(os.path.join(root, "test_label", f"{name}.txt"), delimiter=",")
    lo, hi = train.min(0), train.max(0)
    scale = np.where(hi - lo > 0, hi - lo, 1.0)
    return (train - lo) / scale, np.clip((test - lo) / scale, -3, 3), label


class LSTMAE(nn.Module):
    def __init__(self, n_feat, hidden=128, latent=32, layers=2):
        super().__init__()
        self.enc = nn.LSTM(n_feat, hidden, layers, batch_first=True, dropout=0.1)
        self.to_z = nn.Linear(hidden, latent)
        self.from_z = nn.Linear(latent, hidden)
        self.dec = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, n_feat)

    def forward(self, x):
        _, (h, _) = self.enc(x)
        z = self.to_z(h[-1])
        d = self.from_z(z).unsqueeze(1).repeat(1, x.size(1), 1)
        y, _ = self.dec(d)
        return self.out(y)


def run_epoch(fabric, model, loader, optimizer=None):
    train = optimizer is not None
    model.train(train)
    total = torch.zeros(2, device=fabric.device)
    with torch.set_grad_enabled(train):
        for x in loader:
            recon = model(x)
            loss = ((recon - x) ** 2).mean()
            if train:
                optimizer.zero_grad()
                fabric.backward(loss)
                fabric.clip_gradients(model, optimizer, max_norm=5.0)
                optimizer.step()
            total += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=fabric.device)])
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1]).item()


@torch.no_grad()
def score_series(net, series, device, bs=512):
    net.eval()
    ds = Windows(series, stride=1)
    errs = np.zeros(len(series))
    counts = np.zeros(len(series))
    for start in range(0, len(ds), bs):
        x = torch.stack([ds[i] for i in range(start, min(start + bs, len(ds)))]).to(device)
        e = ((net(x) - x) ** 2).mean(-1).cpu().numpy()
        for k, row in enumerate(e):
            s = start + k
            errs[s:s + WINDOW] += row
            counts[s:s + WINDOW] += 1
    return errs / np.maximum(counts, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/SMD")
    ap.add_argument("--machines", nargs="+", default=None)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/lstm_ae_smd")
    args = ap.parse_args()

    fabric = Fabric(accelerator="cuda", devices=args.devices, strategy="ddp", precision="16-mixed")
    fabric.launch()
    fabric.seed_everything(7)
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")

    machines = args.machines or sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(args.root, "train", "*.txt")))
    data = {m: load_machine(args.root, m) for m in machines}
    n_feat = next(iter(data.values()))[0].shape[1]

    full = ConcatDataset([Windows(tr, stride=5) for tr, _, _ in data.values()])
    n_val = len(full) // 10
    train_ds, val_ds = torch.utils.data.random_split(full, [len(full) - n_val, n_val],
                                                     generator=torch.Generator().manual_seed(0))
    train_loader = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, num_workers=2)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)

    net = LSTMAE(n_feat)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(net, optimizer)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)

    best = float("inf")
    for epoch in range(args.epochs):
        tr = run_epoch(fabric, model, train_loader, optimizer)
        va = run_epoch(fabric, model, val_loader)
        scheduler.step(va)
        fabric.print(f"epoch {epoch:02d} train {tr:.5f} val {va:.5f} lr {optimizer.param_groups[0]['lr']:.1e}")
        if va < best:
            best = va
            if fabric.global_rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val": va, "n_feat": n_feat}, best_path)

    state = torch.load(best_path, map_location=fabric.device)
    net.load_state_dict(state["model"])
    fabric.print(f"loaded best from epoch {state['epoch']} (val {state['val']:.5f})")

    # each rank scores its own share of the machines, results gathered through files
    results = {}
    for m in machines[fabric.global_rank::fabric.world_size]:
        train, test, label = data[m]
        thr_ref = score_series(net, train, fabric.device)
        scores = score_series(net, test, fabric.device)
        prec, rec, thr = precision_recall_curve(label, scores)
        f1 = 2 * prec * rec / np.maximum(prec + rec, 1e-8)
        k = int(np.argmax(f1[:-1]))
        pred = (scores >= thr[k]).astype(int)
        results[m] = {"best_f1": float(f1[k]), "f1_at_p99_train": float(f1_score(label, scores >= np.quantile(thr_ref, 0.99))),
                      "anomaly_rate": float(pred.mean())}
    with open(os.path.join(args.out, f"scores_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    fabric.barrier()
    if fabric.global_rank == 0:
        merged = {}
        for r in range(fabric.world_size):
            with open(os.path.join(args.out, f"scores_rank{r}.json")) as f:
                merged.update(json.load(f))
        mean_f1 = np.mean([v["best_f1"] for v in merged.values()])
        print(f"{len(merged)} machines, mean best-F1 {mean_f1:.4f}")
        json.dump(merged, open(os.path.join(args.out, "scores.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
