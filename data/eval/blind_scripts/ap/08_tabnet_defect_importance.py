"""TabNet-style classifier for defective production batches + global feature importance.

Process data per batch: line settings, raw material lab values, shift/line/supplier.
Launch on one node:

    torchrun --nproc_per_node=4 08_tabnet_defect_importance.py --data data/plant/batches.parquet
"""
import argparse
import json
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["line_id", "shift", "supplier", "resin_grade", "mould_id"]
TARGET = "defective"


def sparsemax(z):
    z_sorted, _ = torch.sort(z, dim=-1, descending=True)
    k = torch.arange(1, z.size(-1) + 1, device=z.device, dtype=z.dtype)
    z_cum = z_sorted.cumsum(-1) - 1
    support = (k * z_sorted > z_cum).sum(-1, keepdim=True)
    tau = z_cum.gather(-1, support - 1) / support.to(z.dtype)
    return torch.clamp(z - tau, min=0)


class GBN(nn.Module):
    """Ghost batch norm: normalise virtual batches of size vbs."""

    def __init__(self, d, vbs=256, momentum=0.02):
        super().__init__()
        self.bn = nn.BatchNorm1d(d, momentum=momentum)
        self.vbs = vbs

    def forward(self, x):
        if not self.training or x.size(0) <= self.vbs:
            return self.bn(x)
        return torch.cat([self.bn(c) for c in x.chunk(math.ceil(x.size(0) / self.vbs), 0)], 0)


class GLUBlock(nn.Module):
    def __init__(self, d_in, d_out, vbs):
        super().__init__()
        self.fc = nn.Linear(d_in, 2 * d_out, bias=False)
        self.bn = GBN(2 * d_out, vbs)

    def forward(self, x):
        return F.glu(self.bn(self.fc(x)), dim=-1)


class FeatTransformer(nn.Module):
    def __init__(self, shared, d, n_indep, vbs):
        super().__init__()
        self.shared = shared
        self.indep = nn.ModuleList([GLUBlock(d, d, vbs) for _ in range(n_indep)])

    def forward(self, x):
        x = self.shared[0](x)
        for blk in list(self.shared[1:]) + list(self.indep):
            x = (x + blk(x)) * math.sqrt(0.5)
        return x


class AttentiveTransformer(nn.Module):
    def __init__(self, n_a, d_in, vbs):
        super().__init__()
        self.fc = nn.Linear(n_a, d_in, bias=False)
        self.bn = GBN(d_in, vbs)

    def forward(self, prior, a):
        return sparsemax(self.bn(self.fc(a)) * prior)


class TabNet(nn.Module):
    def __init__(self, n_num, cat_dims, n_d=32, n_a=32, n_steps=4, gamma=1.3, vbs=256):
        super().__init__()
        self.n_d, self.n_steps, self.gamma = n_d, n_steps, gamma
        self.cat_emb = nn.ModuleList([nn.Embedding(c, 1) for c in cat_dims])
        d_in = n_num + len(cat_dims)
        self.initial_bn = nn.BatchNorm1d(d_in, momentum=0.01)
        shared = nn.ModuleList([GLUBlock(d_in, n_d + n_a, vbs), GLUBlock(n_d + n_a, n_d + n_a, vbs)])
        self.initial_splitter = FeatTransformer(shared, n_d + n_a, 2, vbs)
        self.feat = nn.ModuleList([FeatTransformer(shared, n_d + n_a, 2, vbs) for _ in range(n_steps)])
        self.att = nn.ModuleList([AttentiveTransformer(n_a, d_in, vbs) for _ in range(n_steps)])
        self.final = nn.Linear(n_d, 1)

    def _inputs(self, x_num, x_cat):
        e = torch.cat([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], 1)
        return self.initial_bn(torch.cat([x_num, e], 1))

    def forward(self, x_num, x_cat):
        x = self._inputs(x_num, x_cat)
        prior = torch.ones_like(x)
        a = self.initial_splitter(x)[:, self.n_d:]
        out, m_loss = 0.0, 0.0
        for step in range(self.n_steps):
            m = self.att[step](prior, a)
            m_loss = m_loss + torch.mean(torch.sum(m * torch.log(m + 1e-15), dim=1))
            prior = (self.gamma - m) * prior
            h = self.feat[step](m * x)
            out = out + F.relu(h[:, :self.n_d])
            a = h[:, self.n_d:]
        return self.final(out).squeeze(-1), m_loss / self.n_steps

    @torch.no_grad()
    def explain(self, x_num, x_cat):
        x = self._inputs(x_num, x_cat)
        prior = torch.ones_like(x)
        a = self.initial_splitter(x)[:, self.n_d:]
        importance = torch.zeros_like(x)
        for step in range(self.n_steps):
            m = self.att[step](prior, a)
            h = self.feat[step](m * x)
            importance += m * F.relu(h[:, :self.n_d]).sum(1, keepdim=True)
            prior = (self.gamma - m) * prior
            a = h[:, self.n_d:]
        return importance


