#!/usr/bin/env python
"""Astec-style extreme classifier trained on a fixed ANNS shortlist.

Stage 1 (offline, hnswlib): every train/test product got the 256 nearest tags
of its surrogate embedding -> shortlist_{train,test}.npy. Here we train the
document encoder + per-tag classifiers on (positives + shortlist) only, and report
P@k and propensity-scored PSP@k over the whole test set.

    torchrun --nnodes=1 --nproc_per_node=8 08_astec_style_tagger.py \
        --data /mnt/shared/xmc/amazon670k_astec --out /mnt/shared/xmc/runs/astec
"""
import argparse
import logging
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

LOG = logging.getLogger("astec")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--shortlist-size", type=int, default=256)
    ap.add_argument("--max-pos", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4096, help="global")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--prop-a", type=float, default=0.6)
    ap.add_argument("--prop-b", type=float, default=2.6)
    return ap.parse_args()


def inverse_propensity(Y, A, B):
    """Jain et al. 2016 propensity model; returns 1/p_l per label."""
    n = Y.shape[0]
    freq = np.asarray(Y.sum(axis=0)).ravel()
    C = (np.log(n) - 1) * (B + 1) ** A
    return 1.0 + C * np.exp(-A * np.log(freq + B))


class ShortlistDataset(Dataset):
    def __init__(self, X, Y, shortlist, max_pos):
        self.X, self.Y, self.sl, self.max_pos = X, Y, shortlist, max_pos

    def __len__(self):
        return self.X.shape[0]

    def __getitem__(self, i):
        x0, x1 = self.X.indptr[i], self.X.indptr[i + 1]
        labs = self.Y.indices[self.Y.indptr[i]:self.Y.indptr[i + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return (self.X.indices[x0:x1].astype(np.int64), self.X.data[x0:x1].astype(np.float32),
                pos, self.sl[i].astype(np.int64), i)


def collate(batch):
    idx, val, pos, sl, rows = zip(*batch)
    offsets = np.cumsum([0] + [len(v) for v in idx[:-1]])
    return (torch.from_numpy(np.concatenate(idx)), torch.from_numpy(np.concatenate(val)),
            torch.from_numpy(offsets), torch.from_numpy(np.stack(pos)),
            torch.from_numpy(np.stack(sl)), torch.tensor(rows))


class Astec(nn.Module):
    def __init__(self, vocab, num_labels, dim):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="sum")
        self.res = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(0.2))
        self.clf_w = nn.Embedding(num_labels, dim)
        self.clf_b = nn.Embedding(num_labels, 1)
        nn.init.normal_(self.clf_w.weight, std=0.01)
        nn.init.zeros_(self.clf_b.weight)

    def forward(self, idx, val, offsets, cand):
        h = F.relu(self.emb(idx, offsets, per_sample_weights=val))
        h = h + self.res(h)
        return torch.einsum("bd,bkd->bk", h, self.clf_w(cand)) + self.clf_b(cand).squeeze(-1)


def build_candidates(pos, sl):
    """positives first, then the shortlist; shortlist entries that are positives are masked."""
    cand = torch.cat([pos.clamp(min=0), sl], dim=1)
    is_pos = torch.cat([pos >= 0, (sl.unsqueeze(-1) == pos.unsqueeze(1)).any(-1)], dim=1)
    valid = torch.cat([pos >= 0, ~(sl.unsqueeze(-1) == pos.unsqueeze(1)).any(-1)], dim=1)
    return cand, is_pos.float(), valid.float()


@torch.no_grad()
def evaluate(net, loader, Y, inv_prop, device, ks=(1, 3, 5)):
    net.eval()
    kmax = max(ks)
    p = np.zeros(len(ks))
    psp = np.zeros(len(ks))
    psp_best = np.zeros(len(ks))
    n = 0
    for idx, val, offsets, pos, sl, rows in loader:
        scores = net(idx.to(device), val.to(device), offsets.to(device), sl.to(device))
        top = sl.gather(1, scores.topk(kmax, dim=1).indices.cpu()).numpy()
        for r, pred in zip(rows.numpy(), top):
            true = Y.indices[Y.indptr[r]:Y.indptr[r + 1]]
            hit = np.isin(pred, true)
            w_true = np.sort(inv_prop[true])[::-1]
            for j, k in enumerate(ks):
                p[j] += hit[:k].sum() / k
                psp[j] += (hit[:k] * inv_prop[pred[:k]]).sum() / k
                psp_best[j] += w_true[:k].sum() / k
        n += len(rows)
    stats = torch.tensor(np.concatenate([p, psp, psp_best, [n]]), dtype=torch.float64)
    dist.all_reduce(stats)
    stats = stats.numpy()
    net.train()
    m = len(ks)
    res = {f"P@{k}": stats[j] / stats[-1] for j, k in enumerate(ks)}
    res.update({f"PSP@{k}": stats[m + j] / stats[2 * m + j] for j, k in enumerate(ks)})
    return res


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(0)

    X_tr = sp.load_npz(os.path.join(args.data, "X_trn.npz")).tocsr()
    Y_tr = sp.load_npz(os.path.join(args.data, "Y_trn.npz")).tocsr()
    X_te = sp.load_npz(os.path.join(args.data, "X_tst.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data, "Y_tst.npz")).tocsr()
    sl_tr = np.load(os.path.join(args.data, "shortlist_train.npy"), mmap_mode="r")[:, : args.shortlist_size]
    sl_te = np.load(os.path.join(args.data, "shortlist_test.npy"), mmap_mode="r")[:, : args.shortlist_size]
    inv_prop = inverse_propensity(Y_tr, args.prop_a, args.prop_b)
    num_labels = Y_tr.shape[1]

    train_ds = ShortlistDataset(X_tr, Y_tr, sl_tr, args.max_pos)
    test_rows = np.arange(rank, X_te.shape[0], world)
    test_ds = torch.utils.data.Subset(ShortlistDataset(X_te, Y_te, sl_te, args.max_pos), test_rows)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=2048, collate_fn=collate, num_workers=4)

    net = Astec(X_tr.shape[1], num_labels, args.dim).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 20], gamma=0.1)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (idx, val, offsets, pos, sl, _) in enumerate(train_loader):
            idx, val, offsets = idx.to(device), val.to(device), offsets.to(device)
            cand, target, valid = build_candidates(pos.to(device), sl.to(device))
            logits = model(idx, val, offsets, cand)
            loss = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * valid).sum()
            loss = loss / valid.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if it % 100 == 0:
                LOG.info("epoch %d it %d loss %.5f", epoch, it, loss.item())
        sched.step()
        LOG.info("epoch %d done in %.0fs", epoch, time.time() - t0)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            res = evaluate(net, test_loader, Y_te, inv_prop, device)
            LOG.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in res.items()))
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"net": net.state_dict(), "epoch": epoch, "res": res},
                           os.path.join(args.out, "astec.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
