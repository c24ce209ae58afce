"""Session-based next-click prediction on YooChoose 1/64 with a GRU4Rec-style
encoder trained with full softmax cross-entropy. Recall@20 / MRR@20.

torchrun --nnodes=1 --nproc_per_node=4 04_gru4rec_yoochoose.py \
    --clicks /datasets/yoochoose/yoochoose-clicks.dat --cache_dir /datasets/yoochoose/cache
"""
import argparse
import os
import pickle
import time
from collections import Counter, defaultdict
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser(description="GRU4Rec on YooChoose")
    p.add_argument("--clicks", required=True)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--fraction", type=int, default=64, help="use the most recent 1/N of training sessions")
    p.add_argument("--ckpt_dir", default="ckpt/gru4rec_yc64")
    p.add_argument("--emb_dim", type=int, default=100)
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.25)
    p.add_argument("--batch_size", type=int, default=512, help="global batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max_len", type=int, default=19)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def preprocess(clicks_path, fraction):
    sess = defaultdict(list)
    with open(clicks_path) as f:
        for line in f:
            sid, ts, item, _cat = line.rstrip("\n").split(",")
            t = datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S").timestamp()
            sess[int(sid)].append((t, int(item)))
    sess = {s: sorted(v) for s, v in sess.items() if len(v) > 1}
    counts = Counter(it for v in sess.values() for _, it in v)
    sess = {s: [(t, it) for t, it in v if counts[it] >= 5] for s, v in sess.items()}
    sess = {s: v for s, v in sess.items() if len(v) > 1}

    end_time = {s: v[-1][0] for s, v in sess.items()}
    split_time = max(end_time.values()) - 86400
    train_ids = sorted((s for s in sess if end_time[s] < split_time), key=lambda s: end_time[s])
    test_ids = [s for s in sess if end_time[s] >= split_time]
    train_ids = train_ids[-len(train_ids) // fraction:]

    vocab = {}
    for s in train_ids:
        for _, it in sess[s]:
            if it not in vocab:
                vocab[it] = len(vocab) + 1
    train = [[vocab[it] for _, it in sess[s]] for s in train_ids]
    test = [[vocab[it] for _, it in sess[s] if it in vocab] for s in sorted(test_ids)]
    test = [s for s in test if len(s) > 1]
    return {"train": train, "test": test, "num_items": len(vocab)}


def load_or_build(args):
    cache = os.path.join(args.cache_dir, f"yoochoose_1_{args.fraction}.pkl")
    if not os.path.exists(cache):
        data = preprocess(args.clicks, args.fraction)
        os.makedirs(args.cache_dir, exist_ok=True)
        with open(cache, "wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        with open(cache, "rb") as f:
            data = pickle.load(f)
    return data


def augment(sessions, max_len):
    """Every prefix of a session predicts the next click."""
    out = []
    for s in sessions:
        for i in range(1, len(s)):
            out.append((s[max(0, i - max_len):i], s[i]))
    return out


class PrefixDataset(Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]


def collate(batch):
    lens = torch.tensor([len(x) for x, _ in batch])
    seqs = torch.zeros(len(batch), int(lens.max()), dtype=torch.long)
    for i, (x, _) in enumerate(batch):
        seqs[i, : len(x)] = torch.tensor(x)
    targets = torch.tensor([y for _, y in batch])
    return seqs, lens, targets


class GRU4Rec(nn.Module):
    def __init__(self, num_items, emb_dim, hidden, layers, dropout):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, emb_dim, padding_idx=0)
        self.emb_drop = nn.Dropout(dropout)
        self.gru = nn.GRU(emb_dim, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, num_items + 1)

    def forward(self, seqs, lens):
        x = self.emb_drop(self.emb(seqs))
        packed = pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.out(h[-1])


@torch.no_grad()
def evaluate(net, loader, k, device):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)   # recall, mrr, n
    for seqs, lens, targets in loader:
        seqs, targets = seqs.to(device), targets.to(device)
        logits = net(seqs, lens)
        logits[:, 0] = -float("inf")
        topk = logits.topk(k, dim=1).indices
        hit = topk == targets.unsqueeze(1)
        found = hit.any(dim=1)
        pos = hit.float().argmax(dim=1)
        acc[0] += found.double().sum()
        acc[1] += (found.double() / (pos.double() + 1)).sum()
        acc[2] += targets.numel()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    data = load_or_build(args)
    num_items = data["num_items"]
    train_samples = augment(data["train"], args.max_len)
    test_samples = augment(data["test"], args.max_len)
    if rank == 0:
        print(f"items={num_items} train_samples={len(train_samples)} test_samples={len(test_samples)}", flush=True)

    train_ds = PrefixDataset(train_samples)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                              collate_fn=collate, num_workers=args.workers, pin_memory=True)
    # each rank scores a disjoint slice of the test prefixes
    test_ds = Subset(PrefixDataset(test_samples), list(range(rank, len(test_samples), world)))
    test_loader = DataLoader(test_ds, batch_size=1024, shuffle=False, collate_fn=collate, num_workers=2)

    net = GRU4Rec(num_items, args.emb_dim, args.hidden, args.layers, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_recall = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for step, (seqs, lens, targets) in enumerate(train_loader):
            seqs, targets = seqs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = model(seqs, lens)
            loss = F.cross_entropy(logits, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(loss_sum)

        recall, mrr = evaluate(net, test_loader, args.k, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"Recall@{args.k} {recall:.4f} MRR@{args.k} {mrr:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(), "num_items": num_items}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if recall > best_recall:
                best_recall = recall
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
