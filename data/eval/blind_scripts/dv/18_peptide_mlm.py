"""Small masked LM for short peptides (8-50 aa): immunopeptidomics ligands from IEDB +
antimicrobial peptides (DBAASP).  Used as the encoder for the MHC-binding and AMP
activity heads, so we keep it tiny and train many epochs.

    torchrun --standalone --nproc_per_node=2 18_peptide_mlm.py --data data/peptides.parquet
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWY"
PAD, CLS, MASK, UNK = 0, 1, 2, 3
STOI = {a: i + 4 for i, a in enumerate(AA)}
VOCAB = 4 + len(AA)
MAX_LEN = 52

logger = logging.getLogger(__name__)


class Peptides(Dataset):
    def __init__(self, peptides):
        self.peps = peptides

    def __len__(self):
        return len(self.peps)

    def __getitem__(self, i):
        p = self.peps[i]
        ids = np.full(MAX_LEN, PAD, dtype=np.int64)
        ids[0] = CLS
        ids[1:len(p) + 1] = [STOI.get(a, UNK) for a in p]
        return torch.from_numpy(ids)


def dynamic_mask(ids, p=0.2):
    # short sequences: mask at least one residue per peptide
    aa = ids >= 4
    sel = (torch.rand(ids.shape, device=ids.device) < p) & aa
    none = sel.sum(1) == 0
    if none.any():
        scores = torch.rand(ids.shape, device=ids.device).masked_fill(~aa, -1.0)
        forced = F.one_hot(scores.argmax(1), ids.size(1)).bool()
        sel = sel | (forced & none[:, None])
    labels = ids.masked_fill(~sel, -100)
    return ids.masked_fill(sel, MASK), labels


class PepEncoder(nn.Module):
    def __init__(self, d=256, layers=6, heads=8, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Embedding(MAX_LEN, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.lm = nn.Linear(d, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos.weight[None, : ids.size(1)]
        x = self.enc(x, src_key_padding_mask=ids.eq(PAD))
        return self.lm(self.ln(x))


def split_peptides(df, valid_frac, seed):
    # split on the 9-mer core cluster so near-identical ligands stay on one side
    clusters = sorted(df["cluster"].unique())
    rng = random.Random(seed)
    rng.shuffle(clusters)
    n_valid = int(len(clusters) * valid_frac)
    valid_clusters = set(clusters[:n_valid])
    is_valid = df["cluster"].isin(valid_clusters)
    return df.loc[~is_valid, "peptide"].tolist(), df.loc[is_valid, "peptide"].tolist()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device, dtype=torch.float64)
    for ids in loader:
        ids = ids.to(device)
        inp, labels = dynamic_mask(ids)
        logits = model(inp)
        m = labels != -100
        t[0] += F.cross_entropy(logits[m], labels[m], reduction="sum")
        t[1] += (logits[m].argmax(-1) == labels[m]).sum()
        t[2] += m.sum()
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/pepmlm")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--valid-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--patience", type=int, default=15)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    df = pd.read_parquet(args.data, columns=["peptide", "cluster"])
    df = df[df.peptide.str.len().between(8, MAX_LEN - 1)]
    train_peps, valid_peps = split_peptides(df, args.valid_frac, args.seed)
    train_ds, valid_ds = Peptides(train_peps), Peptides(valid_peps)
    logger.info("train %d / valid %d peptides", len(train_ds), len(valid_ds))

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                              batch_size=1024, num_workers=2)

    model = DDP(PepEncoder().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20, eta_min=1e-5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, wait = math.inf, 0
    for epoch in range(args.epochs):
        model.train()
        t0, total, n = time.time(), 0.0, 0
        for i, ids in enumerate(train_loader):
            ids = ids.to(device, non_blocking=True)
            inp, labels = dynamic_mask(ids)
            logits = model(inp)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step(epoch + i / len(train_loader))
            total += loss.item()
            n += 1

        vloss, vacc = evaluate(model.module, valid_loader, device)
        logger.info("epoch %d train %.4f valid %.4f (ppl %.2f, acc %.3f) %.0fs",
                    epoch, total / n, vloss, math.exp(vloss), vacc, time.time() - t0)
        if vloss < best - 1e-4:
            best, wait = vloss, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "valid_loss": vloss},
                           os.path.join(args.out, "best.pt"))
        else:
            wait += 1
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()
        if wait >= args.patience:
            logger.info("early stop at epoch %d", epoch)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
