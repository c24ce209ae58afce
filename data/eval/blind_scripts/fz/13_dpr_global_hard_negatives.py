"""Dense passage retrieval with hard negatives mined from the *global* batch.

Passage embeddings of all GPUs are gathered with the autograd-aware all_gather,
so every query is scored against world_size * batch passages. Instead of a full
softmax over them we keep the positive and the `--hard-k` highest-scoring
negatives (online hard negative mining), with a temperature-scaled InfoNCE.

Single node, one process per GPU, started with mp.spawn:
    python 13_dpr_global_hard_negatives.py --train data/nq_train.jsonl --dev data/nq_dev.jsonl
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


class PairDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pos = r["positive_ctxs"][0]
        return r["question"], pos.get("title", "") + " " + pos["text"]


class Collator:
    def __init__(self, tokenizer, q_len, p_len):
        self.tok, self.q_len, self.p_len = tokenizer, q_len, p_len

    def __call__(self, batch):
        qs, ps = zip(*batch)
        q = self.tok(list(qs), padding=True, truncation=True, max_length=self.q_len, return_tensors="pt")
        p = self.tok(list(ps), padding=True, truncation=True, max_length=self.p_len, return_tensors="pt")
        return q, p


class BiEncoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        # CLS vectors are used directly; without the pooler no parameter is left without a gradient
        self.q_enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.p_enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def forward(self, q, p):
        qv = self.q_enc(**q).last_hidden_state[:, 0]
        pv = self.p_enc(**p).last_hidden_state[:, 0]
        return qv, pv


def hard_negative_infonce(qv, pv_all, pos_offset, hard_k, tau):
    """qv: [B, d] local queries; pv_all: [W*B, d] passages of every rank.
    The positive of local query i sits at pv_all[pos_offset + i]."""
    scores = qv @ pv_all.t() / tau                      # [B, W*B]
    b = qv.size(0)
    pos_idx = torch.arange(b, device=qv.device) + pos_offset
    pos = scores.gather(1, pos_idx[:, None])            # [B, 1]
    neg = scores.scatter(1, pos_idx[:, None], float("-inf"))
    k = min(hard_k, neg.size(1) - 1)
    hard = neg.topk(k, dim=1).values                    # hardest negatives per query
    logits = torch.cat([pos, hard], dim=1)
    target = torch.zeros(b, dtype=torch.long, device=qv.device)
    return F.cross_entropy(logits, target), (logits.argmax(1) == 0).float().mean()


def run(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = Collator(tok, args.q_len, args.p_len)
    train_set, dev_set = PairDataset(args.train), PairDataset(args.dev)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_set, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    # drop_last keeps every rank's batch the same size, which the all_gather below needs
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, drop_last=True, pin_memory=True)
    dev_loader = DataLoader(dev_set, batch_size=args.batch_size, sampler=dev_sampler, collate_fn=collate,
                            num_workers=2, drop_last=True)

    model = DDP(BiEncoder(args.model).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (q, p) in enumerate(train_loader):
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qv, pv = model(q, p)
            pv_all = torch.cat(dist_fn.all_gather(pv.float()), dim=0)
            loss, acc = hard_negative_infonce(qv.float(), pv_all, rank * qv.size(0), args.hard_k, args.tau)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                s = torch.stack([loss.detach(), acc])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{len(train_loader)} loss {s[0]:.4f} top1 {s[1]:.3f}", flush=True)

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for q, p in dev_loader:
                q = {k: v.to(device) for k, v in q.items()}
                p = {k: v.to(device) for k, v in p.items()}
                qv, pv = model.module(q, p)
                pv_all = torch.cat(dist_fn.all_gather(pv.float()), dim=0)
                loss, acc = hard_negative_infonce(qv.float(), pv_all, rank * qv.size(0), args.hard_k, args.tau)
                tot += torch.stack([loss * qv.size(0), acc * qv.size(0), torch.tensor(float(qv.size(0)), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} dev loss {tot[0] / tot[2]:.4f} dev top1 {tot[1] / tot[2]:.4f}", flush=True)
            out = os.path.join(args.out, f"epoch_{epoch}")
            os.makedirs(out, exist_ok=True)
            model.module.q_enc.save_pretrained(os.path.join(out, "query_encoder"))
            model.module.p_enc.save_pretrained(os.path.join(out, "passage_encoder"))
            tok.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--q-len", type=int, default=32)
    ap.add_argument("--p-len", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--hard-k", type=int, default=31)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", default="checkpoints/dpr_hardneg")
    ap.add_argument("--port", default="29511")
    ap.add_argument("--seed", type=int, default=12345)
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    world_size = torch.cuda.device_count()
    mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)
