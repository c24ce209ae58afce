#!/usr/bin/env python
# Joint training of topic / emotion / toxicity classifiers on one RoBERTa encoder.
# Every optimisation step takes one batch from each task and sums the weighted losses.
#
#   torchrun --nproc_per_node=8 03_multidomain_text_cls.py --config configs/mt_text.yaml
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

DEFAULT_CFG = {
    "model": "distilroberta-base",
    "max_len": 160,
    "cache_dir": "/scratch/mt_text_cache",
    "out_dir": "runs/mt_text",
    "tasks": {
        "topic": {"train": "data/topic/train.jsonl", "dev": "data/topic/dev.jsonl", "weight": 1.0},
        "emotion": {"train": "data/emotion/train.jsonl", "dev": "data/emotion/dev.jsonl", "weight": 1.0},
        "toxicity": {"train": "data/toxicity/train.jsonl", "dev": "data/toxicity/dev.jsonl", "weight": 0.5},
    },
    "batch_size": 32,
    "lr": 2e-5,
    "epochs": 4,
    "warmup_ratio": 0.06,
    "num_workers": 4,
}


class TensorTextDataset(Dataset):
    def __init__(self, blob):
        self.ids = blob["input_ids"]
        self.mask = blob["attention_mask"]
        self.labels = blob["labels"]

    def __len__(self):
        return self.labels.size(0)

    def __getitem__(self, i):
        return self.ids[i], self.mask[i], self.labels[i]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def label_vocab(path):
    return {lab: i for i, lab in enumerate(sorted({r["label"] for r in read_jsonl(path)}))}


def load_split(task, split, path, tokenizer, max_len, label2id, cache_dir):
    cache_file = os.path.join(cache_dir, f"{task}.{split}.{max_len}.pt")
    if os.path.exists(cache_file):
        return TensorTextDataset(torch.load(cache_file))
    rows = read_jsonl(path)
    enc = tokenizer([r["text"] for r in rows], padding="max_length", truncation=True,
                    max_length=max_len, return_tensors="pt")
    blob = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor([label2id[r["label"]] for r in rows])}
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(blob, cache_file)
    return TensorTextDataset(blob)


class SharedEncoderClassifier(nn.Module):
    def __init__(self, name, n_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({
            t: nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h), nn.Tanh(), nn.Dropout(0.1), nn.Linear(h, n))
            for t, n in n_labels.items()
        })

    def forward(self, batches):
        # batches: {task: (ids, mask)} -> one encoder call over the concatenation
        tasks = list(batches)
        ids = torch.cat([batches[t][0] for t in tasks])
        mask = torch.cat([batches[t][1] for t in tasks])
        cls = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        out, start = {}, 0
        for t in tasks:
            n = batches[t][0].size(0)
            out[t] = self.heads[t](cls[start:start + n])
            start += n
        return out


@torch.no_grad()
def evaluate(model, dev_sets, device, rank, world):
    model.eval()
    metrics = {}
    for task, ds in dev_sets.items():
        shard = Subset(ds, range(rank, len(ds), world))
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for ids, mask, y in DataLoader(shard, batch_size=256):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            pred = model({task: (ids, mask)})[task].argmax(-1)
            counts += torch.stack([(pred == y).sum(), torch.tensor(y.numel(), device=device)]).double()
        dist.all_reduce(counts)
        metrics[task] = (counts[0] / counts[1]).item()
    model.train()
    return metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    train_sets, dev_sets, n_labels = {}, {}, {}
    for task, tc in cfg["tasks"].items():
        l2i = label_vocab(tc["train"])
        n_labels[task] = len(l2i)
        train_sets[task] = load_split(task, "train", tc["train"], tok, cfg["max_len"], l2i, cfg["cache_dir"])
        dev_sets[task] = load_split(task, "dev", tc["dev"], tok, cfg["max_len"], l2i, cfg["cache_dir"])

    samplers = {t: DistributedSampler(ds, shuffle=True, seed=17) for t, ds in train_sets.items()}
    loaders = {t: DataLoader(ds, batch_size=cfg["batch_size"], sampler=samplers[t], drop_last=True,
                             num_workers=cfg["num_workers"], pin_memory=True)
               for t, ds in train_sets.items()}
    # an epoch is one pass over the largest task; smaller tasks are cycled
    steps_per_epoch = max(len(l) for l in loaders.values())
    total_steps = steps_per_epoch * cfg["epochs"]

    model = SharedEncoderClassifier(cfg["model"], n_labels).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(optim, int(cfg["warmup_ratio"] * total_steps), total_steps)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"tasks={n_labels} sizes={ {t: len(d) for t, d in train_sets.items()} } "
              f"steps/epoch={steps_per_epoch}", flush=True)

    passes = {t: 0 for t in loaders}
    its = {}
    for t in loaders:
        samplers[t].set_epoch(0)
        its[t] = iter(loaders[t])

    def draw(t):
        try:
            return next(its[t])
        except StopIteration:
            passes[t] += 1
            samplers[t].set_epoch(passes[t])
            its[t] = iter(loaders[t])
            return next(its[t])

    step = 0
    best = -1.0
    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        for _ in range(steps_per_epoch):
            raw = {t: draw(t) for t in loaders}
            batches = {t: (b[0].to(device, non_blocking=True), b[1].to(device, non_blocking=True))
                       for t, b in raw.items()}
            logits = model(batches)
            losses = {t: F.cross_entropy(logits[t], raw[t][2].to(device)) for t in logits}
            loss = sum(cfg["tasks"][t]["weight"] * l for t, l in losses.items())

            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                parts = " ".join(f"{t}:{l.item():.3f}" for t, l in losses.items())
                print(f"ep {epoch} step {step} loss {loss.item():.4f} [{parts}]", flush=True)

        metrics = evaluate(model.module, dev_sets, device, rank, world)
        score = sum(metrics.values()) / len(metrics)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) dev {metrics} mean {score:.4f}", flush=True)
            if score > best:
                best = score
                torch.save({"model": model.module.state_dict(), "n_labels": n_labels, "cfg": cfg},
                           os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
