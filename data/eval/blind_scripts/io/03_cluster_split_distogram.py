"""Single-sequence distogram model trained on PDB chains with a cluster-level split.

Chains are grouped by an MMseqs2 clustering at 30% identity (cluster.tsv, two
columns: representative, member). Whole clusters go to validation so that no
validation chain has a close homolog in training. Every epoch samples one random
member per training cluster, as in the AlphaFold / RoseTTAFold training sets.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 03_cluster_split_distogram.py \
        --clusters data/pdb30/cluster.tsv --feat_dir data/pdb30/npz
"""
import argparse
import collections
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWYX"
AA_TO_IDX = {a: i for i, a in enumerate(AA)}
NUM_BINS = 37          # 2-20 A in 0.5 A bins + a no-contact bin
log = logging.getLogger("distogram")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", required=True)
    ap.add_argument("--feat_dir", required=True)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--pair_dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup_epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--save_dir", default="checkpoints/distogram")
    return ap.parse_args()


def load_clusters(path, feat_dir):
    clusters = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            rep, member = line.split()
            if os.path.exists(os.path.join(feat_dir, member + ".npz")):
                clusters[rep].append(member)
    return clusters


def split_clusters(clusters, val_frac):
    reps = sorted(clusters)
    random.shuffle(reps)
    n_val = max(1, int(len(reps) * val_frac))
    val = [clusters[r] for r in reps[:n_val]]
    train = [clusters[r] for r in reps[n_val:]]
    return train, val


def dist_to_bins(d):
    bins = torch.clamp(((d - 2.0) / 0.5).floor().long(), 0, NUM_BINS - 1)
    bins[d > 20.0] = NUM_BINS - 1
    return bins


class ClusterDataset(Dataset):
    """Index i is a cluster; a random member is drawn per access (train) or the first one (val)."""

    def __init__(self, clusters, feat_dir, crop, train):
        self.clusters, self.feat_dir, self.crop, self.train = clusters, feat_dir, crop, train

    def __len__(self):
        return len(self.clusters)

    def __getitem__(self, i):
        members = self.clusters[i]
        name = random.choice(members) if self.train else members[0]
        d = np.load(os.path.join(self.feat_dir, name + ".npz"))
        seq = torch.tensor([AA_TO_IDX.get(a, 20) for a in str(d["seq"])])
        dmat = torch.from_numpy(d["cb_dist"]).float()
        L = seq.shape[0]
        if L > self.crop:
            s = random.randint(0, L - self.crop) if self.train else (L - self.crop) // 2
            seq, dmat = seq[s:s + self.crop], dmat[s:s + self.crop, s:s + self.crop]
        mask = ~torch.isnan(dmat)
        target = dist_to_bins(torch.nan_to_num(dmat, nan=99.0))
        return seq, target, mask


def collate(batch):
    L = max(s.shape[0] for s, _, _ in batch)
    B = len(batch)
    seq = torch.full((B, L), 20, dtype=torch.long)
    pad = torch.ones(B, L, dtype=torch.bool)
    tgt = torch.zeros(B, L, L, dtype=torch.long)
    msk = torch.zeros(B, L, L, dtype=torch.bool)
    for b, (s, t, m) in enumerate(batch):
        n = s.shape[0]
        seq[b, :n], pad[b, :n] = s, False
        tgt[b, :n, :n], msk[b, :n, :n] = t, m
    return seq, pad, tgt, msk


class DistogramNet(nn.Module):
    def __init__(self, dim, pair_dim, layers, max_rel=32):
        super().__init__()
        self.embed = nn.Embedding(len(AA), dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.max_rel = max_rel
        self.relpos = nn.Embedding(2 * max_rel + 1, pair_dim)
        self.left = nn.Linear(dim, pair_dim)
        self.right = nn.Linear(dim, pair_dim)
        self.pair_mlp = nn.Sequential(nn.LayerNorm(pair_dim), nn.Linear(pair_dim, pair_dim), nn.ReLU(),
                                      nn.Linear(pair_dim, NUM_BINS))

    def forward(self, seq, pad):
        L = seq.shape[1]
        h = self.encoder(self.embed(seq), src_key_padding_mask=pad)
        pos = torch.arange(L, device=seq.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        pair = self.left(h)[:, :, None] + self.right(h)[:, None, :] + self.relpos(rel)[None]
        logits = self.pair_mlp(pair)
        return 0.5 * (logits + logits.transpose(1, 2))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # loss_sum, n_pairs, hits, n_top
    for seq, pad, tgt, msk in loader:
        seq, pad, tgt, msk = seq.to(device), pad.to(device), tgt.to(device), msk.to(device)
        logits = model(seq, pad).float()
        stats[0] += F.cross_entropy(logits[msk], tgt[msk], reduction="sum")
        stats[1] += msk.sum()
        probs = logits.softmax(-1)[..., :12].sum(-1)  # P(d < 8 A)
        for b in range(seq.shape[0]):
            L = int((~pad[b]).sum())
            i, j = torch.triu_indices(L, L, 24, device=device)
            keep = msk[b, i, j]
            if keep.sum() == 0:
                continue
            p, t = probs[b, i, j][keep], (tgt[b, i, j][keep] < 12)
            top = p.topk(min(L, p.numel())).indices
            stats[2] += t[top].sum()
            stats[3] += top.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3].clamp(min=1)).item()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        log.setLevel(logging.WARNING)

    # different crop / member draws on every rank
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    clusters = load_clusters(args.clusters, args.feat_dir)
    train_clusters, val_clusters = split_clusters(clusters, args.val_frac)
    log.info("%d clusters -> %d train / %d val", len(clusters), len(train_clusters), len(val_clusters))

    train_set = ClusterDataset(train_clusters, args.feat_dir, args.crop, train=True)
    val_set = ClusterDataset(val_clusters, args.feat_dir, args.crop, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, collate_fn=collate,
                            num_workers=2)

    model = DistogramNet(args.dim, args.pair_dim, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = len(train_loader)
    warm = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.save_dir, exist_ok=True)
    best_prec = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (seq, pad, tgt, msk) in enumerate(train_loader):
            seq, pad = seq.to(device, non_blocking=True), pad.to(device, non_blocking=True)
            tgt, msk = tgt.to(device, non_blocking=True), msk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(seq, pad)
            loss = F.cross_entropy(logits.float()[msk], tgt[msk])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f", epoch, it, steps_per_epoch, loss.item())

        val_loss, val_prec = evaluate(model, val_loader, device)
        log.info("epoch %d val loss %.4f  long-range top-L precision %.4f", epoch, val_loss, val_prec)
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if val_prec > best_prec:
                best_prec = val_prec
                torch.save(state, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
