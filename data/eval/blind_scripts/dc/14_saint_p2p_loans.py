"""Masked-feature pretraining, then supervised fine-tuning, of a SAINT-style feature transformer.

Only ~5% of the loan rows carry a repayment label, so the encoder is pretrained on the full table
(masked feature reconstruction) and then fine-tuned on the labelled subset.

torchrun --standalone --nproc_per_node=8 14_saint_p2p_loans.py --data /data/p2p/loans.parquet
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--label-col", default="repaid")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mask-prob", type=float, default=0.3)
    ap.add_argument("--pretrain-epochs", type=int, default=5)
    ap.add_argument("--finetune-epochs", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--pretrain-lr", type=float, default=3e-4)
    ap.add_argument("--finetune-lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/saint_p2p")
    return ap.parse_args()


class FeatureTransformer(nn.Module):
    def __init__(self, n_num, cards, dim, depth, heads):
        super().__init__()
        self.n_num, self.n_cat = n_num, len(cards)
        self.num_w = nn.Parameter(torch.randn(n_num, dim) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, dim))
        self.cat_emb = nn.ModuleList(nn.Embedding(c, dim) for c in cards)
        self.mask_tok = nn.Parameter(torch.zeros(1, 1, dim))
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        # pretraining heads
        self.num_recon = nn.Linear(dim, 1)
        self.cat_recon = nn.ModuleList(nn.Linear(dim, c) for c in cards)
        # supervised head
        self.classifier = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))

    def encode(self, xn, xc, mask=None):
        tok = torch.cat([xn[..., None] * self.num_w + self.num_b,
                         torch.stack([e(xc[:, i]) for i, e in enumerate(self.cat_emb)], 1)], 1)
        if mask is not None:
            tok = torch.where(mask[..., None], self.mask_tok.expand_as(tok), tok)
        tok = torch.cat([self.cls.expand(len(tok), -1, -1), tok], 1)
        return self.norm(self.encoder(tok))

    def forward(self, xn, xc, mask=None):
        h = self.encode(xn, xc, mask)
        if mask is None:
            return self.classifier(h[:, 0]).squeeze(-1)
        num_pred = self.num_recon(h[:, 1:1 + self.n_num]).squeeze(-1)
        cat_logits = [head(h[:, 1 + self.n_num + i]) for i, head in enumerate(self.cat_recon)]
        return num_pred, cat_logits


def prepare(path, label_col, seed):
    df = pd.read_parquet(path)
    cat_cols = [c for c in df.columns if df[c].dtype == object]
    num_cols = [c for c in df.columns if c not in cat_cols and c != label_col]
    cards, xc = [], []
    for c in cat_cols:
        cats = pd.Index(np.sort(df[c].astype(str).unique()))
        cards.append(len(cats))
        xc.append(cats.get_indexer(df[c].astype(str)))
    xc = np.stack(xc, 1).astype(np.int64)
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, subsample=10**6, random_state=seed)
    xn = qt.fit_transform(df[num_cols].fillna(df[num_cols].median()).values).astype(np.float32)
    y = df[label_col].values
    labelled = ~pd.isna(y)
    lab_idx = np.flatnonzero(labelled)
    rng = np.random.default_rng(seed)
    rng.shuffle(lab_idx)
    n_val = len(lab_idx) // 5
    va, tr = lab_idx[:n_val], lab_idx[n_val:]
    yf = np.nan_to_num(y.astype(np.float64)).astype(np.float32)
    unl = TensorDataset(torch.from_numpy(xn), torch.from_numpy(xc))
    mk = lambda ix: TensorDataset(torch.from_numpy(xn[ix]), torch.from_numpy(xc[ix]), torch.from_numpy(yf[ix]))
    return unl, mk(tr), mk(va), len(num_cols), cards


@torch.no_grad()
def evaluate(net, ds, rank, world, device):
    net.eval()
    xn, xc, y = ds.tensors
    sel = torch.arange(rank, len(y), world)
    p = torch.cat([torch.sigmoid(net(xn[sel[i:i + 8192]].to(device), xc[sel[i:i + 8192]].to(device))).cpu()
                   for i in range(0, len(sel), 8192)])
    parts = [None] * world
    dist.all_gather_object(parts, (sel, p))
    idx = torch.cat([a for a, _ in parts])
    p = torch.cat([b for _, b in parts])
    return roc_auc_score(y[idx].numpy(), p.numpy())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    unl_ds, train_ds, val_ds, n_num, cards = prepare(args.data, args.label_col, args.seed)
    net = FeatureTransformer(n_num, cards, args.dim, args.depth, args.heads).to(device)
    model = DDP(net, device_ids=[local_rank])
    bs = args.global_batch // world
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    # ---- phase 1: masked feature reconstruction on all rows ----
    sampler = DistributedSampler(unl_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(unl_ds, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=1e-5)
    for epoch in range(args.pretrain_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for xn, xc in loader:
            xn, xc = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True)
            mask = torch.rand(xn.size(0), n_num + len(cards), device=device) < args.mask_prob
            num_pred, cat_logits = model(xn, xc, mask)
            m_num = mask[:, :n_num]
            loss = F.mse_loss(num_pred[m_num], xn[m_num])
            for i, logits in enumerate(cat_logits):
                m = mask[:, n_num + i]
                loss = loss + F.cross_entropy(logits[m], xc[m, i]) / len(cat_logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"[pretrain] epoch {epoch} recon_loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save(net.state_dict(), os.path.join(args.out, "pretrained.pt"))

    # ---- phase 2: supervised fine-tuning on the labelled rows ----
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.finetune_lr, weight_decay=1e-5)
    best = 0.0
    for epoch in range(args.finetune_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        auc = evaluate(net, val_ds, rank, world, device)
        if rank == 0:
            print(f"[finetune] epoch {epoch} val_auc {auc:.5f}", flush=True)
            if auc > best:
                best = auc
                torch.save(net.state_dict(), os.path.join(args.out, "finetuned_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