def feature_importance(model, loader, device):
    model.eval()
    total = None
    for x_num, x_cat, _ in loader:
        imp = model.explain(x_num.to(device), x_cat.to(device)).sum(0)
        total = imp if total is None else total + imp
    total = total.cpu().numpy()
    return total / total.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/plant/batches.parquet")
    ap.add_argument("--out", default="runs/tabnet_defects")
    ap.add_argument("--batch-size", type=int, default=2048, help="per GPU")
    ap.add_argument("--virtual-batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--lambda-sparse", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--patience", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_parquet(args.data).sort_values("produced_at").reset_index(drop=True)
    num_cols = [c for c in df.columns if c not in CAT_COLS + [TARGET, "batch_id", "produced_at"]]
    cat_dims = []
    for c in CAT_COLS:
        df[c] = pd.Categorical(df[c].astype(str)).codes  # categories sorted lexically
        cat_dims.append(int(df[c].max()) + 1)
    split = int(0.8 * len(df))  # last 20% of production as validation
    mu, sd = df[num_cols].iloc[:split].mean(), df[num_cols].iloc[:split].std() + 1e-6
    df[num_cols] = ((df[num_cols] - mu) / sd).fillna(0.0)

    def to_ds(frame):
        return TensorDataset(torch.tensor(frame[num_cols].values, dtype=torch.float32),
                             torch.tensor(frame[CAT_COLS].values, dtype=torch.long),
                             torch.tensor(frame[TARGET].values, dtype=torch.float32))

    train_ds, valid_ds = to_ds(df.iloc[:split]), to_ds(df.iloc[split:])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=8192, shuffle=False)

    model = TabNet(len(num_cols), cat_dims, vbs=args.virtual_batch_size)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    pos_weight = torch.tensor((1 - df[TARGET].iloc[:split].mean()) / df[TARGET].iloc[:split].mean(), device=device)

    best_auc, wait, ckpt = 0.0, 0, os.path.join(args.out, "tabnet_best.pt")
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x_num, x_cat, y in loader:
            x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
            logits, m_loss = model(x_num, x_cat)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight) - args.lambda_sparse * m_loss
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
        sched.step()

        # validation is small: rank 0 scores it with the unwrapped module, the others wait
        flag = torch.zeros(1, device=device)
        if rank == 0:
            model.module.eval()
            with torch.no_grad():
                probs = torch.cat([torch.sigmoid(model.module(xn.to(device), xc.to(device))[0]).cpu()
                                   for xn, xc, _ in valid_loader]).numpy()
            y_val = valid_ds.tensors[2].numpy()
            auc = roc_auc_score(y_val, probs)
            print(f"epoch {epoch:03d} val_auc {auc:.4f} "
                  f"f1@0.5 {f1_score(y_val, probs > 0.5):.4f}", flush=True)
            if auc > best_auc:
                best_auc, wait = auc, 0
                torch.save(model.module.state_dict(), ckpt)
            else:
                wait += 1
            flag[0] = float(wait >= args.patience)
        dist.broadcast(flag, src=0)
        if flag.item():
            break

    if rank == 0:
        model.module.load_state_dict(torch.load(ckpt, map_location=device))
        imp = feature_importance(model, valid_loader, device)
        names = num_cols + CAT_COLS
        ranking = sorted(zip(names, imp.tolist()), key=lambda t: -t[1])
        with open(os.path.join(args.out, "feature_importance.json"), "w") as f:
            json.dump({"best_auc": best_auc, "importance": ranking}, f, indent=2)
        print("top features:", ranking[:10])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
