"""
Fine-tune a bi-encoder (bge / e5 style) with InfoNCE, in-batch negatives shared
across GPUs plus one mined hard negative per query.

    torchrun --nproc_per_node 8 03_embedding_hardneg_contrastive.py --train_file data/mined.jsonl
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="BAAI/bge-base-en-v1.5")
    p.add_argument("--train_file", required=True)
    p.add_argument("--output_dir", default="out/bge-ft")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=0.02)
    p.add_argument("--q_max_len", type=int, default=64)
    p.add_argument("--p_max_len", type=int, default=256)
    p.add_argument("--query_instruction", default="Represent this sentence for searching relevant passages: ")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


class MinedPairs(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        neg = random.choice(r["neg"]) if r.get("neg") else None
        return r["query"], r["pos"][0], neg


class Collator:
    def __init__(self, tok, args):
        self.tok = tok
        self.args = args

    def __call__(self, batch):
        # drop queries where mining found nothing usable
        batch = [b for b in batch if b[2] is not None and b[2] != b[1]]
        qs = [self.args.query_instruction + q for q, _, _ in batch]
        ps = [p for _, p, _ in batch]
        ns = [n for _, _, n in batch]
        q = self.tok(qs, padding=True, truncation=True, max_length=self.args.q_max_len, return_tensors="pt")
        d = self.tok(ps + ns, padding=True, truncation=True, max_length=self.args.p_max_len, return_tensors="pt")
        return q, d


class BiEncoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)

    def encode(self, feats):
        out = self.enc(**feats).last_hidden_state[:, 0]
        return F.normalize(out, dim=-1)

    def forward(self, q, d):
        return self.encode(q), self.encode(d)


def gather_with_grad(t):
    world = dist.get_world_size()
    bufs = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(bufs, t.detach().contiguous())
    bufs[dist.get_rank()] = t
    return torch.cat(bufs, dim=0)


def contrastive_loss(q, d, temperature):
    # d = [pos(B); neg(B)] per rank
    B = q.shape[0]
    pos, neg = d[:B], d[B:]
    all_q = gather_with_grad(q)
    all_pos = gather_with_grad(pos)
    all_neg = gather_with_grad(neg)
    docs = torch.cat([all_pos, all_neg], dim=0)
    scores = all_q @ docs.t() / temperature
    labels = torch.arange(all_q.shape[0], device=q.device)
    return F.cross_entropy(scores, labels)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    model = BiEncoder(args.model_name).to(device)
    model.enc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    ds = MinedPairs(args.train_file)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=Collator(tok, args),
                    num_workers=4, pin_memory=True, drop_last=True)

    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(total * args.warmup_ratio), total)
    scaler_dtype = torch.bfloat16

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} per-gpu batch={args.batch_size} steps/epoch={len(dl)}")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q, d in dl:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            d = {k: v.to(device, non_blocking=True) for k, v in d.items()}
            with torch.autocast("cuda", dtype=scaler_dtype):
                qe, de = model(q, d)
            loss = contrastive_loss(qe.float(), de.float(), args.temperature) * world
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0:
                l = loss.detach() / world
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time()-t0)/args.log_every:.2f}s/it", flush=True)
                    t0 = time.time()

        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch{epoch}")
            model.module.enc.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
