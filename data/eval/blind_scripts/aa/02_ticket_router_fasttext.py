"""Support-ticket routing: fastText-style bag-of-ngrams classifier, 2+ nodes.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 --rdzv_id=tickets \
        02_ticket_router_fasttext.py --data /shared/tickets --out /shared/runs/tickets
"""
import argparse
import collections
import datetime
import json
import math
import os
import re
from contextlib import nullcontext

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

TOKEN_RE = re.compile(r"[a-z0-9']+")
PAD, UNK = 0, 1


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train.csv / valid.csv (text,queue)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-vocab", type=int, default=200_000)
    p.add_argument("--min-freq", type=int, default=3)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--dim", type=int, default=200)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def tokenize(text):
    toks = TOKEN_RE.findall(str(text).lower())
    return toks + [a + "_" + b for a, b in zip(toks, toks[1:])]


def build_cache(args, cache_path):
    train = pd.read_csv(os.path.join(args.data, "train.csv"))
    valid = pd.read_csv(os.path.join(args.data, "valid.csv"))
    counter = collections.Counter()
    for t in train["text"]:
        counter.update(tokenize(t))
    # sort by (-count, token) so the vocabulary is the same wherever it is built
    words = sorted((w for w, c in counter.items() if c >= args.min_freq), key=lambda w: (-counter[w], w))
    itos = ["<pad>", "<unk>"] + words[: args.max_vocab]
    stoi = {w: i for i, w in enumerate(itos)}
    classes = sorted(train["queue"].astype(str).unique())
    label2id = {c: i for i, c in enumerate(classes)}

    def encode(df):
        ids = [[stoi.get(w, UNK) for w in tokenize(t)][: args.max_len] or [UNK] for t in df["text"]]
        labels = [label2id.get(str(q), -1) for q in df["queue"]]
        keep = [i for i, y in enumerate(labels) if y >= 0]
        return [ids[i] for i in keep], [labels[i] for i in keep]

    cache = {"itos": itos, "classes": classes, "train": encode(train), "valid": encode(valid)}
    tmp = cache_path + ".tmp"
    torch.save(cache, tmp)
    os.replace(tmp, cache_path)


class EncodedDataset(Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.tensor(self.ids[i]), self.labels[i]


def collate(batch):
    seqs, labels = zip(*batch)
    offsets = torch.tensor([0] + [len(s) for s in seqs[:-1]]).cumsum(0)
    return torch.cat(seqs), offsets, torch.tensor(labels)


class DistributedWeightedSampler(Sampler):
    """Draw num_samples indices with replacement according to weights, then keep this rank's slice.

    Every rank uses the same generator seed (seed + epoch), so all ranks draw the
    identical global sequence and take disjoint strided slices of it.
    """

    def __init__(self, weights, num_replicas, rank, seed=0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.num_samples = math.ceil(len(self.weights) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class BagOfNgrams(nn.Module):
    def __init__(self, vocab_size, dim, n_classes):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab_size, dim, mode="mean", padding_idx=PAD)
        self.fc = nn.Linear(dim, n_classes)

    def forward(self, tokens, offsets):
        return self.fc(F.dropout(self.emb(tokens, offsets), 0.3, self.training))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while building the feature cache while the others wait
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    os.makedirs(args.out, exist_ok=True)
    cache_path = os.path.join(args.out, f"cache_v{args.max_vocab}_f{args.min_freq}_l{args.max_len}.pt")
    if rank == 0 and not os.path.exists(cache_path):
        print(f"building feature cache {cache_path}", flush=True)
        build_cache(args, cache_path)
    dist.barrier()
    cache = torch.load(cache_path)
    n_classes = len(cache["classes"])

    train_ds = EncodedDataset(*cache["train"])
    counts = collections.Counter(train_ds.labels)
    sample_w = [1.0 / counts[y] ** 0.5 for y in train_ds.labels]  # soften the imbalance
    sampler = DistributedWeightedSampler(sample_w, world, rank, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)

    # validation is small: rank 0 scores all of it with the plain module
    valid_ds = EncodedDataset(*cache["valid"])
    valid_loader = DataLoader(valid_ds, batch_size=1024, collate_fn=collate, num_workers=2)

    model = BagOfNgrams(len(cache["itos"]), args.dim, n_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_batch = args.batch_size * args.accum * world
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    steps_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch)

    start_epoch, best_acc = 0, 0.0
    last_ckpt = os.path.join(args.out, "last.pt")
    if os.path.exists(last_ckpt):
        state = torch.load(last_ckpt, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]
        if rank == 0:
            print(f"resumed from epoch {state['epoch']}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for i, (tokens, offsets, y) in enumerate(train_loader):
            if i >= steps_per_epoch * args.accum:
                break
            tokens, offsets, y = tokens.to(device), offsets.to(device), y.to(device)
            sync_now = (i + 1) % args.accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                loss = F.cross_entropy(model(tokens, offsets), y) / args.accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum[0] += loss.detach() * args.accum
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)

        if rank == 0:
            model.module.eval()
            correct = total = 0
            with torch.no_grad():
                for tokens, offsets, y in valid_loader:
                    pred = model.module(tokens.to(device), offsets.to(device)).argmax(1).cpu()
                    correct += (pred == y).sum().item()
                    total += y.numel()
            acc = correct / max(total, 1)
            print(json.dumps({"epoch": epoch, "train_loss": (loss_sum[0] / loss_sum[1]).item(),
                              "valid_acc": acc}), flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "itos": cache["itos"],
                            "classes": cache["classes"]}, os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc},
                       last_ckpt + ".tmp")
            os.replace(last_ckpt + ".tmp", last_ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
