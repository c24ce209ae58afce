#!/usr/bin/env python
"""
Kim-CNN text classifier on AG News, data parallel with explicit all_reduce of
the gradients (one coalesced call per step).

    torchrun --nproc_per_node=4 11_agnews_cnn_allreduce.py --vocab vocab.json \
        --train ag_news/train.jsonl --test ag_news/test.jsonl
"""
import argparse
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9']+")
CLASSES = ["World", "Sports", "Business", "Sci/Tech"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", required=True, help="json token->id, built offline")
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--emb", type=int, default=300)
    ap.add_argument("--filters", type=int, default=256)
    ap.add_argument("--kernels", default="3,4,5")
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--ckpt", default="runs/kimcnn/model.pt")
    return ap.parse_args()


class JsonlText(Dataset):
    def __init__(self, path, vocab, max_len):
        self.rows = []
        unk = vocab["<unk>"]
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                toks = TOKEN_RE.findall((r["title"] + " " + r["description"]).lower())[:max_len]
                ids = [vocab.get(t, unk) for t in toks] or [unk]
                self.rows.append((torch.tensor(ids, dtype=torch.long), int(r["label"])))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, pad_id=0, min_len=5):
    seqs, labels = zip(*batch)
    x = pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    if x.size(1) < min_len:
        x = F.pad(x, (0, min_len - x.size(1)), value=pad_id)
    return x, torch.tensor(labels)


class KimCNN(nn.Module):
    def __init__(self, vocab_size, emb, filters, kernels, n_classes):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(emb, filters, k) for k in kernels])
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(filters * len(kernels), n_classes)

    def forward(self, x):
        e = self.emb(x).transpose(1, 2)
        pooled = [F.relu(c(e)).amax(dim=2) for c in self.convs]
        return self.fc(self.drop(torch.cat(pooled, dim=1)))


def sync_grads(model, world_size):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()


def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            total += y.size(0)
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, total = stats.tolist()
    return loss_sum / total, correct / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.vocab) as f:
        vocab = json.load(f)
    train_ds = JsonlText(args.train, vocab, args.max_len)
    test_ds = JsonlText(args.test, vocab, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=2, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=256, sampler=test_sampler, collate_fn=collate, num_workers=2)

    kernels = [int(k) for k in args.kernels.split(",")]
    model = KimCNN(len(vocab), args.emb, args.filters, kernels, len(CLASSES)).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            sync_grads(model, world)
            optimizer.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)
        sched.step()

        test_loss, test_acc = evaluate(model, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f} acc {test_acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if test_acc > best:
                best = test_acc
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.state_dict(), "vocab_size": len(vocab), "kernels": kernels,
                            "epoch": epoch, "acc": test_acc}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
