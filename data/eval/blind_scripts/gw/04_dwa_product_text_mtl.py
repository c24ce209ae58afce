"""Multi-task product understanding: category, review sentiment and query intent,
each from its own corpus, trained jointly on one DeBERTa-v3 encoder.

Task losses are balanced with Dynamic Weight Average (Liu et al., 2019): the
weight of a task follows how fast its loss fell over the last two epochs.

    torchrun --standalone --nproc_per_node=8 train_product_mtl.py --data_dir /mnt/data/product_mtl
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import AutoModel, AutoTokenizer

TASKS = {
    "category": {"file": "catalog_{split}.jsonl", "text": "title", "label": "category_id", "num_labels": 312},
    "sentiment": {"file": "reviews_{split}.jsonl", "text": "review", "label": "stars", "num_labels": 5},
    "intent": {"file": "queries_{split}.jsonl", "text": "query", "label": "intent_id", "num_labels": 47},
}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--model_name", default="microsoft/deberta-v3-small")
    p.add_argument("--max_len", type=int, default=96)
    p.add_argument("--global_batch", type=int, default=768, help="per task, summed over GPUs")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--dwa_temp", type=float, default=2.0)
    p.add_argument("--save_dir", default="ckpt/product_mtl")
    return p.parse_args()


def tokenize_file(path, text_key, label_key, tokenizer, max_len):
    texts, labels = [], []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            texts.append(ex[text_key] or "")
            labels.append(int(ex[label_key]))
    enc = tokenizer(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor(labels, dtype=torch.long)}


def load_task(data_dir, task, split, tokenizer, max_len, model_name):
    spec = TASKS[task]
    cache_dir = os.path.join(data_dir, "cache")
    os.makedirs(cache_dir, exist_ok=True)
    cache = os.path.join(cache_dir, f"{task}_{split}_{model_name.replace('/', '_')}_{max_len}.pt")
    if os.path.exists(cache):
        tensors = torch.load(cache)
    else:
        src = os.path.join(data_dir, spec["file"].format(split=split))
        tensors = tokenize_file(src, spec["text"], spec["label"], tokenizer, max_len)
        torch.save(tensors, cache)
    return TensorDataset(tensors["input_ids"], tensors["attention_mask"], tensors["labels"])


class ProductMTL(nn.Module):
    def __init__(self, model_name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(model_name)
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.1), nn.Linear(h, s["num_labels"]))
                                    for t, s in TASKS.items()})

    def encode(self, ids, mask):
        hid = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hid.dtype)
        return (hid * m).sum(1) / m.sum(1).clamp(min=1.0)

    def forward(self, batch):
        # batch: task -> (ids, mask); encode all tasks in one pass
        sizes = [batch[t][0].size(0) for t in TASKS]
        ids = torch.cat([batch[t][0] for t in TASKS])
        mask = torch.cat([batch[t][1] for t in TASKS])
        pooled = self.encode(ids, mask).split(sizes)
        return {t: self.heads[t](p) for t, p in zip(TASKS, pooled)}


def dwa_weights(history, temp, n):
    if len(history) < 2:
        return [1.0] * n
    r = [history[-1][i] / max(history[-2][i], 1e-8) for i in range(n)]
    e = [math.exp(x / temp) for x in r]
    return [n * x / sum(e) for x in e]


@torch.no_grad()
def evaluate(model, val_sets, device, rank, world):
    model.eval()
    out = {}
    for t, ds in val_sets.items():
        idx = list(range(rank, len(ds), world))
        loader = DataLoader(torch.utils.data.Subset(ds, idx), batch_size=256)
        c = torch.zeros(2, device=device)
        for ids, mask, y in loader:
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            pred = model.heads[t](model.encode(ids, mask)).argmax(-1)
            c[0] += (pred == y).sum()
            c[1] += y.numel()
        dist.all_reduce(c)
        out[t] = (c[0] / c[1]).item()
    model.train()
    return out


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_sets = {t: load_task(args.data_dir, t, "train", tokenizer, args.max_len, args.model_name) for t in TASKS}
    val_sets = {t: load_task(args.data_dir, t, "dev", tokenizer, args.max_len, args.model_name) for t in TASKS}

    per_gpu = args.global_batch // world
    samplers = {t: DistributedSampler(ds, shuffle=True, drop_last=True) for t, ds in train_sets.items()}
    loaders = {t: DataLoader(ds, batch_size=per_gpu, sampler=samplers[t], num_workers=4,
                             pin_memory=True, drop_last=True) for t, ds in train_sets.items()}
    steps = min(len(l) for l in loaders.values())

    model = DDP(ProductMTL(args.model_name).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps * args.epochs,
                                                pct_start=0.1, anneal_strategy="linear")

    history = []
    names = list(TASKS)
    for epoch in range(args.epochs):
        for s in samplers.values():
            s.set_epoch(epoch)
        w = dwa_weights(history, args.dwa_temp, len(names))
        epoch_loss = torch.zeros(len(names), device=device)
        t0 = time.time()
        for step, batches in enumerate(zip(*(loaders[t] for t in names))):
            if step >= steps:
                break
            inputs = {t: (b[0].to(device, non_blocking=True), b[1].to(device, non_blocking=True))
                      for t, b in zip(names, batches)}
            labels = {t: b[2].to(device, non_blocking=True) for t, b in zip(names, batches)}
            logits = model(inputs)
            losses = torch.stack([F.cross_entropy(logits[t], labels[t]) for t in names])
            loss = sum(w[i] * losses[i] for i in range(len(names)))

            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            epoch_loss += losses.detach()

            if step % 200 == 0:
                cur = losses.detach().clone()
                dist.all_reduce(cur, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[ep {epoch} {step}/{steps}] " +
                          " ".join(f"{t}:{l:.3f}(w={wi:.2f})" for t, l, wi in zip(names, cur.tolist(), w)),
                          flush=True)

        # DWA needs the same epoch losses on every rank
        dist.all_reduce(epoch_loss)
        history.append((epoch_loss / (steps * world)).tolist())

        acc = evaluate(model.module, val_sets, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s val {acc}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "history": history, "epoch": epoch},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
