"""Duplicate-question retrieval (Quora / internal forum) with a MiniLM bi-encoder.

Single node, launched with mp.spawn (the cluster wrapper only runs `python script.py`).
The tokenized training set is cached once by rank 0; global batch grows with the number
of GPUs so the LR is scaled linearly from the single-GPU reference (batch 256, lr 2e-5).

  python 17_quora_dupq_spawn.py --gpus 8 --data data/quora_dup --out runs/quora_minilm
"""
import argparse
import logging
import os
import random
import socket
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import wandb
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

REF_BATCH, REF_LR = 256, 2e-5


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_cache(args, tok):
    pairs = []
    with open(os.path.join(args.data, "train_pairs.tsv")) as f:
        for line in f:
            a, b = line.rstrip("\n").split("\t")
            pairs.append((a, b))
    enc_a = tok([a for a, _ in pairs], max_length=args.max_len, truncation=True)["input_ids"]
    enc_b = tok([b for _, b in pairs], max_length=args.max_len, truncation=True)["input_ids"]
    return {"a": enc_a, "b": enc_b}


class PairSet(Dataset):
    def __init__(self, cache):
        self.a, self.b = cache["a"], cache["b"]

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        # symmetric task: randomly swap which side is the "query"
        return (self.a[i], self.b[i]) if random.random() < 0.5 else (self.b[i], self.a[i])


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def _pad(self, seqs):
        n = max(map(len, seqs))
        ids = torch.full((len(seqs), n), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        return ids, (ids != self.pad_id).long()

    def __call__(self, batch):
        return (*self._pad([x for x, _ in batch]), *self._pad([y for _, y in batch]))


class MiniLM(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def embed(self, ids, mask):
        h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)

    def forward(self, ai, am, bi, bm):
        return self.embed(ai, am), self.embed(bi, bm)


def gather_keep_grad(x):
    xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs)


@torch.no_grad()
def embed_texts(model, tok, texts, max_len, device, bs=512):
    out = []
    for s in range(0, len(texts), bs):
        t = tok(texts[s:s + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        out.append(model.embed(t["input_ids"], t["attention_mask"]))
    return torch.cat(out)


def evaluate(model, tok, args, rank, world, device):
    """BEIR-style Quora dev: queries vs corpus, Recall@10 / MRR@10, queries sharded by rank."""
    model.eval()
    corpus = [l.rstrip("\n").split("\t") for l in open(os.path.join(args.data, "dev_corpus.tsv"))]
    queries = [l.rstrip("\n").split("\t") for l in open(os.path.join(args.data, "dev_queries.tsv"))]
    qrels = {}
    for l in open(os.path.join(args.data, "dev_qrels.tsv")):
        qid, cid = l.split()[:2]
        qrels.setdefault(qid, set()).add(cid)
    c_emb = embed_texts(model, tok, [t for _, t in corpus], args.max_len, device)
    mine = queries[rank::world]
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for s in range(0, len(mine), 512):
        chunk = mine[s:s + 512]
        q_emb = embed_texts(model, tok, [t for _, t in chunk], args.max_len, device)
        top = (q_emb @ c_emb.t()).topk(11, dim=1).indices.tolist()
        for (qid, _), row in zip(chunk, top):
            ranked = [corpus[j][0] for j in row if corpus[j][0] != qid][:10]
            gold = qrels.get(qid, set())
            if not gold:
                continue
            stats[0] += len(gold & set(ranked)) / len(gold)
            stats[1] += next((1.0 / (k + 1) for k, c in enumerate(ranked) if c in gold), 0.0)
            stats[2] += 1
    dist.all_reduce(stats)
    model.train()
    return {"R@10": (stats[0] / stats[2]).item(), "MRR@10": (stats[1] / stats[2]).item()}


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}] %(message)s")
    log = logging.getLogger("quora")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    cache_path = os.path.join(args.data, f"train_cache.{os.path.basename(args.model)}.{args.max_len}.pt")
    if rank == 0 and not os.path.exists(cache_path):
        log.info("building token cache %s", cache_path)
        torch.save(build_cache(args, tok), cache_path + ".tmp")
        os.replace(cache_path + ".tmp", cache_path)
    dist.barrier()
    ds = PairSet(torch.load(cache_path))

    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    dl = DataLoader(ds, batch_size=args.per_gpu_batch, sampler=sampler, collate_fn=PadCollate(tok.pad_token_id),
                    num_workers=4, drop_last=True, pin_memory=True)

    model = DDP(MiniLM(args.model).to(device), device_ids=[rank])
    global_batch = args.per_gpu_batch * world_size
    lr = REF_LR * global_batch / REF_BATCH
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, max(1, int(0.1 * total)), total)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        st = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch = st["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="dupq-retrieval", name=os.path.basename(args.out),
                   config={**vars(args), "global_batch": global_batch, "lr": lr, "world_size": world_size})

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for it, (ai, am, bi, bm) in enumerate(dl):
            ai, am, bi, bm = (t.to(device, non_blocking=True) for t in (ai, am, bi, bm))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                a, b = model(ai, am, bi, bm)
            a, b = gather_keep_grad(a.float()), gather_keep_grad(b.float())
            sim = a @ b.t() * args.scale
            labels = torch.arange(a.size(0), device=device)
            loss = (F.cross_entropy(sim, labels) + F.cross_entropy(sim.t(), labels)) / 2 * world_size
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                wandb.log({"train/loss": loss.item() / world_size, "lr": sched.get_last_lr()[0]},
                          step=epoch * len(dl) + it)

        metrics = evaluate(model.module, tok, args, rank, world_size, device)
        if rank == 0:
            log.info("epoch %d %s", epoch, metrics)
            wandb.log({f"dev/{k}": v for k, v in metrics.items()}, step=(epoch + 1) * len(dl))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
            model.module.enc.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nreimers/MiniLM-L6-H384-uncased")
    ap.add_argument("--per_gpu_batch", type=int, default=128)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
