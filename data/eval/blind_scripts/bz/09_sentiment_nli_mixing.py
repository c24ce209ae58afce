#!/usr/bin/env python
"""Proportional multi-task mixing of sentiment (SST-5, Yelp, IMDB) and NLI (SNLI, MNLI).

Every epoch goes once through every dataset; the order in which batches of the
different datasets are visited is a random permutation (identical on all ranks).

torchrun --nproc_per_node=4 09_sentiment_nli_mixing.py --cfg configs/sent_nli.json
"""
import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_scheduler

logger = logging.getLogger("mix")

DEFAULTS = dict(
    encoder="microsoft/deberta-v3-base",
    data_dir="/data/tokenized",  # produced offline by prepare_data.py
    datasets={"sst5": 5, "yelp": 5, "imdb": 2, "snli": 3, "mnli": 3},
    head_of={"sst5": "sentiment5", "yelp": "sentiment5", "imdb": "sentiment2", "snli": "nli", "mnli": "nli"},
    batch_size=16,
    lr=2e-5,
    epochs=3,
    warmup=0.06,
    seed=13,
    out="runs/sent_nli",
)


class HeadedEncoder(nn.Module):
    def __init__(self, encoder, head_sizes):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder)
        h = self.encoder.config.hidden_size
        self.pool = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h), nn.GELU())
        self.heads = nn.ModuleDict({k: nn.Linear(h, n) for k, n in head_sizes.items()})

    def forward(self, head, input_ids, attention_mask, token_type_ids=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state[:, 0]
        return self.heads[head](self.pool(h))


class MixedSchedule:
    """Yields (dataset_name, batch). One epoch = every loader exhausted once."""

    def __init__(self, loaders, seed):
        self.loaders = loaders
        self.seed = seed

    def __len__(self):
        return sum(len(l) for l in self.loaders.values())

    def epoch(self, epoch):
        names = list(self.loaders)
        order = np.concatenate([np.full(len(self.loaders[n]), i) for i, n in enumerate(names)])
        np.random.RandomState(self.seed + epoch).shuffle(order)
        its = {n: iter(l) for n, l in self.loaders.items()}
        for i in order:
            yield names[i], next(its[names[i]])


def evaluate(model, cfg, dev_sets, collate, device, rank, world):
    model.eval()
    out = {}
    with torch.no_grad():
        for name, ds in dev_sets.items():
            dl = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=64, collate_fn=collate)
            stat = torch.zeros(2, device=device)
            for b in dl:
                b = {k: v.to(device) for k, v in b.items()}
                y = b.pop("labels")
                pred = model(cfg["head_of"][name], **b).argmax(-1)
                stat += torch.tensor([(pred == y).sum().item(), y.numel()], device=device, dtype=torch.float)
            dist.all_reduce(stat)
            out[name] = round((stat[0] / stat[1]).item(), 4)
    model.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULTS)
    a = ap.parse_args()
    if a.cfg:
        cfg.update(json.load(open(a.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(cfg["encoder"])
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sets, dev_sets, loaders = {}, {}, {}
    for name in cfg["datasets"]:
        dsd = load_from_disk(os.path.join(cfg["data_dir"], name))
        keep = ["input_ids", "attention_mask", "labels"]
        train_sets[name] = dsd["train"].with_format("torch", columns=keep)
        dev_sets[name] = dsd["validation"].with_format("torch", columns=keep)
        sampler = DistributedSampler(train_sets[name], shuffle=True, seed=cfg["seed"])
        loaders[name] = DataLoader(train_sets[name], batch_size=cfg["batch_size"], sampler=sampler,
                                   collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
        logger.info("%s: %d train / %d dev", name, len(train_sets[name]), len(dev_sets[name]))
    schedule = MixedSchedule(loaders, cfg["seed"])

    head_sizes = {}
    for name, n in cfg["datasets"].items():
        head_sizes[cfg["head_of"][name]] = n
    model = HeadedEncoder(cfg["encoder"], head_sizes).to(device)
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"], weight_decay=0.01)
    total = len(schedule) * cfg["epochs"]
    sched = get_scheduler("linear", opt, num_warmup_steps=int(cfg["warmup"] * total), num_training_steps=total)

    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
    step = 0
    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        ddp.train()
        for name, batch in schedule.epoch(epoch):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            logits = ddp(cfg["head_of"][name], **batch)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 250 == 0:
                logger.info("epoch %d step %d/%d %s loss %.4f", epoch, step, total, name, loss.item())

        scores = evaluate(model, cfg, dev_sets, collate, device, rank, world)
        logger.info("epoch %d finished in %.0fs dev=%s", epoch, time.time() - t0, scores)
        if rank == 0:
            torch.save({"model": model.state_dict(), "head_sizes": head_sizes, "cfg": cfg, "epoch": epoch},
                       os.path.join(cfg["out"], f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
