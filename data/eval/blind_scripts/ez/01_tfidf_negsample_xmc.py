#!/usr/bin/env python
"""Sparse TF-IDF -> product tag classifier with negative sampling.

Inputs are the XMC repository text files (train.txt / test.txt) exported by the
catalog pipeline: a header line "N F L" followed by "l1,l2,... f:v f:v ..." rows.

    torchrun --nproc_per_node=8 01_tfidf_negsample_xmc.py \
        --data-dir /mnt/shared/xmc/amazon670k --output-dir /mnt/shared/xmc/runs/tfidf
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("tfidf_xmc")
KS = (1, 3, 5)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--output-dir", default="/mnt/shared/xmc/runs/tfidf")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--hidden-dim", type=int, default=1024)
    p.add_argument("--num-negatives", type=int, default=8192)
    p.add_argument("--max-pos", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


def read_xmc_file(path):
    with open(path) as f:
        n, num_feat, num_lab = map(int, f.readline().split())
        xr, xc, xv, yr, yc = [], [], [], [], []
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split(" ")
            if ":" in parts[0]:
                labs, feats = [], parts
            else:
                labs = [int(t) for t in parts[0].split(",") if t]
                feats = parts[1:]
            yr.extend([i] * len(labs))
            yc.extend(labs)
            for fv in feats:
                fi, val = fv.split(":")
                xr.append(i)
                xc.append(int(fi))
                xv.append(float(val))
    X = sp.csr_matrix((xv, (xr, xc)), shape=(n, num_feat), dtype=np.float32)
    Y = sp.csr_matrix((np.ones(len(yr), dtype=np.float32), (yr, yc)), shape=(n, num_lab))
    return X, Y


class SparseXMCDataset(Dataset):
    def __init__(self, X, Y):
        self.X, self.Y = X, Y

    def __len__(self):
        return self.X.shape[0]

    def __getitem__(self, i):
        xs, xe = self.X.indptr[i], self.X.indptr[i + 1]
        ys, ye = self.Y.indptr[i], self.Y.indptr[i + 1]
        return self.X.indices[xs:xe], self.X.data[xs:xe], self.Y.indices[ys:ye], i


class Collate:
    def __init__(self, max_pos):
        self.max_pos = max_pos

    def __call__(self, batch):
        idx, val, offsets, pos, mask, rows = [], [], [], [], [], []
        off = 0
        for fi, fv, lab, r in batch:
            offsets.append(off)
            off += len(fi)
            idx.append(torch.from_numpy(fi.astype(np.int64)))
            val.append(torch.from_numpy(fv.astype(np.float32)))
            lab = lab[: self.max_pos]
            p = torch.zeros(self.max_pos, dtype=torch.long)
            m = torch.zeros(self.max_pos)
            p[: len(lab)] = torch.from_numpy(lab.astype(np.int64))
            m[: len(lab)] = 1.0
            pos.append(p)
            mask.append(m)
            rows.append(r)
        return {
            "feat_idx": torch.cat(idx), "feat_val": torch.cat(val),
            "offsets": torch.tensor(offsets, dtype=torch.long),
            "pos": torch.stack(pos), "pos_mask": torch.stack(mask),
            "rows": torch.tensor(rows, dtype=torch.long),
        }


class TfidfXMC(nn.Module):
    def __init__(self, num_features, num_labels, embed_dim, hidden_dim):
        super().__init__()
        self.feat_emb = nn.EmbeddingBag(num_features, embed_dim, mode="sum")
        self.encoder = nn.Sequential(
            nn.LayerNorm(embed_dim), nn.Linear(embed_dim, hidden_dim), nn.GELU(),
            nn.Dropout(0.1), nn.Linear(hidden_dim, embed_dim), nn.LayerNorm(embed_dim),
        )
        self.label_emb = nn.Embedding(num_labels, embed_dim)
        self.label_bias = nn.Parameter(torch.zeros(num_labels))
        nn.init.normal_(self.label_emb.weight, std=0.02)

    def encode(self, feat_idx, feat_val, offsets):
        return self.encoder(self.feat_emb(feat_idx, offsets, per_sample_weights=feat_val))

    def forward(self, feat_idx, feat_val, offsets, cand):
        h = self.encode(feat_idx, feat_val, offsets)
        return h @ self.label_emb(cand).t() + self.label_bias[cand]

    @torch.no_grad()
    def score_all(self, feat_idx, feat_val, offsets):
        h = self.encode(feat_idx, feat_val, offsets)
        return h @ self.label_emb.weight.t() + self.label_bias


def metric_sums(top, rows, Y):
    p, n = np.zeros(len(KS)), np.zeros(len(KS))
    disc = 1.0 / np.log2(np.arange(2, top.shape[1] + 2))
    for r, pred in zip(rows, top):
        true = Y.indices[Y.indptr[r]:Y.indptr[r + 1]]
        hit = np.isin(pred, true).astype(np.float64)
        dcg = np.cumsum(hit * disc)
        idcg = np.cumsum(disc)
        for j, k in enumerate(KS):
            p[j] += hit[:k].sum() / k
            if len(true):
                n[j] += dcg[k - 1] / idcg[min(k, len(true)) - 1]
    return p, n


@torch.no_grad()
def evaluate(model, loader, Y, device):
    model.eval()
    p_sum, n_sum, n_docs = np.zeros(len(KS)), np.zeros(len(KS)), 0
    for b in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = model.score_all(b["feat_idx"].to(device), b["feat_val"].to(device),
                                     b["offsets"].to(device))
        top = scores.float().topk(max(KS), dim=1).indices.cpu().numpy()
        p, n = metric_sums(top, b["rows"].numpy(), Y)
        p_sum += p
        n_sum += n
        n_docs += len(top)
    model.train()
    out = {f"P@{k}": p_sum[j] / n_docs for j, k in enumerate(KS)}
    out.update({f"nDCG@{k}": n_sum[j] / n_docs for j, k in enumerate(KS)})
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    X_tr, Y_tr = read_xmc_file(os.path.join(args.data_dir, "train.txt"))
    X_te, Y_te = read_xmc_file(os.path.join(args.data_dir, "test.txt"))
    num_features, num_labels = X_tr.shape[1], Y_tr.shape[1]
    logger.info("train %d docs, test %d docs, %d features, %d labels",
                X_tr.shape[0], X_te.shape[0], num_features, num_labels)

    per_gpu_bs = args.global_batch_size // world
    train_ds, test_ds = SparseXMCDataset(X_tr, Y_tr), SparseXMCDataset(X_te, Y_te)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    collate = Collate(args.max_pos)
    train_loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=512, sampler=test_sampler,
                             num_workers=args.num_workers, collate_fn=collate, pin_memory=True)

    model = TfidfXMC(num_features, num_labels, args.embed_dim, args.hidden_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(train_loader)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        prog = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * prog))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_p5, step = -1.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for b in train_loader:
            feat_idx = b["feat_idx"].to(device, non_blocking=True)
            feat_val = b["feat_val"].to(device, non_blocking=True)
            offsets = b["offsets"].to(device, non_blocking=True)
            pos = b["pos"].to(device, non_blocking=True)
            mask = b["pos_mask"].to(device, non_blocking=True)

            neg = torch.randint(0, num_labels, (args.num_negatives,), device=device)
            cand = torch.unique(torch.cat([pos[mask.bool()], neg]))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(feat_idx, feat_val, offsets, cand)
            target = torch.zeros(logits.shape, device=device)
            target.scatter_add_(1, torch.searchsorted(cand, pos), mask).clamp_(max=1.0)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target,
                                                      reduction="sum") / offsets.numel()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            running += loss.item()
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e %.1fs", epoch, step,
                            running / 200, scheduler.get_last_lr()[0], time.time() - t0)
                running = 0.0

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(model.module, test_loader, Y_te, device)
            if rank == 0:
                logger.info("epoch %d test %s", epoch,
                            " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "metrics": metrics}
                torch.save(state, os.path.join(args.output_dir, "last.pt"))
                if metrics["P@5"] > best_p5:
                    best_p5 = metrics["P@5"]
                    torch.save(state, os.path.join(args.output_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
