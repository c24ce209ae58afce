"""TabNet (pytorch-tabnet network, custom DDP loop) on forest covertype, 7 classes.

torchrun --nproc_per_node=4 04_tabnet_covertype.py --data /data/covtype/covtype.parquet --epochs 100
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pytorch_tabnet.tab_network import TabNet
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import train_test_split
from sklearn.utils.class_weight import compute_class_weight
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CAT_PREFIXES = ("Wilderness_Area", "Soil_Type")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--target", default="Cover_Type")
    ap.add_argument("--n-d", type=int, default=64)
    ap.add_argument("--n-a", type=int, default=64)
    ap.add_argument("--n-steps", type=int, default=5)
    ap.add_argument("--gamma", type=float, default=1.5)
    ap.add_argument("--lambda-sparse", type=float, default=1e-4)
    ap.add_argument("--vbs", type=int, default=256, help="ghost batch norm virtual batch size")
    ap.add_argument("--batch-size", type=int, default=16384, help="global")
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/tabnet_covtype")
    return ap.parse_args()


def prepare(args):
    df = pd.read_parquet(args.data)
    y = df.pop(args.target).values
    classes = np.sort(np.unique(y))
    y = np.searchsorted(classes, y)

    # one-hot groups back to integer categoricals
    cat_cols, cat_dims = [], []
    for pre in CAT_PREFIXES:
        cols = [c for c in df.columns if c.startswith(pre)]
        df[pre] = df[cols].values.argmax(1)
        df = df.drop(columns=cols)
        cat_cols.append(pre)
        cat_dims.append(len(cols))
    num_cols = [c for c in df.columns if c not in cat_cols]
    df = df[num_cols + cat_cols]

    idx_tr, idx_va = train_test_split(np.arange(len(df)), test_size=0.2, random_state=args.seed, stratify=y)
    X = df.values.astype(np.float32)
    mu = X[idx_tr, : len(num_cols)].mean(0)
    sd = X[idx_tr, : len(num_cols)].std(0) + 1e-6
    X[:, : len(num_cols)] = (X[:, : len(num_cols)] - mu) / sd

    w = compute_class_weight("balanced", classes=np.arange(len(classes)), y=y[idx_tr])
    cat_idxs = list(range(len(num_cols), len(num_cols) + len(cat_cols)))
    tr = TensorDataset(torch.from_numpy(X[idx_tr]), torch.from_numpy(y[idx_tr]).long())
    va = TensorDataset(torch.from_numpy(X[idx_va]), torch.from_numpy(y[idx_va]).long())
    return tr, va, cat_idxs, cat_dims, len(classes), w, num_cols + cat_cols


@torch.no_grad()
def predict_all(net, ds, rank, world, device):
    net.eval()
    X, y = ds.tensors
    sel = torch.arange(rank, len(y), world)
    out = []
    for i in range(0, len(sel), 32768):
        logits, _ = net(X[sel[i:i + 32768]].to(device))
        out.append(logits.argmax(1).cpu())
    local = (sel.numpy(), torch.cat(out).numpy())
    parts = [None] * world
    dist.all_gather_object(parts, local)
    idx = np.concatenate([p[0] for p in parts])
    pred = np.concatenate([p[1] for p in parts])
    order = np.argsort(idx)
    return pred[order], y.numpy()


@torch.no_grad()
def feature_importance(net, ds, device, n=50000):
    net.eval()
    X = ds.tensors[0][:n].to(device)
    imp = torch.zeros(X.shape[1], device=device)
    for i in range(0, len(X), 8192):
        m_explain, _ = net.forward_masks(X[i:i + 8192])
        imp += m_explain.sum(0)
    imp = imp / imp.sum()
    return imp.cpu().numpy()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, cat_idxs, cat_dims, n_classes, class_w, feat_names = prepare(args)
    net = TabNet(
        input_dim=train_ds.tensors[0].shape[1], output_dim=n_classes,
        n_d=args.n_d, n_a=args.n_a, n_steps=args.n_steps, gamma=args.gamma,
        cat_idxs=cat_idxs, cat_dims=cat_dims, cat_emb_dim=4,
        virtual_batch_size=args.vbs, momentum=0.02, mask_type="entmax",
    ).to(device)
    model = DDP(net, device_ids=[local_rank])

    per_gpu = args.batch_size // world
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    weight = torch.tensor(class_w, dtype=torch.float32, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for X, y in loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, m_loss = model(X)
            loss = F.cross_entropy(logits, y, weight=weight) - args.lambda_sparse * m_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            loss_sum += loss.detach()
        sched.step()
        dist.all_reduce(loss_sum)

        pred, true = predict_all(net, val_ds, rank, world, device)
        acc = accuracy_score(true, pred)
        f1 = f1_score(true, pred, average="macro")
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss_sum.item() / (world * len(loader)):.4f} "
                  f"val_acc {acc:.4f} macro_f1 {f1:.4f} {time.time() - t0:.1f}s", flush=True)
        # same decision on every rank: all ranks see the full gathered predictions
        if acc > best_acc:
            best_acc, bad_epochs = acc, 0
            if rank == 0:
                torch.save({"net": net.state_dict(), "epoch": epoch, "acc": acc,
                            "cat_idxs": cat_idxs, "cat_dims": cat_dims}, os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                break

    if rank == 0:
        imp = feature_importance(model, val_ds, device)
        ranking = sorted(zip(feat_names, imp.tolist()), key=lambda t: -t[1])
        with open(os.path.join(args.out, "feature_importance.json"), "w") as f:
            json.dump(ranking, f, indent=1)
        print("top features:", ranking[:10], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
