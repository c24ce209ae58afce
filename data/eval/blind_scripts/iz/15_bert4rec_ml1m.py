"""
BERT4Rec reproduction on MovieLens-1M.

Leave-one-out; validation = second-to-last item, test = last item, both ranked
against 100 negatives sampled by popularity.

    torchrun --nproc_per_node=2 15_bert4rec_ml1m.py --ratings data/ml-1m/ratings.dat --save_dir ckpt/b4r_ml1m
"""
import argparse
import math
import os
import random
import time
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ratings", default="data/ml-1m/ratings.dat")
    parser.add_argument("--save_dir", default="ckpt/b4r_ml1m")
    parser.add_argument("--max_len", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--mask_prob", type=float, default=0.2)
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--decay_step", type=int, default=25)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def read_ml1m(path):
    d = defaultdict(list)
    with open(path, encoding="latin-1") as f:
        for line in f:
            u, i, r, t = line.rstrip().split("::")
            d[int(u)].append((int(t), int(i)))
    smap = {s: k + 1 for k, s in enumerate(sorted({i for v in d.values() for _, i in v}))}
    seqs = [[smap[i] for _, i in sorted(d[u])] for u in sorted(d)]
    pop = Counter(i for s in seqs for i in s)
    return seqs, len(smap), pop


class BertTrainDataset(Dataset):
    def __init__(self, seqs, n_items, max_len, mask_prob, seed):
        self.seqs = [s[:-2] for s in seqs]
        self.n_items = n_items
        self.mask_token = n_items + 1
        self.max_len = max_len
        self.mask_prob = mask_prob
        self.rng = random.Random(seed)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        seq = self.seqs[idx]
        tokens, labels = [], []
        for s in seq:
            prob = self.rng.random()
            if prob < self.mask_prob:
                prob /= self.mask_prob
                if prob < 0.8:
                    tokens.append(self.mask_token)
                elif prob < 0.9:
                    tokens.append(self.rng.randint(1, self.n_items))
                else:
                    tokens.append(s)
                labels.append(s)
            else:
                tokens.append(s)
                labels.append(0)
        tokens, labels = tokens[-self.max_len:], labels[-self.max_len:]
        pad = self.max_len - len(tokens)
        return torch.LongTensor([0] * pad + tokens), torch.LongTensor([0] * pad + labels)


class BertEvalDataset(Dataset):
    def __init__(self, seqs, users, n_items, max_len, pop, split, seed):
        rng = np.random.default_rng(seed)
        items = np.array(sorted(pop))
        p = np.array([pop[i] for i in items], dtype=np.float64)
        p /= p.sum()
        self.rows = []
        for u in users:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "val" else (s[:-1], s[-1])
            x = (hist + [n_items + 1])[-max_len:]
            seen = set(s)
            negs = []
            while len(negs) < 100:
                for c in rng.choice(items, size=200, p=p):
                    if c not in seen and len(negs) < 100:
                        negs.append(int(c))
            self.rows.append(([0] * (max_len - len(x)) + x, [tgt] + negs))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        x, c = self.rows[i]
        return torch.LongTensor(x), torch.LongTensor(c)


class BERT(nn.Module):
    def __init__(self, n_items, max_len, hidden, layers, heads, dropout):
        super().__init__()
        self.token = nn.Embedding(n_items + 2, hidden, padding_idx=0)
        self.position = nn.Embedding(max_len, hidden)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout, activation="gelu",
                                       batch_first=True, norm_first=True),
            layers)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, n_items + 1)

    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device).expand_as(x)
        h = self.dropout(self.token(x) + self.position(pos))
        h = self.encoder(h, src_key_padding_mask=(x == 0))
        return self.out(self.norm(h))


@torch.no_grad()
def evaluate(net, loader, device, ks=(1, 5, 10)):
    net.eval()
    acc = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for x, cands in loader:
        x, cands = x.to(device), cands.to(device)
        scores = net(x)[:, -1, :].gather(1, cands)
        rank = (scores[:, 1:] > scores[:, :1]).sum(1).double()
        for j, k in enumerate(ks):
            hit = (rank < k).double()
            acc[j] += hit.sum()
            acc[len(ks) + j] += (hit / torch.log2(rank + 2)).sum()
        acc[-1] += x.size(0)
    dist.all_reduce(acc)
    net.train()
    res = {f"HR@{k}": (acc[j] / acc[-1]).item() for j, k in enumerate(ks)}
    res.update({f"NDCG@{k}": (acc[len(ks) + j] / acc[-1]).item() for j, k in enumerate(ks)})
    return res


def save_checkpoint(net, optimizer, scheduler, epoch, metrics, path):
    torch.save({"model_state_dict": net.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(),
                "epoch": epoch, "metrics": metrics}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    seqs, n_items, pop = read_ml1m(args.ratings)
    my_users = list(range(rank, len(seqs), world))
    train_ds = BertTrainDataset(seqs, n_items, args.max_len, args.mask_prob, seed=args.seed + rank)
    val_ds = BertEvalDataset(seqs, my_users, n_items, args.max_len, pop, "val", seed=rank)
    test_ds = BertEvalDataset(seqs, my_users, n_items, args.max_len, pop, "test", seed=1000 + rank)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=0)
    val_dl = DataLoader(val_ds, batch_size=256)
    test_dl = DataLoader(test_ds, batch_size=256)

    net = BERT(n_items, args.max_len, args.hidden, args.layers, args.heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay_step, gamma=args.gamma)

    os.makedirs(args.save_dir, exist_ok=True)
    best_path = os.path.join(args.save_dir, "best_acc_model.pth")
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for x, labels in train_dl:
            x, labels = x.to(device), labels.to(device)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} loss {(meter[0] / meter[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        val = evaluate(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()), flush=True)
        if val["NDCG@10"] > best:
            best = val["NDCG@10"]
            save_checkpoint(net, optimizer, scheduler, epoch, val, best_path)
        dist.barrier()

    ckpt = torch.load(best_path, map_location=device)
    net.load_state_dict(ckpt["model_state_dict"])
    test = evaluate(net, test_dl, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} test " + ", ".join(f"{k} {v:.4f}" for k, v in test.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
