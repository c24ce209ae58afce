"""Chargeback prediction for card-not-present orders.

FT-Transformer with
  * a class-balanced *distributed* weighted sampler (same multinomial draw on every rank,
    each rank takes its own stride of it),
  * an auxiliary masked-feature reconstruction head that is only trained for the first
    --aux-epochs epochs (so DDP needs find_unused_parameters afterwards).

    torchrun --standalone --nproc_per_node=4 12_chargeback_weighted_sampler.py --orders data/orders.parquet
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT = ["merchant_mcc", "issuer_country", "ip_country", "device_os", "payment_brand", "shipping_method"]
NUM = ["amount_usd", "items", "account_age_days", "orders_30d", "distinct_cards_30d",
       "ip_distance_km", "hour", "email_age_days"]


class DistributedWeightedSampler(Sampler):
    def __init__(self, weights, num_replicas, rank, num_samples=None, seed=0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        total = num_samples or len(self.weights)
        self.num_samples = math.ceil(total / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class FTTWithAux(nn.Module):
    def __init__(self, cards, n_num, d=64, depth=4, heads=8):
        super().__init__()
        self.cat_emb = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.05)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.mask_tok = nn.Parameter(torch.zeros(d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.n_cat = len(cards)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))
        self.recon_head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, xc, xn, num_mask=None):
        cat_t = torch.stack([e(xc[:, i]) for i, e in enumerate(self.cat_emb)], 1)
        num_t = xn.unsqueeze(-1) * self.num_w + self.num_b
        if num_mask is not None:
            num_t = torch.where(num_mask.unsqueeze(-1), self.mask_tok.expand_as(num_t), num_t)
        h = self.encoder(torch.cat([self.cls.expand(xc.size(0), -1, -1), cat_t, num_t], 1))
        logit = self.head(h[:, 0]).squeeze(-1)
        if num_mask is None:
            return logit
        recon = self.recon_head(h[:, 1 + self.n_cat:]).squeeze(-1)
        return logit, recon


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", required=True)
    ap.add_argument("--valid-frac", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--aux-epochs", type=int, default=5)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--mask-prob", type=float, default=0.15)
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--out", default="runs/chargeback_ftt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # only affects the feature masks; weights come from rank 0 via DDP

    df = pd.read_parquet(args.orders).sort_values("order_ts").reset_index(drop=True)
    n_valid = int(len(df) * args.valid_frac)
    tr, va = df.iloc[:-n_valid], df.iloc[-n_valid:]
    cards, xc_tr, xc_va = [], [], []
    for c in CAT:
        cats = sorted(tr[c].astype(str).unique())
        xc_tr.append(pd.Categorical(tr[c].astype(str), categories=cats).codes + 1)
        xc_va.append(pd.Categorical(va[c].astype(str), categories=cats).codes + 1)
        cards.append(len(cats) + 1)
    med, iqr = tr[NUM].median(), (tr[NUM].quantile(0.75) - tr[NUM].quantile(0.25)).replace(0, 1)
    xn_tr = ((tr[NUM] - med) / iqr).clip(-10, 10).fillna(0).values.astype(np.float32)
    xn_va = ((va[NUM] - med) / iqr).clip(-10, 10).fillna(0).values.astype(np.float32)
    y_tr, y_va = tr["chargeback"].values.astype(np.float32), va["chargeback"].values.astype(np.float32)

    train_ds = TensorDataset(torch.tensor(np.stack(xc_tr, 1), dtype=torch.long), torch.tensor(xn_tr), torch.tensor(y_tr))
    valid_ds = TensorDataset(torch.arange(len(y_va)), torch.tensor(np.stack(xc_va, 1), dtype=torch.long),
                             torch.tensor(xn_va), torch.tensor(y_va))

    pos_rate = y_tr.mean()
    weights = np.where(y_tr == 1, 0.3 / pos_rate, 0.7 / (1 - pos_rate))
    sampler = DistributedWeightedSampler(weights, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, sampler=DistributedSampler(valid_ds, shuffle=False))

    model = FTTWithAux(cards, len(NUM)).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * math.sqrt(world), weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch < args.aux_epochs  # same decision on every rank
        for xc, xn, y in loader:
            xc, xn, y = xc.to(device), xn.to(device), y.to(device)
            if use_aux:
                mask = torch.rand(xn.shape, device=device) < args.mask_prob
                logit, recon = model(xc, xn, mask)
                rec_loss = F.smooth_l1_loss(recon[mask], xn[mask]) if mask.any() else recon.sum() * 0.0
                loss = F.binary_cross_entropy_with_logits(logit, y) + args.aux_weight * rec_loss
            else:
                loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        part = []
        with torch.no_grad():
            for idx, xc, xn, _ in valid_loader:
                part.append((idx.numpy(), torch.sigmoid(model(xc.to(device), xn.to(device))).cpu().numpy()))
        gathered = [None] * world
        dist.all_gather_object(gathered, part)
        if rank == 0:
            idx = np.concatenate([i for g in gathered for i, _ in g])
            prob = np.concatenate([p for g in gathered for _, p in g])
            idx, first = np.unique(idx, return_index=True)
            auc = roc_auc_score(y_va[idx], prob[first])
            print(f"epoch {epoch:02d} aux={use_aux} valid AUC {auc:.4f}", flush=True)
            if auc > best:
                best = auc
                torch.save({"state_dict": model.module.state_dict(), "cards": cards,
                            "median": med.to_dict(), "iqr": iqr.to_dict()},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
