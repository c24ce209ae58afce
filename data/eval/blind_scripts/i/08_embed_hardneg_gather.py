# Text embedding fine-tune: (query, positive, hard negative) with cross-GPU in-batch negatives.
# torchrun --nproc_per_node=8 08_embed_hardneg_gather.py --train data/triplets.jsonl \
#     --corpus data/dev_corpus.jsonl --dev data/dev_queries.jsonl --micro_bsz 32 --accum 4
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="BAAI/bge-base-en-v1.5")
    p.add_argument("--train", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--out", default="ckpt/bge_ft")
    p.add_argument("--micro_bsz", type=int, default=32)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--eval_every", type=int, default=1000)
    return p.parse_args()


class Triplets(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["query"], r["pos"], r.get("neg", "")


class TripletCollator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def _enc(self, texts):
        return self.tok(texts, max_length=self.max_len, truncation=True, padding=True, return_tensors="pt")

    def __call__(self, batch):
        kept = [b for b in batch if b[2] and b[1] != b[2]]
        batch = kept or batch  # never hand back an empty batch
        q, p, n = zip(*batch)
        return self._enc(list(q)), self._enc(list(p)), self._enc([x or y for x, y in zip(n, p)])


class BiEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.05)))

    def embed(self, enc):
        return F.normalize(self.lm(**enc).last_hidden_state[:, 0], dim=-1)

    def forward(self, q, p, n):
        return self.embed(q), self.embed(p), self.embed(n), self.logit_scale.exp().clamp(max=100)


def gather_varlen(x, with_grad):
    """all_gather for tensors whose first dim differs across ranks: pad to the max, gather, strip."""
    n = torch.tensor([x.size(0)], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    pad = max(sizes) - x.size(0)
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    if with_grad:
        parts = dist_fn.all_gather(xp)
    else:
        parts = [torch.empty_like(xp) for _ in sizes]
        dist.all_gather(parts, xp.contiguous())
    return torch.cat([t[:s] for t, s in zip(parts, sizes)]), sizes


def info_nce(q, p, n, scale):
    rank = dist.get_rank()
    all_p, sizes = gather_varlen(p, with_grad=True)
    all_n, _ = gather_varlen(n, with_grad=True)
    offset = sum(sizes[:rank])
    labels = torch.arange(q.size(0), device=q.device) + offset
    logits = scale * q @ torch.cat([all_p, all_n]).T
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def encode_sharded(module, tok, texts, max_len, device, bs=256):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = texts[rank::world]
    out = [module.embed(tok(mine[i:i + bs], max_length=max_len, truncation=True, padding=True,
                            return_tensors="pt").to(device)) for i in range(0, len(mine), bs)]
    local = torch.cat(out).float() if out else torch.zeros(0, module.lm.config.hidden_size, device=device)
    full, sizes = gather_varlen(local, with_grad=False)
    # undo the strided split: rank r's i-th row is global row i*world + r
    order = torch.cat([torch.arange(r, len(texts), world) for r in range(world)])
    emb = torch.empty_like(full)
    emb[order.to(device)] = full
    return emb


def evaluate(model, tok, corpus, dev, args, device):
    module = model.module
    module.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        doc_emb = encode_sharded(module, tok, [d["text"] for d in corpus], args.max_len, device)
        q_emb = encode_sharded(module, tok, [q["query"] for q in dev], 64, device)
    module.train()
    if dist.get_rank() != 0:
        return None
    top = (q_emb.float() @ doc_emb.float().T).topk(10, dim=1).indices.cpu()
    doc_ids = [d["id"] for d in corpus]
    hits = sum(any(doc_ids[j] in q["gold"] for j in row.tolist()) for row, q in zip(top, dev))
    return hits / len(dev)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        wandb.init(project="embed-ft", config=vars(args) | {"world_size": world})

    tok = AutoTokenizer.from_pretrained(args.model)
    model = DDP(BiEncoder(args.model).to(device), device_ids=[local_rank])
    corpus = [json.loads(l) for l in open(args.corpus)]
    dev = [json.loads(l) for l in open(args.dev)]

    ds = Triplets(args.train)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bsz, sampler=sampler, drop_last=True, num_workers=4,
                    collate_fn=TripletCollator(tok, args.max_len), pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(dl) // args.accum * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        micro_batches = len(dl) // args.accum * args.accum
        for i, (q, p, n) in enumerate(dl):
            if i >= micro_batches:
                break
            q, p, n = q.to(device), p.to(device), n.to(device)
            boundary = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not boundary else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    qe, pe, ne, scale = model(q, p, n)
                    loss = info_nce(qe.float(), pe.float(), ne.float(), scale) / args.accum
                loss.backward()
            if not boundary:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "scale": scale.item(), "lr": sched.get_last_lr()[0]}, step=step)

            if step % args.eval_every == 0:
                r10 = evaluate(model, tok, corpus, dev, args, device)
                if rank == 0:
                    wandb.log({"dev/recall@10": r10}, step=step)
                    if r10 > best:
                        best = r10
                        model.module.lm.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.module.lm.save_pretrained(os.path.join(args.out, "last"))
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
