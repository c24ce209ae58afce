# Bi-encoder training for NQ open (DPR recipe): 1 positive + 1 hard negative per question,
# in-batch negatives gathered from all GPUs. Validation = average rank of the gold context
# among all contexts of the dev set (like DPR's validate_average_rank), so no index needed.
#
#   torchrun --nproc_per_node=8 03_nq_dpr_avg_rank.py \
#       --train nq-train.json --dev nq-dev.json --out ckpt/nq_dpr
import argparse
import json
import logging
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, BertModel, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


class NQRetrievalData(Dataset):
    """DPR json: [{question, positive_ctxs, hard_negative_ctxs, negative_ctxs}, ...]"""

    def __init__(self, path, train=True):
        with open(path) as f:
            data = json.load(f)
        self.samples = [d for d in data if d["positive_ctxs"]]
        if train:
            self.samples = [d for d in self.samples if d["hard_negative_ctxs"] or d["negative_ctxs"]]
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        d = self.samples[i]
        q = d["question"].replace("’", "'")
        if self.train:
            pos = random.choice(d["positive_ctxs"])
            negs = d["hard_negative_ctxs"] or d["negative_ctxs"]
            neg = random.choice(negs)
        else:
            pos = d["positive_ctxs"][0]
            neg = (d["hard_negative_ctxs"] or d["negative_ctxs"] or d["positive_ctxs"])[0]
        return q, (pos["title"], pos["text"]), (neg["title"], neg["text"])


def make_collate(tokenizer, q_len, c_len):
    def collate(batch):
        qs = [b[0] for b in batch]
        titles, texts = [], []
        for _, pos, neg in batch:
            for t, x in (pos, neg):
                titles.append(t)
                texts.append(x)
        q = tokenizer(qs, max_length=q_len, padding="max_length", truncation=True, return_tensors="pt")
        c = tokenizer(titles, texts, max_length=c_len, padding="max_length", truncation="only_second",
                      return_tensors="pt")
        return q, c
    return collate


class BiEncoder(nn.Module):
    def __init__(self, name, dropout=0.1):
        super().__init__()
        self.question_model = BertModel.from_pretrained(name, add_pooling_layer=False,
                                                        hidden_dropout_prob=dropout)
        self.ctx_model = BertModel.from_pretrained(name, add_pooling_layer=False, hidden_dropout_prob=dropout)

    def forward(self, q, c):
        q_vec = self.question_model(**q).last_hidden_state[:, 0, :]
        c_vec = self.ctx_model(**c).last_hidden_state[:, 0, :]
        return q_vec, c_vec


def gather_tensor(t, keep_grad=True):
    world = dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    if keep_grad:
        parts[dist.get_rank()] = t
    return torch.cat(parts, 0)


def nll_loss(q_vec, c_vec):
    # each question i owns contexts 2i (positive) and 2i+1 (hard negative)
    scores = q_vec @ c_vec.t()
    target = torch.arange(0, c_vec.size(0), 2, device=q_vec.device)
    loss = F.cross_entropy(scores, target)
    correct = (scores.argmax(1) == target).sum()
    return loss, correct


@torch.no_grad()
def validate_average_rank(model, loader, device):
    model.eval()
    q_all, c_all = [], []
    for q, c in loader:
        q = {k: v.to(device) for k, v in q.items()}
        c = {k: v.to(device) for k, v in c.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            q_vec, c_vec = model(q, c)
        q_all.append(gather_tensor(q_vec.float(), keep_grad=False))
        c_all.append(gather_tensor(c_vec.float(), keep_grad=False))
    q_all = torch.cat(q_all)
    c_all = torch.cat(c_all)
    # positives sit at even offsets in c_all, hard negatives at odd
    gold = torch.arange(0, c_all.size(0), 2, device=device)
    ranks = []
    for s in range(0, q_all.size(0), 1024):
        sc = q_all[s:s + 1024] @ c_all.t()
        g = gold[s:s + 1024]
        gold_scores = sc.gather(1, g.unsqueeze(1))
        ranks.append((sc > gold_scores).sum(1).float())
    model.train()
    return torch.cat(ranks).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--batch_size", type=int, default=16, help="questions per GPU")
    ap.add_argument("--dev_batch_size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup_steps", type=int, default=1237)
    ap.add_argument("--q_len", type=int, default=64)
    ap.add_argument("--c_len", type=int, default=256)
    ap.add_argument("--max_grad_norm", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--eval_every_epochs", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = make_collate(tokenizer, args.q_len, args.c_len)

    train_set = NQRetrievalData(args.train, train=True)
    dev_set = NQRetrievalData(args.dev, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    # avg-rank is a relative number; dropping < world dev questions keeps shards equal without duplicates
    dev_sampler = DistributedSampler(dev_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=args.dev_batch_size, sampler=dev_sampler,
                            collate_fn=collate, num_workers=2)

    model = BiEncoder(args.model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    total_updates = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)
    scaler = torch.cuda.amp.GradScaler()

    best_rank = float("inf")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("train=%d dev=%d world=%d updates=%d", len(train_set), len(dev_set), world, total_updates)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        seen, correct_total, loss_total = 0, 0, 0.0
        for q, c in train_loader:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            c = {k: v.to(device, non_blocking=True) for k, v in c.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                q_vec, c_vec = model(q, c)
            q_glob = gather_tensor(q_vec.float())
            c_glob = gather_tensor(c_vec.float())
            loss, correct = nll_loss(q_glob, c_glob)
            loss = loss * world

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            step += 1
            seen += q_glob.size(0)
            correct_total += correct.item()
            loss_total += loss.item() / world
            if step % 100 == 0:
                logger.info("ep %d step %d loss %.4f acc %.3f lr %.2e (%.0fs)", epoch, step,
                            loss_total / 100, correct_total / max(seen, 1), scheduler.get_last_lr()[0],
                            time.time() - t0)
                seen, correct_total, loss_total = 0, 0, 0.0

        if (epoch + 1) % args.eval_every_epochs == 0:
            avg_rank = validate_average_rank(model, dev_loader, device)
            logger.info("epoch %d dev average rank %.2f", epoch, avg_rank)
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch,
                    "avg_rank": avg_rank,
                }
                torch.save(state, os.path.join(args.out, f"dpr_biencoder.{epoch}.pt"))
                if avg_rank < best_rank:
                    best_rank = avg_rank
                    torch.save(state, os.path.join(args.out, "dpr_biencoder.best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
