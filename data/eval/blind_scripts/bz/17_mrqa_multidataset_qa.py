#!/usr/bin/env python
# Multi-dataset extractive QA (MRQA 2019 sources) with an answerability head.
#
# Sources differ a lot in size (SQuAD 87k, NewsQA 74k, TriviaQA 62k, SearchQA 117k,
# HotpotQA 73k, NaturalQuestions 104k features after windowing); each source is capped
# at --max_per_source features per epoch and re-sampled every epoch.
#
#   torchrun --nproc_per_node=8 17_mrqa_multidataset_qa.py --features /data/mrqa/features \
#       --output_dir /data/mrqa/runs/roberta_large
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import concatenate_datasets, load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, get_linear_schedule_with_warmup

SOURCES = ["squad", "newsqa", "triviaqa", "searchqa", "hotpotqa", "naturalquestions"]
COLUMNS = ["input_ids", "attention_mask", "start_positions", "end_positions", "answerable"]

logger = logging.getLogger("mrqa")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--features", required=True, help="dir with one load_from_disk dataset per source")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name", default="roberta-large")
    parser.add_argument("--max_per_source", type=int, default=75000)
    parser.add_argument("--per_gpu_batch_size", type=int, default=12)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.5e-5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cls_weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class SpanQA(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.span = nn.Linear(h, 2)
        self.answerable = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 2))

    def forward(self, input_ids, attention_mask):
        hs = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        start, end = self.span(hs).unbind(-1)
        neg = torch.finfo(start.dtype).min
        start = start.masked_fill(attention_mask == 0, neg)
        end = end.masked_fill(attention_mask == 0, neg)
        return start, end, self.answerable(hs[:, 0])


def epoch_subset(sources, cap, seed, epoch):
    """Same indices on every rank: the generator only depends on (seed, epoch)."""
    rng = np.random.default_rng(seed + epoch)
    parts = []
    for ds in sources.values():
        n = min(cap, len(ds))
        parts.append(ds.select(np.sort(rng.choice(len(ds), n, replace=False))))
    return concatenate_datasets(parts)


@torch.no_grad()
def evaluate(net, dev_sets, device, rank, world):
    net.eval()
    out = {}
    for name, ds in dev_sets.items():
        stat = torch.zeros(3, device=device)
        dl = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=64, num_workers=2)
        for b in dl:
            b = {k: v.to(device) for k, v in b.items()}
            s, e, a = net(b["input_ids"], b["attention_mask"])
            span_ok = (s.argmax(-1) == b["start_positions"]) & (e.argmax(-1) == b["end_positions"])
            stat[0] += span_ok.sum()
            stat[1] += (a.argmax(-1) == b["answerable"]).sum()
            stat[2] += s.size(0)
        dist.all_reduce(stat)
        out[name] = {"span_em": (stat[0] / stat[2]).item(), "ans_acc": (stat[1] / stat[2]).item()}
    net.train()
    return out


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(message)s")
    torch.manual_seed(args.seed)

    train_sources, dev_sets = {}, {}
    for s in SOURCES:
        d = load_from_disk(os.path.join(args.features, s))
        train_sources[s] = d["train"]
        dev_sets[s] = d["validation"].with_format("torch", columns=COLUMNS)
        logger.info("%-18s train %7d dev %6d", s, len(d["train"]), len(d["validation"]))

    model = SpanQA(args.model_name).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    steps_per_epoch = sum(min(args.max_per_source, len(d)) for d in train_sources.values())
    steps_per_epoch //= args.per_gpu_batch_size * world * args.grad_accum
    total = steps_per_epoch * args.epochs
    no_decay = ["bias", "LayerNorm.weight"]
    optim = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)], "weight_decay": 0.0},
    ], lr=args.lr)
    sched = get_linear_schedule_with_warmup(optim, int(0.1 * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_set = epoch_subset(train_sources, args.max_per_source, args.seed, epoch).with_format("torch", columns=COLUMNS)
        sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(train_set, batch_size=args.per_gpu_batch_size, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        t0 = time.time()
        model.train()
        optim.zero_grad(set_to_none=True)
        for i, b in enumerate(loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            sync = (i + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                s, e, a = model(b["input_ids"], b["attention_mask"])
                l_span = (F.cross_entropy(s, b["start_positions"]) + F.cross_entropy(e, b["end_positions"])) / 2
                l_cls = F.cross_entropy(a, b["answerable"])
                loss = (l_span + args.cls_weight * l_cls) / args.grad_accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            if rank == 0 and i % 400 == 0:
                logger.info("epoch %d it %d/%d span %.4f cls %.4f lr %.2e", epoch, i, len(loader),
                            l_span.item(), l_cls.item(), sched.get_last_lr()[0])

        res = evaluate(model.module, dev_sets, device, rank, world)
        if rank == 0:
            logger.info("epoch %d (%.0f s) dev %s", epoch, time.time() - t0, res)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "dev": res},
                       os.path.join(args.output_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
