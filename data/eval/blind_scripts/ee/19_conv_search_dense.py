"""Conversational dense retrieval (TopiOCQA-style): the query is the current question plus
the reversed dialogue history, passages are wiki chunks. Trained with gold + BM25 hard
negatives, negatives shared over all GPUs. Runs on the preemptible queue, so the full
training state is checkpointed every --ckpt_every steps and restored with --resume.

  torchrun --nproc_per_node=8 19_conv_search_dense.py --data /nfs/convqa/topiocqa \
      --out /nfs/convqa/runs/dense_hist --resume auto
"""
import argparse
import json
import logging
import os
import random
import time

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("convdr")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="facebook/dpr-question_encoder-multiset-base")
    ap.add_argument("--ctx_base", default="facebook/dpr-ctx_encoder-multiset-base")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--hard", type=int, default=1)
    ap.add_argument("--max_turns", type=int, default=6)
    ap.add_argument("--q_len", type=int, default=128)
    ap.add_argument("--p_len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--ckpt_every", type=int, default=2000)
    ap.add_argument("--resume", default=None, help="path, or 'auto' for <out>/state.pt")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def build_query(turn, max_turns):
    hist = turn["history"][::-1][: 2 * max_turns]
    return " [SEP] ".join([turn["question"]] + hist)


class ConvTurns(Dataset):
    def __init__(self, path, max_turns, hard):
        self.turns = [json.loads(l) for l in open(path)]
        self.turns = [t for t in self.turns if t["positive_ctxs"] and t["hard_negative_ctxs"]]
        self.max_turns, self.hard = max_turns, hard

    def __len__(self):
        return len(self.turns)

    def __getitem__(self, i):
        t = self.turns[i]
        pos = t["positive_ctxs"][0]
        negs = random.sample(t["hard_negative_ctxs"], min(self.hard, len(t["hard_negative_ctxs"])))
        while len(negs) < self.hard:
            negs.append(random.choice(t["hard_negative_ctxs"]))
        return build_query(t, self.max_turns), [(p["title"], p["text"]) for p in [pos] + negs]


class DualDPR(nn.Module):
    def __init__(self, q_name, c_name):
        super().__init__()
        self.q_enc = AutoModel.from_pretrained(q_name)
        self.c_enc = AutoModel.from_pretrained(c_name)

    def encode_q(self, b):
        return self.q_enc(**b).pooler_output

    def encode_c(self, b):
        return self.c_enc(**b).pooler_output

    def forward(self, q, c):
        return self.encode_q(q), self.encode_c(c)


def gather_local_grad(x):
    buf = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(buf, x.contiguous())
    buf[dist.get_rank()] = x
    return torch.cat(buf)


@torch.no_grad()
def evaluate(model, q_tok, c_tok, args, device):
    """Dev turns vs the dev passage pool; each rank scores its own share of turns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    pool = [json.loads(l) for l in open(os.path.join(args.data, "dev_pool.jsonl"))]
    p_vecs = []
    for s in range(0, len(pool), 512):
        chunk = pool[s:s + 512]
        b = c_tok([p["title"] for p in chunk], [p["text"] for p in chunk], max_length=args.p_len,
                  truncation="only_second", padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            p_vecs.append(model.encode_c(b).float().cpu())
    index = faiss.IndexFlatIP(p_vecs[0].size(1))
    index.add(torch.cat(p_vecs).numpy())

    dev = [json.loads(l) for l in open(os.path.join(args.data, "dev.jsonl"))][rank::world]
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # R@20, R@100, MRR@10, n
    for s in range(0, len(dev), 256):
        chunk = dev[s:s + 256]
        b = q_tok([build_query(t, args.max_turns) for t in chunk], max_length=args.q_len, truncation=True,
                  padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            qv = model.encode_q(b).float().cpu().numpy()
        _, I = index.search(qv, 100)
        for t, row in zip(chunk, I):
            gold = {p["passage_id"] for p in t["positive_ctxs"]}
            ranked = [pool[j]["passage_id"] for j in row]
            stats[0] += float(bool(gold & set(ranked[:20])))
            stats[1] += float(bool(gold & set(ranked)))
            stats[2] += next((1.0 / (k + 1) for k, pid in enumerate(ranked[:10]) if pid in gold), 0.0)
            stats[3] += 1
    dist.all_reduce(stats)
    model.train()
    n = stats[3].item()
    return {"R@20": stats[0].item() / n, "R@100": stats[1].item() / n, "MRR@10": stats[2].item() / n}


def save_state(path, model, opt, sched, scaler, epoch, step, best):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "best": best}, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    q_tok = AutoTokenizer.from_pretrained(args.base)
    c_tok = AutoTokenizer.from_pretrained(args.ctx_base)
    ds = ConvTurns(os.path.join(args.data, "train.jsonl"), args.max_turns, args.hard)

    def collate(batch):
        q = q_tok([b[0] for b in batch], max_length=args.q_len, truncation=True, padding=True, return_tensors="pt")
        ctx = [p for b in batch for p in b[1]]
        c = c_tok([t for t, _ in ctx], [x for _, x in ctx], max_length=args.p_len, truncation="only_second",
                  padding=True, return_tensors="pt")
        return q, c

    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    model = DDP(DualDPR(args.base, args.ctx_base).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    state_path = os.path.join(args.out, "state.pt")
    start_epoch, step, best = 0, 0, 0.0
    resume = state_path if args.resume == "auto" else args.resume
    if resume and os.path.exists(resume):
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step, best = ckpt["epoch"], ckpt["step"], ckpt["best"]
        del ckpt
        log.info("resumed from %s at epoch %d step %d", resume, start_epoch, step)
    skip = step - start_epoch * len(dl)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    group = 1 + args.hard
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (q, c) in enumerate(dl):
            if skip > 0:
                skip -= 1
                continue
            q, c = q.to(device), c.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                qv, cv = model(q, c)
            qv, cv = gather_local_grad(qv.float()), gather_local_grad(cv.float())
            loss = F.cross_entropy(qv @ cv.t(), torch.arange(qv.size(0), device=device) * group) * world
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f (%.0fs)", epoch, step, loss.item() / world, time.time() - t0)
            if step % args.ckpt_every == 0 and rank == 0:
                save_state(state_path, model, opt, sched, scaler, epoch, step, best)

        metrics = evaluate(model.module, q_tok, c_tok, args, device)
        if rank == 0:
            log.info("epoch %d dev %s", epoch, metrics)
            if metrics["R@20"] > best:
                best = metrics["R@20"]
                model.module.q_enc.save_pretrained(os.path.join(args.out, "best", "question_encoder"))
                model.module.c_enc.save_pretrained(os.path.join(args.out, "best", "ctx_encoder"))
            save_state(state_path, model, opt, sched, scaler, epoch + 1, step, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
