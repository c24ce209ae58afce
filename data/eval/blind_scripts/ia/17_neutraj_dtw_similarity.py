"""Learned trajectory similarity (NeuTraj-style) approximating DTW on Porto taxis.

A seed set of trajectories with a precomputed pairwise DTW matrix is used for
training: for each anchor we take its nearest neighbours under DTW plus random
far trajectories, and regress exp(-alpha * DTW) with exp(-||e_i - e_j||).
Evaluation: top-10 / top-50 hitting ratio of the embedding kNN against exact
DTW kNN on held-out queries.

    torchrun --nproc_per_node=4 17_neutraj_dtw_similarity.py --seed_dir data/porto_dtw
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed_dir", default="data/porto_dtw")
    ap.add_argument("--out", default="ckpt/neutraj")
    ap.add_argument("--n_train", type=int, default=3000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--near", type=int, default=10)
    ap.add_argument("--far", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_seed(seed_dir):
    trajs = np.load(os.path.join(seed_dir, "trajs.npy"), allow_pickle=True)  # list of (L, 2) lon/lat
    dtw = np.load(os.path.join(seed_dir, "dtw.npy"), mmap_mode="r")  # (N, N)
    allpts = np.concatenate(list(trajs))
    mean, std = allpts.mean(0), allpts.std(0)
    trajs = [((t - mean) / std).astype(np.float32) for t in trajs]
    return trajs, dtw


class AnchorDataset(Dataset):
    """One item = an anchor with near and far partners and their target similarities."""

    def __init__(self, trajs, dtw, ids, near, far, alpha):
        self.trajs, self.ids, self.near, self.far, self.alpha = trajs, np.asarray(ids), near, far, alpha
        sub = np.asarray(dtw[np.ix_(self.ids, self.ids)])
        self.order = np.argsort(sub, axis=1)[:, 1:]  # column 0 is the anchor itself
        self.sim = np.exp(-alpha * sub / sub.mean())

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        near = self.order[i, : self.near]
        far = np.random.choice(self.order[i, self.near:], self.far, replace=False)
        partners = np.concatenate([near, far])
        items = [self.trajs[self.ids[i]]] + [self.trajs[self.ids[j]] for j in partners]
        return items, torch.from_numpy(self.sim[i, partners].astype(np.float32))


def collate(batch):
    seqs = [torch.from_numpy(t) for items, _ in batch for t in items]
    lengths = torch.tensor([len(s) for s in seqs])
    targets = torch.stack([b[1] for b in batch])
    return pad_sequence(seqs, batch_first=True), lengths, targets


class TrajGRU(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.inp = nn.Linear(2, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=2, batch_first=True)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.inp(x), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return h[-1]


def pair_loss(emb, targets, n_partner):
    B = targets.size(0)
    emb = emb.view(B, 1 + n_partner, -1)
    anchor, partners = emb[:, :1], emb[:, 1:]
    pred = torch.exp(-torch.norm(anchor - partners, dim=-1))
    rank_w = torch.linspace(1.0, 0.1, n_partner, device=emb.device)[None]
    return (rank_w * (pred - targets) ** 2).sum(1).mean()


@torch.no_grad()
def hitting_ratio(net, trajs, dtw, query_ids, db_ids, device, ks=(10, 50)):
    net.eval()

    def embed(ids):
        out = []
        for i in range(0, len(ids), 512):
            seqs = [torch.from_numpy(trajs[j]) for j in ids[i:i + 512]]
            lengths = torch.tensor([len(s) for s in seqs])
            out.append(net(pad_sequence(seqs, batch_first=True).to(device), lengths))
        return torch.cat(out)

    q, d = embed(query_ids), embed(db_ids)
    emb_knn = torch.cdist(q, d).topk(max(ks), largest=False).indices.cpu().numpy()
    true_knn = np.argsort(np.asarray(dtw[np.ix_(query_ids, db_ids)]), axis=1)[:, : max(ks)]
    net.train()
    return {f"HR@{k}": float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(emb_knn, true_knn)]))
            for k in ks}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    trajs, dtw = load_seed(args.seed_dir)
    ids = np.random.default_rng(args.seed).permutation(len(trajs))
    train_ids, query_ids, db_ids = ids[: args.n_train], ids[args.n_train: args.n_train + 1000], ids[args.n_train:]
    train_ds = AnchorDataset(trajs, dtw, train_ids, args.near, args.far, args.alpha)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)

    net = TrajGRU(args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    n_partner = args.near + args.far

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"seed trajectories={len(trajs)} train anchors={len(train_ids)} queries={len(query_ids)} "
              f"db={len(db_ids)}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, lengths, targets in train_dl:
            x, targets = x.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = pair_loss(model(x, lengths), targets, n_partner)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0 and (epoch + 1) % args.eval_every == 0:
            hr = hitting_ratio(net, trajs, dtw, query_ids, db_ids, device)
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.5f} {hr} ({time.time() - t0:.0f}s)", flush=True)
            if hr["HR@10"] > best:
                best = hr["HR@10"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "hr": hr}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
