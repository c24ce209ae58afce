"""Multi-objective reward model: one shared encoder, one scalar head per preference source
(helpfulness / harmlessness / honesty). Each pair only trains the head of its own source.

Started with mp.spawn (one process per visible GPU) rather than torchrun:

    python 17_rm_multihead_spawn.py --data data/multiobj_pairs.jsonl --out ckpt/rm_multihead
"""
import argparse
import json
import os
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

SOURCES = ["helpful", "harmless", "honest"]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MultiHeadRM(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)
        d = self.enc.config.hidden_size
        self.heads = nn.ModuleList([nn.Linear(d, 1) for _ in SOURCES])

    def forward(self, input_ids, attention_mask, src):
        cls = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        out = torch.zeros(cls.size(0), device=cls.device, dtype=cls.dtype)
        # only the heads of sources present in this batch take part in the graph
        for k in src.unique().tolist():
            sel = src == k
            out[sel] = self.heads[k](cls[sel]).squeeze(-1)
        return out


class Pairs(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        c = self.tok(r["prompt"], r["chosen"], truncation="only_second", max_length=self.max_len)["input_ids"]
        j = self.tok(r["prompt"], r["rejected"], truncation="only_second", max_length=self.max_len)["input_ids"]
        return c, j, SOURCES.index(r["source"])


def make_collate(pad_id):
    def collate(batch):
        seqs = [b[0] for b in batch] + [b[1] for b in batch]
        src = torch.tensor([b[2] for b in batch] * 2)
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            att[i, :len(s)] = 1
        return ids, att, src
    return collate


def worker(rank, world_size, args):
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    with open(args.data) as f:
        rows = [json.loads(l) for l in f]
    rows = [r for r in rows if r["source"] in SOURCES]
    rng = random.Random(args.seed)  # same shuffle and split on every rank
    rng.shuffle(rows)
    n_val = max(world_size, int(0.02 * len(rows)))
    val_rows, train_rows = rows[:n_val], rows[n_val:]

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = make_collate(tok.pad_token_id)
    train_ds = Pairs(train_rows, tok, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=2,
                        drop_last=True)
    val_loader = DataLoader(Pairs(val_rows[rank::world_size], tok, args.max_len), batch_size=args.bsz * 2,
                            collate_fn=collate)

    model = MultiHeadRM(args.model).to(device)
    ddp = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world_size} procs, {len(train_rows)} train / {len(val_rows)} val pairs, {total} steps", flush=True)

    t0 = time.time()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for ids, att, src in loader:
            ids, att, src = ids.to(device), att.to(device), src.to(device)
            r = ddp(ids, att, src)
            rc, rr = r.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} {time.time() - t0:.0f}s", flush=True)

        # per-source pairwise accuracy, summed over all ranks
        model.eval()
        hits = torch.zeros(len(SOURCES), 2, device=device)
        with torch.no_grad():
            for ids, att, src in val_loader:
                r = model(ids.to(device), att.to(device), src.to(device))
                rc, rr = r.chunk(2)
                s = src[: rc.size(0)].to(device)
                for k in range(len(SOURCES)):
                    sel = s == k
                    hits[k, 0] += (rc[sel] > rr[sel]).sum()
                    hits[k, 1] += sel.sum()
        dist.all_reduce(hits)
        if rank == 0:
            msg = " ".join(f"{n}={(hits[k, 0] / hits[k, 1].clamp_min(1)).item():.3f}" for k, n in enumerate(SOURCES))
            print(f"epoch {epoch} val acc: {msg}", flush=True)
            torch.save({"model": model.state_dict(), "sources": SOURCES, "epoch": epoch},
                       os.path.join(args.out, f"rm_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/rm_multihead")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--bsz", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
