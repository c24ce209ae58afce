#!/usr/bin/env python3
# Dense passage retriever (DPR) bi-encoder training with in-batch + cross-rank negatives.
#
#   torchrun --nproc_per_node=8 03_dpr_biencoder.py --train data/nq-train.json \
#       --dev data/nq-dev.json --output_dir out/dpr_nq --resume out/dpr_nq/checkpoint.pt
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--q_len", type=int, default=64)
    p.add_argument("--p_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16, help="questions per GPU")
    p.add_argument("--hard_negatives", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5, help="for 8 GPUs x 16 questions")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warmup_steps", type=int, default=1237)
    p.add_argument("--max_grad_norm", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--resume", default=None)
    return p.parse_args()


class DPRData(Dataset):
    def __init__(self, path, n_hard):
        with open(path) as f:
            raw = json.load(f)
        self.samples = [r for r in raw if r["positive_ctxs"] and len(r["hard_negative_ctxs"]) >= n_hard]
        self.n_hard = n_hard

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


class Collator:
    def __init__(self, tok, q_len, p_len, n_hard, train=True):
        self.tok, self.q_len, self.p_len, self.n_hard, self.train = tok, q_len, p_len, n_hard, train

    def _psg(self, ctx):
        return ctx["title"], ctx["text"]

    def __call__(self, batch):
        questions, titles, texts = [], [], []
        for s in batch:
            questions.append(s["question"])
            pos = random.choice(s["positive_ctxs"]) if self.train else s["positive_ctxs"][0]
            negs = random.sample(s["hard_negative_ctxs"], self.n_hard) if self.train \
                else s["hard_negative_ctxs"][: self.n_hard]
            for c in [pos] + negs:
                t, x = self._psg(c)
                titles.append(t)
                texts.append(x)
        q = self.tok(questions, max_length=self.q_len, truncation=True, padding=True, return_tensors="pt")
        p = self.tok(titles, texts, max_length=self.p_len, truncation="only_second", padding=True,
                     return_tensors="pt")
        return q, p


class BiEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.q_encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.p_encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def forward(self, q, p):
        q_vec = self.q_encoder(**q).last_hidden_state[:, 0]
        p_vec = self.p_encoder(**p).last_hidden_state[:, 0]
        return q_vec, p_vec


def gather_keep_grad(t):
    """all_gather that keeps the autograd graph for this rank's own slice."""
    world = dist.get_world_size()
    if world == 1:
        return t
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.detach().contiguous())
    out[dist.get_rank()] = t
    return torch.cat(out, dim=0)


def biencoder_loss(q_vec, p_vec, n_per_q):
    all_q = gather_keep_grad(q_vec)
    all_p = gather_keep_grad(p_vec)
    scores = all_q @ all_p.t()
    targets = torch.arange(all_q.size(0), device=q_vec.device) * n_per_q
    loss = F.cross_entropy(scores, targets)
    correct = (scores.argmax(1) == targets).sum()
    return loss, correct


def to_dev(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def validate(model, loader, device, n_per_q):
    model.eval()
    stats = torch.zeros(3, device=device)
    for q, p in loader:
        q_vec, p_vec = model(to_dev(q, device), to_dev(p, device))
        loss, correct = biencoder_loss(q_vec, p_vec, n_per_q)
        stats += torch.stack([loss * q_vec.size(0), correct.float(), torch.tensor(q_vec.size(0), device=device,
                                                                                    dtype=torch.float)])
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / (stats[2] * dist.get_world_size())).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, dev_ds = DPRData(args.train, args.hard_negatives), DPRData(args.dev, args.hard_negatives)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          collate_fn=Collator(tok, args.q_len, args.p_len, args.hard_negatives), drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.batch_size, sampler=dev_sampler, num_workers=4, drop_last=True,
                        collate_fn=Collator(tok, args.q_len, args.p_len, args.hard_negatives, train=False))

    model = BiEncoder(args.model).to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-8)
    total_steps = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    start_epoch, best = 0, math.inf
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_loss"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    model = DDP(model, device_ids=[local_rank])
    n_per_q = 1 + args.hard_negatives
    os.makedirs(args.output_dir, exist_ok=True)

    step = start_epoch * len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for q, p in train_dl:
            q_vec, p_vec = model(to_dev(q, device), to_dev(p, device))
            loss, correct = biencoder_loss(q_vec, p_vec, n_per_q)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f in-batch acc %.3f lr %.2e", epoch, step, loss.item(),
                         correct.item() / (q_vec.size(0) * world), scheduler.get_last_lr()[0])

        dev_loss, dev_acc = validate(model, dev_dl, device, n_per_q)
        log.info("epoch %d dev loss %.4f dev acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0:
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "best_loss": min(best, dev_loss)}
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pt"))
            if dev_loss < best:
                torch.save(ckpt, os.path.join(args.output_dir, "best.pt"))
        best = min(best, dev_loss)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
