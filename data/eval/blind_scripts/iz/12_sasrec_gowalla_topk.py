"""
Next-POI recommendation on Gowalla check-ins with SASRec.
Full ranking over all POIs; per-user ranks are collected on rank 0 so that
HR/NDCG at several cut-offs and a per-user report can be written in one place.

    torchrun --nproc_per_node=4 12_sasrec_gowalla_topk.py --checkins data/gowalla/loc-gowalla_totalCheckins.txt
"""
import argparse
import csv
import math
import os
import random
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkins", required=True)
    ap.add_argument("--out_dir", default="results/sasrec_gowalla")
    ap.add_argument("--min_user", type=int, default=20)
    ap.add_argument("--min_poi", type=int, default=10)
    ap.add_argument("--max_len", type=int, default=100)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--cutoffs", default="1,5,10,20,50")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def read_gowalla(path, min_user, min_poi):
    rows = []
    with open(path) as f:
        for line in f:
            u, t, _lat, _lon, loc = line.rstrip("\n").split("\t")
            rows.append((int(u), t, int(loc)))
    poi_cnt = Counter(r[2] for r in rows)
    rows = [r for r in rows if poi_cnt[r[2]] >= min_poi]
    user_cnt = Counter(r[0] for r in rows)
    rows = [r for r in rows if user_cnt[r[0]] >= min_user]
    pois = sorted({r[2] for r in rows})
    poi_id = {p: i + 1 for i, p in enumerate(pois)}
    per_user = defaultdict(list)
    for u, t, loc in rows:
        per_user[u].append((t, poi_id[loc]))
    users = sorted(per_user)
    seqs = [[p for _, p in sorted(per_user[u])] for u in users]
    return users, seqs, len(pois)


class ShiftedSeqs(Dataset):
    """Input = history[:-1], target = history[1:]; trained with a full softmax over all POIs."""

    def __init__(self, seqs, max_len):
        self.seqs = [s[:-2] for s in seqs]
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        x, y = s[:-1][-self.max_len:], s[1:][-self.max_len:]
        pad = self.max_len - len(x)
        return torch.tensor([0] * pad + x), torch.tensor([0] * pad + y)


class SASRec(nn.Module):
    def __init__(self, n_poi, max_len, d, layers, heads, dropout):
        super().__init__()
        self.poi = nn.Embedding(n_poi + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 2 * d, dropout, batch_first=True, norm_first=True),
            layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        L = x.size(1)
        h = self.poi(x) * math.sqrt(self.poi.embedding_dim) + self.pos.weight[:L]
        h = self.drop(h) * (x != 0).unsqueeze(-1)
        causal = torch.triu(torch.ones(L, L, device=x.device, dtype=torch.bool), 1)
        return self.norm(self.blocks(h, mask=causal))


def full_softmax_loss(h, y, table):
    m = y != 0
    logits = h[m] @ table.t()
    return F.cross_entropy(logits, y[m])


@torch.no_grad()
def target_ranks(net, seqs, users, max_len, split, device):
    net.eval()
    out = []
    for b in range(0, len(users), 256):
        idx = users[b:b + 256]
        xs, ts = [], []
        for u in idx:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-max_len:]
            xs.append([0] * (max_len - len(hist)) + hist)
            ts.append(tgt)
        x = torch.tensor(xs, device=device)
        t = torch.tensor(ts, device=device)
        h = net(x)[:, -1]
        scores = h @ net.poi.weight.t()
        scores[:, 0] = float("-inf")
        tgt_score = scores.gather(1, t[:, None])
        out.append((scores > tgt_score).sum(1))
    net.train()
    return torch.cat(out)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    cutoffs = [int(c) for c in args.cutoffs.split(",")]

    user_ids, seqs, n_poi = read_gowalla(args.checkins, args.min_user, args.min_poi)
    if rank == 0:
        print(f"{len(seqs)} users, {n_poi} POIs", flush=True)
        os.makedirs(args.out_dir, exist_ok=True)

    ds = ShiftedSeqs(seqs, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch // world, sampler=sampler, num_workers=4, pin_memory=True)

    net = SASRec(n_poi, args.max_len, args.d, args.layers, args.heads, args.dropout).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    my_users = list(range(rank, len(seqs), world))

    def gather_ranks(split):
        local = target_ranks(net, seqs, my_users, args.max_len, split, dev)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        # rank r evaluated users r, r + world, ...; restore the global user order
        full = torch.empty(len(seqs), dtype=local.dtype, device=dev)
        for r, part in enumerate(parts):
            full[r::world] = part
        return full

    def summarize(ranks):
        rf = ranks.double()
        res = {}
        for k in cutoffs:
            hit = (rf < k).double()
            res[f"HR@{k}"] = hit.mean().item()
            res[f"NDCG@{k}"] = (hit / torch.log2(rf + 2)).mean().item()
        return res

    best = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        agg = torch.zeros(2, device=dev)
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            h = model(x)
            loss = full_softmax_loss(h, y, net.poi.weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if epoch % args.eval_every == 0:
            ranks = gather_ranks("valid")
            if rank == 0:
                res = summarize(ranks)
                print(f"epoch {epoch} valid " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
                if res["NDCG@10"] > best:
                    best = res["NDCG@10"]
                    torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out_dir, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out_dir, "best.pt"), map_location=dev)
    net.load_state_dict(ckpt["model"])
    ranks = gather_ranks("test")
    if rank == 0:
        res = summarize(ranks)
        print("test", res, flush=True)
        with open(os.path.join(args.out_dir, "test_ranks.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["user_id", "rank"])
            for uid, r in zip(user_ids, ranks.tolist()):
                w.writerow([uid, r])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
