"""NARM (Li et al., 2017) for session-based recommendation on Diginetica (CIKM Cup 2016).

Preprocessing follows the SR-GNN protocol: sessions of length 1 and items with
fewer than 5 occurrences are dropped, the last 7 days are the test set, and
every session prefix becomes one training example. P@20 / MRR@20.

    torchrun --nproc_per_node=4 13_narm_diginetica.py --raw data/diginetica/train-item-views.csv \
        --cache data/diginetica/narm_cache.pt
"""
import argparse
import datetime as dt
import math
import os
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--save", default="checkpoints/narm_digi.pt")
    p.add_argument("--emb", type=int, default=50)
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=512, help="total over all GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr_step", type=int, default=80)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--seed", type=int, default=2017)
    return p.parse_args()


def preprocess(raw_path):
    sess_items, sess_date = defaultdict(list), {}
    with open(raw_path) as f:
        next(f)
        for line in f:
            sid, _uid, item, timeframe, date = line.strip().split(";")
            sess_items[sid].append((int(timeframe), item))
            sess_date[sid] = dt.datetime.strptime(date, "%Y-%m-%d").timestamp()
    sess = {s: [i for _, i in sorted(v)] for s, v in sess_items.items() if len(v) > 1}
    cnt = Counter(i for v in sess.values() for i in v)
    sess = {s: [i for i in v if cnt[i] >= 5] for s, v in sess.items()}
    sess = {s: v for s, v in sess.items() if len(v) > 1}
    split = max(sess_date.values()) - 7 * 86400
    train_ids = sorted((s for s in sess if sess_date[s] < split), key=lambda s: (sess_date[s], s))
    test_ids = sorted((s for s in sess if sess_date[s] >= split), key=lambda s: (sess_date[s], s))
    vocab = {}
    for s in train_ids:
        for it in sess[s]:
            vocab.setdefault(it, len(vocab) + 1)

    def prefixes(ids, keep_unknown):
        xs, ys = [], []
        for s in ids:
            seq = [vocab[i] for i in sess[s] if i in vocab] if not keep_unknown else [vocab[i] for i in sess[s]]
            for k in range(1, len(seq)):
                xs.append(seq[:k])
                ys.append(seq[k])
        return xs, ys

    tr_x, tr_y = prefixes(train_ids, keep_unknown=True)
    te_x, te_y = prefixes(test_ids, keep_unknown=False)
    return {"train": (tr_x, tr_y), "test": (te_x, te_y), "n_items": len(vocab)}


class PrefixData(Dataset):
    def __init__(self, xs, ys):
        self.xs, self.ys = xs, ys

    def __len__(self):
        return len(self.ys)

    def __getitem__(self, i):
        return self.xs[i][-50:], self.ys[i]


def collate(batch):
    lens = torch.tensor([len(x) for x, _ in batch], dtype=torch.long)
    x = torch.zeros(len(batch), int(lens.max()), dtype=torch.long)
    for j, (seq, _) in enumerate(batch):
        x[j, : len(seq)] = torch.tensor(seq)
    return x, lens, torch.tensor([y for _, y in batch])


class ContiguousShardSampler(Sampler):
    """Splits indices into world_size contiguous chunks without padding or duplicates.
    Ranks may get a different number of batches, which is fine for evaluation only."""

    def __init__(self, n, rank, world_size):
        per = math.ceil(n / world_size)
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class NARM(nn.Module):
    def __init__(self, n_items, emb, hidden):
        super().__init__()
        self.emb = nn.Embedding(n_items + 1, emb, padding_idx=0)
        self.emb_drop = nn.Dropout(0.25)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.a1 = nn.Linear(hidden, hidden, bias=False)
        self.a2 = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, 1, bias=False)
        self.ct_drop = nn.Dropout(0.5)
        self.b = nn.Linear(emb, 2 * hidden, bias=False)

    def forward(self, x, lens):
        e = self.emb_drop(self.emb(x))
        packed = pack_padded_sequence(e, lens.cpu(), batch_first=True, enforce_sorted=False)
        out, h = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        c_global = ht = h[-1]
        mask = (x != 0).unsqueeze(-1).float()
        alpha = self.v(torch.sigmoid(self.a1(out) + self.a2(ht).unsqueeze(1))) * mask
        c_local = (alpha * out).sum(1)
        c = self.ct_drop(torch.cat([c_local, c_global], dim=1))
        item_embs = self.b(self.emb.weight[1:])
        return c @ item_embs.t()   # scores for items 1..n_items


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")  # current device, set just above
    torch.manual_seed(args.seed)

    # one process preprocesses, the others wait and read the finished file
    if rank == 0 and not os.path.exists(args.cache):
        data = preprocess(args.raw)
        tmp = args.cache + f".tmp{os.getpid()}"
        torch.save(data, tmp)
        os.replace(tmp, args.cache)
    dist.barrier()
    data = torch.load(args.cache)
    n_items = data["n_items"]

    train_ds = PrefixData(*data["train"])
    test_ds = PrefixData(*data["test"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True)
    test_dl = DataLoader(test_ds, batch_size=1024, sampler=ContiguousShardSampler(len(test_ds), rank, world),
                         collate_fn=collate, num_workers=2)
    if rank == 0:
        print(f"items {n_items}  train {len(train_ds)}  test {len(test_ds)}  world {world}", flush=True)

    net = NARM(n_items, args.emb, args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=args.lr_step, gamma=0.1)

    best = (0.0, 0.0)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, lens, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            scores = model(x, lens)
            loss = F.cross_entropy(scores, y - 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(tot)

        # evaluation on the unwrapped module: no DDP hooks, no collectives per batch
        net.eval()
        acc = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, lens, y in test_dl:
                x, y = x.to(device), y.to(device) - 1
                topk = net(x, lens).topk(args.topk, dim=1).indices
                hit = topk == y.unsqueeze(1)
                found = hit.any(1)
                acc[0] += found.sum()
                acc[1] += (found.double() / (hit.double().argmax(1) + 1)).sum()
                acc[2] += len(y)
        dist.all_reduce(acc)
        p_at_k, mrr = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(tot[0] / tot[1]).item():.4f} P@{args.topk} {100 * p_at_k:.2f} "
                  f"MRR@{args.topk} {100 * mrr:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if p_at_k > best[0]:
                best = (p_at_k, mrr)
                os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
                torch.save({"model": net.state_dict(), "n_items": n_items, "epoch": epoch}, args.save)

    if rank == 0:
        print(f"best P@{args.topk} {100 * best[0]:.2f} MRR@{args.topk} {100 * best[1]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
