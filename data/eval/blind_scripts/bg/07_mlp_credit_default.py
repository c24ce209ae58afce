"""Embedding + MLP baseline for the Taiwan credit card default data (30k clients).

Categorical columns (sex, education, marriage, repayment status) are embedded,
numeric columns are log/standard scaled with statistics from the training split.

    torchrun --nproc_per_node=4 07_mlp_credit_default.py --csv data/default_of_credit_card_clients.csv
    torchrun --nproc_per_node=4 07_mlp_credit_default.py --resume runs/credit_mlp/last.pt
"""
import argparse
import contextlib
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CAT = ["SEX", "EDUCATION", "MARRIAGE", "PAY_0", "PAY_2", "PAY_3", "PAY_4", "PAY_5", "PAY_6"]
NUM = ["LIMIT_BAL", "AGE"] + [f"BILL_AMT{i}" for i in range(1, 7)] + [f"PAY_AMT{i}" for i in range(1, 7)]
TARGET = "default.payment.next.month"


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/default_of_credit_card_clients.csv")
    ap.add_argument("--out", default="runs/credit_mlp")
    ap.add_argument("--resume", default="")
    ap.add_argument("--emb-dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 256, 128])
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4, help="for a global batch of 512")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class CreditMLP(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim, hidden, dropout):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cardinalities)
        layers, d = [], emb_dim * len(cardinalities) + n_num
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x_cat, x_num):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        return self.net(torch.cat(e + [x_num], dim=1)).squeeze(1)


def load(csv_path, seed):
    df = pd.read_csv(csv_path)
    if "ID" in df.columns:
        df = df.drop(columns="ID")
    # vocabularies from the whole table (no labels involved), sorted so every rank agrees
    vocab = {c: {v: i for i, v in enumerate(sorted(df[c].unique()))} for c in CAT}
    idx_train, idx_rest = train_test_split(np.arange(len(df)), test_size=0.3, random_state=seed,
                                           stratify=df[TARGET])
    idx_val, idx_test = train_test_split(idx_rest, test_size=0.5, random_state=seed,
                                         stratify=df[TARGET].iloc[idx_rest])
    num = df[NUM].to_numpy(np.float64)
    num = np.sign(num) * np.log1p(np.abs(num))
    mu, sd = num[idx_train].mean(0), num[idx_train].std(0) + 1e-6
    num = ((num - mu) / sd).astype(np.float32)
    cat = np.stack([df[c].map(vocab[c]).to_numpy() for c in CAT], 1).astype(np.int64)
    y = df[TARGET].to_numpy(np.float32)
    ds = TensorDataset(torch.from_numpy(cat), torch.from_numpy(num), torch.from_numpy(y))
    cards = [len(vocab[c]) for c in CAT]
    return Subset(ds, idx_train), Subset(ds, idx_val), Subset(ds, idx_test), cards, float(y[idx_train].mean())


@torch.no_grad()
def scores(net, ds, rank, world, device):
    """Scores an unpadded shard per rank and gathers everything on every rank."""
    net.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=2048)
    p, t = [], []
    for xc, xn, y in loader:
        p.append(torch.sigmoid(net(xc.to(device), xn.to(device))).cpu().numpy())
        t.append(y.numpy())
    net.train()
    parts = [None] * world
    dist.all_gather_object(parts, (np.concatenate(p), np.concatenate(t)))
    probs = np.concatenate([a for a, _ in parts])
    labels = np.concatenate([b for _, b in parts])
    return roc_auc_score(labels, probs), average_precision_score(labels, probs)


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, test_ds, cards, pos_rate = load(args.csv, args.seed)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    # drop_last keeps BatchNorm away from a 1-row micro-batch at the end of an epoch
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    net = CreditMLP(cards, len(NUM), args.emb_dim, args.hidden, args.dropout)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    global_batch = args.micro_batch * args.accum * world
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * global_batch / 512, weight_decay=1e-4)
    pos_weight = torch.tensor((1 - pos_rate) / pos_rate, device=device)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    start_epoch, best_auc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        n_batches = len(loader)
        opt.zero_grad(set_to_none=True)
        for i, (xc, xn, y) in enumerate(loader):
            xc, xn, y = xc.to(device), xn.to(device), y.to(device)
            sync_now = (i + 1) % args.accum == 0 or i + 1 == n_batches
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                loss = loss_fn(model(xc, xn), y) / args.accum
                loss.backward()
            if sync_now:
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach() * args.accum
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (n_batches * world)

        val_auc, val_ap = scores(net, val_ds, rank, world, device)
        if rank == 0:
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("val/auc", val_auc, epoch)
            writer.add_scalar("val/ap", val_ap, epoch)
            print(f"epoch {epoch:02d} loss {train_loss:.4f} val auc {val_auc:.4f} ap {val_ap:.4f}", flush=True)
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                     "best_auc": max(best_auc, val_auc)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_auc > best_auc:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best_auc = max(best_auc, val_auc)
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")["model"])
    test_auc, test_ap = scores(net, test_ds, rank, world, device)
    if rank == 0:
        print(f"test auc {test_auc:.4f} ap {test_ap:.4f}")
        writer.add_hparams({"lr": args.lr, "dropout": args.dropout, "world": world},
                           {"hparam/test_auc": test_auc, "hparam/test_ap": test_ap})
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
