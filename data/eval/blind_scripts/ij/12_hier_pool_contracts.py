"""Hierarchical attention pooling for commercial-contract risk rating (5 levels).

chunks (<=48 x 510 tokens) -> RoBERTa-base [CLS] -> gated attention pooling -> ordinal head

    torchrun --nproc_per_node=8 12_hier_pool_contracts.py --data_dir /shared/contracts \
        --cache_dir /shared/contracts/.cache --out_dir /shared/runs/contract_risk --grad_accum 4
"""
import argparse
import json
import logging
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("contract_risk")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--encoder", default="roberta-base")
    ap.add_argument("--chunk_tokens", type=int, default=510)
    ap.add_argument("--max_chunks", type=int, default=48)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def tokenize_split(path, tok, chunk_tokens, max_chunks):
    out = []
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            ids = tok(doc["text"], add_special_tokens=False)["input_ids"]
            chunks = [tok.build_inputs_with_special_tokens(ids[i:i + chunk_tokens])
                      for i in range(0, max(len(ids), 1), chunk_tokens)][:max_chunks]
            out.append({"chunks": chunks, "label": int(doc["risk_level"]) - 1})
    return out


def cached_split(split, args, tok, rank):
    path = os.path.join(args.cache_dir, f"{split}.{args.encoder.replace('/', '_')}.{args.chunk_tokens}x{args.max_chunks}.pt")
    if rank == 0 and not os.path.exists(path):
        os.makedirs(args.cache_dir, exist_ok=True)
        feats = tokenize_split(os.path.join(args.data_dir, f"{split}.jsonl"), tok,
                               args.chunk_tokens, args.max_chunks)
        tmp = path + ".tmp"
        torch.save(feats, tmp)
        os.replace(tmp, path)
    dist.barrier()
    return torch.load(path)


class Docs(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i]


def collate(batch, pad_id=1):
    C = max(len(b["chunks"]) for b in batch)
    L = max(len(c) for b in batch for c in b["chunks"])
    ids = torch.full((len(batch), C, L), pad_id, dtype=torch.long)
    cmask = torch.zeros(len(batch), C, dtype=torch.bool)
    for i, b in enumerate(batch):
        for j, c in enumerate(b["chunks"]):
            ids[i, j, :len(c)] = torch.tensor(c)
            cmask[i, j] = True
    return ids, (ids != pad_id).long(), cmask, torch.tensor([b["label"] for b in batch])


class EvalSampler(Sampler):
    def __init__(self, n, rank, world):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class GatedAttentionPool(nn.Module):
    def __init__(self, d, h=256):
        super().__init__()
        self.v = nn.Linear(d, h)
        self.u = nn.Linear(d, h)
        self.w = nn.Linear(h, 1)

    def forward(self, x, mask):
        a = self.w(torch.tanh(self.v(x)) * torch.sigmoid(self.u(x))).squeeze(-1)
        a = a.masked_fill(~mask, torch.finfo(a.dtype).min)
        return torch.einsum("bc,bcd->bd", a.softmax(-1), x)


class HierRisk(nn.Module):
    def __init__(self, encoder, n_levels=5):
        super().__init__()
        self.enc = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        self.enc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        d = self.enc.config.hidden_size
        self.pool = GatedAttentionPool(d)
        # ordinal regression: n_levels - 1 cumulative logits
        self.head = nn.Linear(d, n_levels - 1)

    def forward(self, ids, attn, cmask):
        B, C, L = ids.shape
        cls = self.enc(input_ids=ids[cmask], attention_mask=attn[cmask]).last_hidden_state[:, 0]
        x = cls.new_zeros(B, C, cls.size(-1))
        x[cmask] = cls
        return self.head(self.pool(x, cmask))


def ordinal_loss(logits, y):
    k = torch.arange(logits.size(1), device=y.device)
    target = (y.unsqueeze(1) > k).float()
    return F.binary_cross_entropy_with_logits(logits, target)


def ordinal_predict(logits):
    return (logits.sigmoid() > 0.5).sum(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)  # exact, within-one, count
    for ids, attn, cmask, y in loader:
        ids, attn, cmask, y = ids.to(device), attn.to(device), cmask.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = ordinal_predict(model(ids, attn, cmask).float())
        s[0] += (pred == y).sum()
        s[1] += ((pred - y).abs() <= 1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return {"acc": (s[0] / s[2]).item(), "acc_within_1": (s[1] / s[2]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(11)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    train = Docs(cached_split("train", args, tok, rank))
    dev = Docs(cached_split("dev", args, tok, rank))
    pad = lambda b: collate(b, tok.pad_token_id)
    sampler = DistributedSampler(train, shuffle=True, seed=11, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=pad,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev, batch_size=4, sampler=EvalSampler(len(dev), rank, world), collate_fn=pad,
                        num_workers=4)

    model = HierRisk(args.encoder).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_dl) // args.grad_accum
    sched = get_linear_schedule_with_warmup(opt, updates_per_epoch // 2, updates_per_epoch * args.epochs)

    ckpt_path = os.path.join(args.out_dir, "last.pt")
    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        logger.info("resumed from epoch %d", ckpt["epoch"])

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        for i, (ids, attn, cmask, y) in enumerate(train_dl):
            ids, attn = ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
            cmask, y = cmask.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % args.grad_accum == 0
            # skip the gradient all-reduce on the accumulation micro-steps
            with (nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids, attn, cmask)
                loss = ordinal_loss(logits.float(), y) / args.grad_accum
                loss.backward()
            if boundary:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if i % 200 == 0:
                logger.info("ep %d it %d/%d loss %.4f (%.0fs)", epoch, i, len(train_dl),
                            loss.item() * args.grad_accum, time.time() - t0)

        metrics = evaluate(model.module, dev_dl, device)
        logger.info("epoch %d dev %s", epoch, metrics)
        if rank == 0:
            if metrics["acc"] > best:
                best = metrics["acc"]
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
