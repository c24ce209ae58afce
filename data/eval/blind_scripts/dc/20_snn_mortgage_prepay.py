"""Self-normalising MLP (SELU + AlphaDropout) for 12-month mortgage prepayment.

Loan-level monthly snapshots in CSV (one file per acquisition quarter); the validation split is the
most recent quarters. Model selection on validation ROC-AUC.

torchrun --standalone --nproc_per_node=4 20_snn_mortgage_prepay.py --data /data/mortgage/quarters \
    --val-quarters 2022Q3 2022Q4 --out runs/snn_prepay
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CATS = ["state", "property_type", "occupancy", "loan_purpose", "channel", "seller", "first_time_buyer"]
NUMS = ["orig_rate", "current_rate", "rate_incentive", "orig_upb", "current_upb", "ltv", "cltv", "dti",
        "fico", "loan_age", "months_to_maturity", "hpi_change_12m", "unemployment_rate", "num_borrowers"]
TARGET = "prepaid_12m"

log = logging.getLogger("snn")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-quarters", nargs="+", default=["2022Q3", "2022Q4"])
    ap.add_argument("--out", default="runs/snn_prepay")
    ap.add_argument("--emb-dim", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--alpha-dropout", type=float, default=0.05)
    ap.add_argument("--global-batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def read_quarters(folder, val_quarters):
    tr, va = [], []
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        q = os.path.basename(path)[:-4]
        df = pd.read_csv(path, usecols=CATS + NUMS + [TARGET], dtype={c: str for c in CATS})
        (va if q in val_quarters else tr).append(df)
    return pd.concat(tr, ignore_index=True), pd.concat(va, ignore_index=True)


def featurize(tr, va):
    cards, xc_tr, xc_va = [], [], []
    for c in CATS:
        vocab = pd.Index(np.sort(tr[c].fillna("NA").unique()))
        cards.append(len(vocab) + 1)
        xc_tr.append(vocab.get_indexer(tr[c].fillna("NA")) + 1)
        xc_va.append(vocab.get_indexer(va[c].fillna("NA")) + 1)
    med = tr[NUMS].median()
    sc = StandardScaler().fit(tr[NUMS].fillna(med).values)
    f = lambda df, xc: TensorDataset(torch.tensor(sc.transform(df[NUMS].fillna(med).values), dtype=torch.float32),
                                     torch.tensor(np.stack(xc, 1), dtype=torch.long),
                                     torch.tensor(df[TARGET].values, dtype=torch.float32))
    return f(tr, xc_tr), f(va, xc_va), cards


class SNN(nn.Module):
    def __init__(self, n_num, cards, emb_dim, width, depth, p):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        layers, d = [], n_num + emb_dim * len(cards)
        for _ in range(depth):
            lin = nn.Linear(d, width)
            nn.init.kaiming_normal_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)
            layers += [lin, nn.SELU(), nn.AlphaDropout(p)]
            d = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, 1)

    def forward(self, xn, xc):
        x = torch.cat([xn] + [e(xc[:, i]) for i, e in enumerate(self.embs)], 1)
        return self.head(self.body(x)).squeeze(-1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ps, ys = [], []
    for xn, xc, y in loader:
        ps.append(torch.sigmoid(net(xn.to(device, non_blocking=True), xc.to(device, non_blocking=True))).cpu())
        ys.append(y)
    p, y = torch.cat(ps).numpy(), torch.cat(ys).numpy()
    return roc_auc_score(y, p), average_precision_score(y, p)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)

    tr_df, va_df = read_quarters(args.data, set(args.val_quarters))
    train_ds, val_ds, cards = featurize(tr_df, va_df)
    del tr_df, va_df
    log.info("train %d rows, val %d rows", len(train_ds), len(val_ds))

    net = SNN(len(NUMS), cards, args.emb_dim, args.width, args.depth, args.alpha_dropout).to(device)
    model = DDP(net, device_ids=[local_rank])

    bs = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=bs, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=4 * bs, sampler=val_sampler, num_workers=2, pin_memory=True)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader), eta_min=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for xn, xc, y in train_loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        val_auc, val_ap = evaluate(net, val_loader, device)
        if rank == 0:
            log.info("epoch %d train_bce %.4f val_auc %.5f val_ap %.5f (%.0fs)", epoch,
                     (loss_acc[0] / loss_acc[1]).item(), val_auc, val_ap, time.time() - t0)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save({"model": net.state_dict(), "cards": cards, "epoch": epoch, "val_auc": val_auc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        log.info("best val AUC %.5f", best_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
