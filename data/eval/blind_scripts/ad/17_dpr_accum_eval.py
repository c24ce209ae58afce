#!/usr/bin/env python3
# DPR training with gradient accumulation and full-corpus dev evaluation.
#
# Dev evaluation encodes the dev passage pool split across all GPUs (the shards have different
# sizes), gathers every embedding and computes top-k retrieval accuracy.
#
#   torchrun --nproc_per_node=8 17_dpr_accum_eval.py --train data/nq-train.json --dev data/nq-dev.json \
#       --accum-steps 2 --out /mnt/shared/dpr_nq_accum
import argparse
import json
import os
import random
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--micro-batch", type=int, default=16, help="questions per GPU per micro step")
    p.add_argument("--accum-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5, help="for a global batch of 128 questions")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=5, help="epochs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_json(path):
    with open(path) as f:
        return [r for r in json.load(f) if r["positive_ctxs"] and r["hard_negative_ctxs"]]


class BiEncoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.q_enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.p_enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode_q(self, q):
        return self.q_enc(**q).last_hidden_state[:, 0]

    def encode_p(self, p):
        return self.p_enc(**p).last_hidden_state[:, 0]

    def forward(self, q, p):
        return self.encode_q(q), self.encode_p(p)


def gather_keep_local_grad(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    parts[dist.get_rank()] = t
    return torch.cat(parts)


@torch.no_grad()
def gather_variable(t):
    """all_gather for tensors whose first dimension differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    padded[: t.size(0)] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def tok_psg(tok, ctxs, device):
    return tok([c["title"] for c in ctxs], [c["text"] for c in ctxs], max_length=256, truncation="only_second",
               padding=True, return_tensors="pt").to(device)


@torch.no_grad()
def dev_topk_accuracy(net, tok, dev, device, ks=(1, 5, 20)):
    """Retrieve from the pool of all dev positives + hard negatives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net.eval()
    pool, key = [], {}
    for r in dev:
        for c in r["positive_ctxs"][:1] + r["hard_negative_ctxs"][:7]:
            k = c.get("passage_id") or c["title"] + c["text"][:64]
            if k not in key:
                key[k] = len(pool)
                pool.append(c)
    gold = [key[r["positive_ctxs"][0].get("passage_id") or r["positive_ctxs"][0]["title"]
                + r["positive_ctxs"][0]["text"][:64]] for r in dev]
    start, end = rank * len(pool) // world, (rank + 1) * len(pool) // world
    local = [net.encode_p(tok_psg(tok, pool[i:min(i + 256, end)], device)) for i in range(start, end, 256)]
    local = torch.cat(local) if local else torch.zeros(0, net.p_enc.config.hidden_size, device=device)
    p_emb = gather_variable(local)
    qs = [r["question"] for r in dev]
    q_emb = torch.cat([net.encode_q(tok(qs[i:i + 512], max_length=64, truncation=True, padding=True,
                                        return_tensors="pt").to(device)) for i in range(0, len(qs), 512)])
    top = (q_emb @ p_emb.t()).topk(max(ks), dim=1).indices
    gold = torch.tensor(gold, device=device).unsqueeze(1)
    net.train()
    return {f"top{k}": (top[:, :k] == gold).any(1).float().mean().item() for k in ks}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train, dev = load_json(args.train), load_json(args.dev)

    def collate(batch):
        qs = [r["question"] for r in batch]
        ctxs = []
        for r in batch:
            ctxs += [random.choice(r["positive_ctxs"]), random.choice(r["hard_negative_ctxs"])]
        q = tok(qs, max_length=64, truncation=True, padding=True, return_tensors="pt")
        p = tok([c["title"] for c in ctxs], [c["text"] for c in ctxs], max_length=256,
                truncation="only_second", padding=True, return_tensors="pt")
        return q, p

    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)

    model = DDP(BiEncoder(args.model).to(device), device_ids=[local_rank])
    global_batch = args.micro_batch * args.accum_steps * world
    lr = args.lr * global_batch / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    updates_per_epoch = len(loader) // args.accum_steps
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, updates_per_epoch * args.epochs)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (q, p) in enumerate(loader):
            if i >= updates_per_epoch * args.accum_steps:
                break
            q, p = q.to(device), p.to(device)
            last_micro = (i + 1) % args.accum_steps == 0
            with (nullcontext() if last_micro else model.no_sync()):
                q_vec, p_vec = model(q, p)
                all_q, all_p = gather_keep_local_grad(q_vec), gather_keep_local_grad(p_vec)
                scores = all_q @ all_p.t()
                target = torch.arange(all_q.size(0), device=device) * 2
                loss = F.cross_entropy(scores, target) / args.accum_steps
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if rank == 0 and (i // args.accum_steps) % 100 == 0:
                    print(f"epoch {epoch} update {i // args.accum_steps}/{updates_per_epoch} "
                          f"loss {loss.item() * args.accum_steps:.4f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            acc = dev_topk_accuracy(model.module, tok, dev, device)
            if rank == 0:
                print(f"epoch {epoch} dev {acc}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "dev": acc},
                           os.path.join(args.out, f"dpr_epoch{epoch}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
