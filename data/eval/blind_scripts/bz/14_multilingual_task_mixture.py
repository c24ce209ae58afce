"""Multilingual multi-task classification from sharded jsonl.gz corpora.

Each task directory holds shards <task>/train-00000.jsonl.gz ...; the shards are
split across ranks and DataLoader workers, and inside a worker the tasks are
interleaved with temperature-scaled probabilities. A batch therefore mixes
tasks; every head runs on the whole batch and each loss is masked to its rows.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        14_multilingual_task_mixture.py --data /lustre/mt_shards --out /lustre/runs/xlmr_mt
"""
import argparse
import glob
import gzip
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

TASKS = {"xnli": 3, "pawsx": 2, "mldoc": 4, "marc": 5, "tweet_sent": 3}


class ShardedMixture(IterableDataset):
    def __init__(self, root, split, rank, world, temperature, seed):
        self.shards = {}
        for t in TASKS:
            files = sorted(glob.glob(os.path.join(root, t, f"{split}-*.jsonl.gz")))
            self.shards[t] = files[rank::world]
        sizes = {t: max(len(f), 1) for t, f in self.shards.items()}
        z = sum(s ** (1 / temperature) for s in sizes.values())
        self.probs = {t: s ** (1 / temperature) / z for t, s in sizes.items()}
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _read(self, files):
        for fn in files:
            with gzip.open(fn, "rt") as f:
                for line in f:
                    yield json.loads(line)

    def __iter__(self):
        wi = get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        rng = random.Random(self.seed * 1000 + self.epoch * 100 + wid)
        streams = {}
        for t, files in self.shards.items():
            mine = files[wid::nw]
            rng.shuffle(mine)
            streams[t] = self._read(mine)
        live = list(streams)
        while live:
            t = rng.choices(live, weights=[self.probs[x] for x in live])[0]
            try:
                ex = next(streams[t])
            except StopIteration:
                live.remove(t)
                continue
            yield t, ex["text"], ex.get("text_pair"), ex["label"]


class Collator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len
        self.task_ids = {t: i for i, t in enumerate(TASKS)}

    def __call__(self, items):
        tasks, text, pair, y = zip(*items)
        pair = [p or "" for p in pair] if any(pair) else None
        enc = self.tok(list(text), pair, truncation=True, max_length=self.max_len,
                       padding=True, return_tensors="pt")
        enc["task"] = torch.tensor([self.task_ids[t] for t in tasks])
        enc["labels"] = torch.tensor(y)
        return enc


class XLMRMultiTask(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.heads = nn.ModuleList([nn.Linear(h, n) for n in TASKS.values()])

    def forward(self, input_ids, attention_mask):
        cls = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return [h(cls) for h in self.heads]


def masked_task_losses(logits, task, labels):
    out = []
    for k, lg in enumerate(logits):
        m = task == k
        out.append(F.cross_entropy(lg[m], labels[m], reduction="sum") / m.sum().clamp(min=1))
    return out


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(len(TASKS), 2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        logits = net(b["input_ids"], b["attention_mask"])
        for k, lg in enumerate(logits):
            m = b["task"] == k
            stats[k, 0] += (lg[m].argmax(-1) == b["labels"][m]).sum()
            stats[k, 1] += m.sum()
    dist.all_reduce(stats)
    net.train()
    return {t: (stats[k, 0] / stats[k, 1].clamp(min=1)).item() for k, t in enumerate(TASKS)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="xlm-roberta-base")
    ap.add_argument("--temperature", type=float, default=3.0)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--est_steps_per_epoch", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = Collator(tok, args.max_len)
    train_ds = ShardedMixture(args.data, "train", rank, world, args.temperature, args.seed)
    dev_ds = ShardedMixture(args.data, "dev", rank, world, 1.0, args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, collate_fn=collate, num_workers=4,
                              pin_memory=True, prefetch_factor=4)
    dev_loader = DataLoader(dev_ds, batch_size=128, collate_fn=collate, num_workers=2)

    model = DDP(XLMRMultiTask(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * args.est_steps_per_epoch
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = model(batch["input_ids"], batch["attention_mask"])
            losses = masked_task_losses(logits, batch["task"], batch["labels"])
            loss = sum(losses)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step < total - 1:
                sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      + " ".join(f"{t}={l.item():.3f}" for t, l in zip(TASKS, losses)), flush=True)

        acc = evaluate(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch} done ({time.time() - t0:.0f}s) dev {acc}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
