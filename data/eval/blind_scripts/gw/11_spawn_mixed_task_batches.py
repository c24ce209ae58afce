"""Mixed-task batches for multi-dataset text classification, launched with mp.spawn.

All datasets are concatenated; a task-balanced sampler draws the task of every
example with temperature-scaled probabilities and shards the draw over ranks,
so one batch holds examples of several tasks. Every head runs on the whole
batch and its loss is masked to the examples of its own task.

    python mixed_batch_mtl.py --data_dir /data/textcls --gpus 4
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, Subset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

TASKS = {"ag_news": 4, "dbpedia": 14, "yahoo": 10, "yelp_full": 5}


class CsvTask(Dataset):
    def __init__(self, path, task_id):
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        self.labels = [int(r[0]) - 1 for r in rows]
        self.texts = [" ".join(r[1:]) for r in rows]
        self.task_id = task_id

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i], self.task_id


class Collate:
    def __init__(self, tokenizer_name, max_len):
        self.tok = AutoTokenizer.from_pretrained(tokenizer_name)
        self.max_len = max_len

    def __call__(self, batch):
        texts, labels, tasks = zip(*batch)
        enc = self.tok(list(texts), truncation=True, max_length=self.max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        enc["task_ids"] = torch.tensor(tasks)
        return enc


class TaskBalancedDistributedSampler(Sampler):
    """Draws `epoch_size` examples: task ~ p_t ∝ n_t^(1/T), example uniform within the task.
    Every rank draws the same global sequence (same seed) and keeps its own stride of it."""

    def __init__(self, sizes, epoch_size, num_replicas, rank, temperature=2.0, seed=0):
        self.sizes = torch.tensor(sizes, dtype=torch.float64)
        self.offsets = torch.cumsum(torch.tensor([0] + list(sizes[:-1])), 0)
        p = self.sizes ** (1.0 / temperature)
        self.p = p / p.sum()
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.total = epoch_size - epoch_size % num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        task = torch.multinomial(self.p, self.total, replacement=True, generator=g)
        within = (torch.rand(self.total, generator=g, dtype=torch.float64) * self.sizes[task]).long()
        idx = self.offsets[task] + within
        return iter(idx[self.rank:self.total:self.num_replicas].tolist())

    def __len__(self):
        return self.total // self.num_replicas


class MultiHeadEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)
        h = self.enc.config.hidden_size
        self.heads = nn.ModuleList([nn.Linear(h, n) for n in TASKS.values()])

    def forward(self, input_ids, attention_mask):
        cls = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return [h(cls) for h in self.heads]


def masked_losses(logits, labels, task_ids):
    out = []
    for t, lg in enumerate(logits):
        m = task_ids == t
        tgt = torch.where(m, labels, torch.full_like(labels, -100))
        out.append(F.cross_entropy(lg.float(), tgt, ignore_index=-100, reduction="sum") / m.sum().clamp(min=1))
    return torch.stack(out)


@torch.no_grad()
def evaluate(net, val_sets, collate, device, rank, world):
    net.eval()
    stats = torch.zeros(len(TASKS), 2, device=device)
    for t, ds in enumerate(val_sets):
        dl = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256, collate_fn=collate, num_workers=2)
        for b in dl:
            b = {k: v.to(device) for k, v in b.items()}
            pred = net(b["input_ids"], b["attention_mask"])[t].argmax(-1)
            stats[t, 0] += (pred == b["labels"]).sum()
            stats[t, 1] += len(pred)
    dist.all_reduce(stats)
    net.train()
    return (stats[:, 0] / stats[:, 1]).tolist()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_parts = [CsvTask(os.path.join(args.data_dir, t, "train.csv"), i) for i, t in enumerate(TASKS)]
    val_sets = [CsvTask(os.path.join(args.data_dir, t, "test.csv"), i) for i, t in enumerate(TASKS)]
    train_all = ConcatDataset(train_parts)
    sampler = TaskBalancedDistributedSampler([len(p) for p in train_parts], args.epoch_size, world_size, rank,
                                             temperature=args.temperature, seed=args.seed)
    collate = Collate(args.model, args.max_len)
    loader = DataLoader(train_all, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    net = MultiHeadEncoder(args.model).to(device)
    # every head runs on every batch (masked loss), so no parameter is ever unused
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)

    start = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(len(TASKS), 2, device=device)
        for step, b in enumerate(loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(b["input_ids"], b["attention_mask"])
            losses = masked_losses(logits, b["labels"], b["task_ids"])
            loss = losses.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

            counts = torch.bincount(b["task_ids"], minlength=len(TASKS)).float()
            acc[:, 0] += losses.detach() * counts
            acc[:, 1] += counts
            if (step + 1) % args.log_every == 0:
                dist.all_reduce(acc)
                if rank == 0:
                    mean = (acc[:, 0] / acc[:, 1].clamp(min=1)).tolist()
                    print(f"ep {epoch} step {step + 1}/{len(loader)} " +
                          " ".join(f"{t}={m:.3f}" for t, m in zip(TASKS, mean)) + f" ({time.time() - tic:.0f}s)",
                          flush=True)
                acc.zero_()

        res = evaluate(net, val_sets, collate, device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} test acc " + " ".join(f"{t}={a:.4f}" for t, a in zip(TASKS, res)), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--model", default="distilroberta-base")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--epoch_size", type=int, default=400000)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--log_every", type=int, default=200)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", default="ckpt/mixed_mtl")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
