"""Network-flow intrusion detection (multi-class, heavily imbalanced), 2-node torchrun job.

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR \
        --master_port=29400 20_intrusion_detection_weighted.py --csv_dir /shared/ids2018/csv \
        --cache /shared/ids2018/features.npz --out /shared/runs/ids_mlp
"""
import argparse
import datetime
import glob
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

DROP_COLS = ["Flow ID", "Src IP", "Dst IP", "Src Port", "Timestamp"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv_dir", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=4096, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_features(csv_dir, cache):
    frames = []
    for path in sorted(glob.glob(os.path.join(csv_dir, "*.csv"))):
        df = pd.read_csv(path, low_memory=False)
        df = df[df["Label"] != "Label"]  # repeated header rows inside some daily files
        frames.append(df.drop(columns=[c for c in DROP_COLS if c in df.columns]))
    df = pd.concat(frames, ignore_index=True)
    labels = df.pop("Label").str.strip()
    X = df.apply(pd.to_numeric, errors="coerce").replace([np.inf, -np.inf], np.nan)
    keep = X.notna().all(axis=1)
    X, labels = X[keep], labels[keep]
    const = X.columns[X.std() == 0]
    X = X.drop(columns=const)
    X = np.sign(X.values) * np.log1p(np.abs(X.values))
    classes = np.array(sorted(labels.unique()))
    y = np.searchsorted(classes, labels.values)
    np.savez(cache + ".tmp.npz", X=X.astype(np.float32), y=y.astype(np.int64), classes=classes)
    os.replace(cache + ".tmp.npz", cache)


class FlowNet(nn.Module):
    def __init__(self, d_in, hidden, n_classes):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.SiLU(), nn.Dropout(0.1),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.SiLU(), nn.Dropout(0.1),
            nn.Linear(hidden, n_classes))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def per_class_recall(model, loader, n_classes, device):
    model.eval()
    hit = torch.zeros(n_classes, device=device)
    tot = torch.zeros(n_classes, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        tot += torch.bincount(y, minlength=n_classes)
        hit += torch.bincount(y[pred == y], minlength=n_classes)
    dist.all_reduce(hit)
    dist.all_reduce(tot)
    return (hit / tot.clamp(min=1)).cpu().numpy(), (hit.sum() / tot.sum()).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))  # first run parses ~16M flows on rank 0
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0 and not os.path.exists(args.cache):
        print("building feature cache ...", flush=True)
        build_features(args.csv_dir, args.cache)
    dist.barrier()
    blob = np.load(args.cache, allow_pickle=True)
    X, y, classes = blob["X"], blob["y"], blob["classes"]
    n_classes = len(classes)

    X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, stratify=y, random_state=args.seed)
    mu, sd = X_tr.mean(0), X_tr.std(0) + 1e-6
    X_tr, X_va = (X_tr - mu) / sd, (X_va - mu) / sd
    train_ds = TensorDataset(torch.from_numpy(X_tr.astype(np.float32)), torch.from_numpy(y_tr))
    val_ds = TensorDataset(torch.from_numpy(X_va.astype(np.float32)), torch.from_numpy(y_va))

    # inverse-sqrt-frequency sampling so rare attack types show up in most batches
    class_count = np.bincount(y_tr, minlength=n_classes)
    sample_w = (1.0 / np.sqrt(class_count))[y_tr]
    train_sampler = WeightedRandomSampler(torch.from_numpy(sample_w), num_samples=len(train_ds), replacement=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16384, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2, pin_memory=True)
    if rank == 0:
        print(f"{len(train_ds)} train flows, {len(val_ds)} val flows, {n_classes} classes", flush=True)
        print(dict(zip(classes.tolist(), class_count.tolist())), flush=True)

    model = DDP(FlowNet(X.shape[1], args.hidden, n_classes).to(device), device_ids=[local_rank])
    max_lr = args.lr * world ** 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=max_lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.05)

    os.makedirs(args.out, exist_ok=True)
    best_macro = 0.0
    for epoch in range(args.epochs):
        model.train()
        total_loss = torch.zeros(2, device=device)
        for xb, yb in train_loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(total_loss)

        recall, acc = per_class_recall(model, val_loader, n_classes, device)
        macro = float(recall.mean())
        if rank == 0:
            print(json.dumps({"epoch": epoch, "train_loss": round((total_loss[0] / total_loss[1]).item(), 4),
                              "val_acc": round(acc, 5), "val_macro_recall": round(macro, 4)}), flush=True)
            if macro > best_macro:
                best_macro = macro
                torch.save({"model": model.module.state_dict(), "mu": mu, "sd": sd, "classes": classes.tolist()},
                           os.path.join(args.out, "best.pt"))
                with open(os.path.join(args.out, "best_per_class_recall.json"), "w") as f:
                    json.dump(dict(zip(classes.tolist(), recall.round(4).tolist())), f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
