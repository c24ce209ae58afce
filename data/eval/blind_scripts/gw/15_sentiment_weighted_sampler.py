"""Multi-domain sentiment with one head per dataset (IMDB, Yelp-5, Amazon polarity, SST-5).

The datasets differ in size by two orders of magnitude, so examples are drawn
with per-dataset weights (each dataset gets the same expected share of every
batch). Batches are mixed; each head's loss is masked to its own examples.

    torchrun --nproc_per_node=4 sentiment_mtl.py --data_dir /data/sentiment_arrow
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, WeightedRandomSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

TASKS = [("imdb", 2), ("yelp5", 5), ("amazon_pol", 2), ("sst5", 5)]


class TaggedText(Dataset):
    def __init__(self, hf_split, task_id):
        self.texts = hf_split["text"]
        self.labels = hf_split["label"]
        self.task_id = task_id

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i], self.task_id


def make_collate(tokenizer, max_len):
    def collate(batch):
        texts, labels, tids = zip(*batch)
        enc = tokenizer(list(texts), truncation=True, max_length=max_len, padding="longest", return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(labels), torch.tensor(tids)
    return collate


class SentimentMTL(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        h = self.backbone.config.hidden_size
        self.pool = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Dropout(0.1))
        self.heads = nn.ModuleList([nn.Linear(h, n) for _, n in TASKS])

    def forward(self, ids, mask):
        z = self.pool(self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0])
        return [head(z) for head in self.heads]


def mtl_loss(outs, labels, tids):
    per_task, total = [], 0.0
    for t, logits in enumerate(outs):
        sel = tids == t
        y = labels.masked_fill(~sel, -100)
        n = sel.sum()
        l = F.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum") / n.clamp(min=1)
        per_task.append(l.detach())
        total = total + l
    return total, torch.stack(per_task)


@torch.no_grad()
def evaluate(net, val_sets, collate, device, rank, world):
    net.eval()
    s = torch.zeros(len(TASKS), 2, device=device)
    for t, ds in enumerate(val_sets):
        for ids, mask, y, _ in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128,
                                          collate_fn=collate, num_workers=2):
            pred = net(ids.to(device), mask.to(device))[t].argmax(-1)
            s[t, 0] += (pred == y.to(device)).sum()
            s[t, 1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (s[:, 0] / s[:, 1]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples_per_epoch", type=int, default=600_000)
    ap.add_argument("--out", default="ckpt/sentiment_mtl")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = make_collate(tok, args.max_len)
    train_parts, val_sets = [], []
    for t, (name, _) in enumerate(TASKS):
        d = load_from_disk(os.path.join(args.data_dir, name))
        train_parts.append(TaggedText(d["train"], t))
        val_sets.append(TaggedText(d["test"], t))
    train_all = ConcatDataset(train_parts)

    # every dataset gets the same expected share, whatever its size
    weights = torch.cat([torch.full((len(p),), 1.0 / len(p), dtype=torch.double) for p in train_parts])
    sampler = WeightedRandomSampler(weights, num_samples=args.samples_per_epoch, replacement=True)
    loader = DataLoader(train_all, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)

    net = SentimentMTL(args.model).to(device)
    model = DDP(net, device_ids=[local_rank])
    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in net.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in net.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(params, lr=args.lr)
    total = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(len(TASKS), device=device)
        for step, (ids, mask, y, tids) in enumerate(loader):
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            y, tids = y.to(device, non_blocking=True), tids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                outs = model(ids, mask)
            loss, per_task = mtl_loss(outs, y, tids)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += per_task
            if (step + 1) % 500 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step + 1}/{len(loader)} " +
                          " ".join(f"{n}={v / 500:.4f}" for (n, _), v in zip(TASKS, running.tolist())) +
                          f" {time.time() - t0:.0f}s", flush=True)
                running.zero_()

        accs = evaluate(net, val_sets, collate, device, rank, world)
        mean = sum(accs) / len(accs)
        if rank == 0:
            print(f"epoch {epoch} test " + " ".join(f"{n}={a:.4f}" for (n, _), a in zip(TASKS, accs)) +
                  f" mean={mean:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if mean > best:
                best = mean
                net.backbone.save_pretrained(os.path.join(args.out, "best_backbone"))
                tok.save_pretrained(os.path.join(args.out, "best_backbone"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
