"""BERT4Rec on MovieLens-20M.

Cloze training objective, evaluation on the last item of every user against
100 popularity-sampled negatives (as in Sun et al., 2019).

    torchrun --standalone --nproc_per_node=8 05_bert4rec_ml20m.py --data data/ml-20m/ratings.csv
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

logger = logging.getLogger("bert4rec")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/ml-20m/ratings.csv")
    p.add_argument("--output_dir", default="outputs/bert4rec_ml20m")
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--mask_prob", type=float, default=0.15)
    p.add_argument("--per_device_batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=200_000)
    p.add_argument("--eval_steps", type=int, default=10_000)
    p.add_argument("--num_negatives", type=int, default=100)
    p.add_argument("--seed", type=int, default=98765)
    return p


def load_sequences(path):
    df = pd.read_csv(path, usecols=["userId", "movieId", "timestamp"])
    df = df.sort_values(["userId", "timestamp", "movieId"], kind="mergesort")
    codes, uniques = pd.factorize(df["movieId"], sort=True)
    df["item"] = codes + 1
    seqs = df.groupby("userId", sort=True)["item"].agg(list).tolist()
    pop = np.bincount(df["item"].to_numpy(), minlength=len(uniques) + 1).astype(np.float64)
    return seqs, len(uniques), pop


class MaskedSeqDataset(Dataset):
    def __init__(self, seqs, num_items, max_len, mask_prob):
        self.seqs = seqs
        self.num_items = num_items
        self.mask_id = num_items + 1
        self.max_len = max_len
        self.mask_prob = mask_prob

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i][:-1]  # last item held out for test
        if len(seq) > self.max_len:
            start = random.randint(0, len(seq) - self.max_len)
            seq = seq[start:start + self.max_len]
        tokens = np.array(seq, dtype=np.int64)
        labels = np.zeros_like(tokens)
        m = np.random.rand(len(tokens)) < self.mask_prob
        if not m.any():
            m[np.random.randint(len(tokens))] = True
        labels[m] = tokens[m]
        tokens[m] = self.mask_id
        pad = self.max_len - len(tokens)
        tokens = np.pad(tokens, (pad, 0))
        labels = np.pad(labels, (pad, 0))
        return torch.from_numpy(tokens), torch.from_numpy(labels)


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, d_model, n_layers, n_heads, dropout):
        super().__init__()
        self.embed = nn.Embedding(num_items + 2, d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.ln = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           activation="gelu", batch_first=True, norm_first=False)
        self.blocks = nn.TransformerEncoder(block, n_layers)
        self.transform = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.out_bias = nn.Parameter(torch.zeros(num_items + 1))

    def encode(self, tokens):
        h = self.dropout(self.ln(self.embed(tokens) + self.pos[:, : tokens.size(1)]))
        return self.transform(self.blocks(h, src_key_padding_mask=tokens.eq(0)))

    def forward(self, tokens, labels):
        h = self.encode(tokens)
        sel = labels > 0
        # tied output layer, only at masked positions
        logits = h[sel] @ self.embed.weight[: self.out_bias.numel()].t() + self.out_bias
        return F.cross_entropy(logits, labels[sel])

    def score(self, tokens, candidates):
        h = self.encode(tokens)[:, -1]
        w = self.embed(candidates)
        return torch.einsum("bd,bcd->bc", h, w) + self.out_bias[candidates]


def build_eval_set(seqs, user_ids, num_items, pop, max_len, n_neg, seed):
    rng = np.random.default_rng(seed)
    p = pop.copy()
    p[0] = 0.0
    p /= p.sum()
    mask_id = num_items + 1
    toks, cands = [], []
    for u in user_ids:
        s = seqs[u]
        hist = (s[:-1] + [mask_id])[-max_len:]
        toks.append([0] * (max_len - len(hist)) + hist)
        seen = set(s)
        negs = []
        while len(negs) < n_neg:
            draw = rng.choice(len(p), size=2 * n_neg, p=p)
            negs.extend(int(x) for x in draw if x not in seen)
        cands.append([s[-1]] + negs[:n_neg])
    return torch.tensor(toks), torch.tensor(cands)


@torch.no_grad()
def evaluate(module, eval_tokens, eval_cands, device, batch=512):
    module.eval()
    stats = torch.zeros(5, device=device, dtype=torch.float64)  # hr1, hr5, hr10, ndcg10, n
    for i in range(0, len(eval_tokens), batch):
        t = eval_tokens[i:i + batch].to(device)
        c = eval_cands[i:i + batch].to(device)
        s = module.score(t, c)
        rank = (s[:, 1:] > s[:, :1]).sum(1)
        stats[0] += (rank < 1).sum()
        stats[1] += (rank < 5).sum()
        stats[2] += (rank < 10).sum()
        stats[3] += torch.where(rank < 10, 1.0 / torch.log2(rank.double() + 2), torch.zeros_like(rank, dtype=torch.float64)).sum()
        stats[4] += len(t)
    dist.all_reduce(stats)
    module.train()
    n = stats[4]
    return {"HR@1": (stats[0] / n).item(), "HR@5": (stats[1] / n).item(),
            "HR@10": (stats[2] / n).item(), "NDCG@10": (stats[3] / n).item()}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, num_items, pop = load_sequences(args.data)
    logger.info("users=%d items=%d", len(seqs), num_items)

    train_ds = MaskedSeqDataset(seqs, num_items, args.max_len, args.mask_prob)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)

    my_users = list(range(rank, len(seqs), world_size))
    eval_tokens, eval_cands = build_eval_set(seqs, my_users, num_items, pop, args.max_len,
                                             args.num_negatives, seed=args.seed + rank)

    model = BERT4Rec(num_items, args.max_len, args.d_model, args.n_layers, args.n_heads, args.dropout).to(device)
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "ln", "LayerNorm", "pos"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    # lr tuned for 8 x 64 sequences per step
    lr = args.lr * (world_size * args.per_device_batch_size) / 512
    optimizer = torch.optim.AdamW(params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / args.warmup_steps, max(0.0, (args.max_steps - s) / (args.max_steps - args.warmup_steps))),
    )

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    step, epoch, best = 0, 0, 0.0
    running = torch.zeros((), device=device)
    pbar = tqdm(total=args.max_steps, disable=rank != 0, dynamic_ncols=True)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for tokens, labels in loader:
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = ddp_model(tokens, labels)
            if not torch.isfinite(loss):
                logger.warning("non-finite loss at step %d, skipping batch", step)
                optimizer.zero_grad(set_to_none=True)
                continue
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            running += loss.detach()
            pbar.update(1)
            if step % 100 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                pbar.set_postfix(loss=f"{running.item() / 100:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
                running.zero_()

            if step % args.eval_steps == 0 or step == args.max_steps:
                metrics = evaluate(model, eval_tokens, eval_cands, device)
                logger.info("step %d (%.0fs) %s", step, time.time() - t0,
                            " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                if rank == 0:
                    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step, "metrics": metrics}
                    torch.save(ckpt, os.path.join(args.output_dir, "last.pt"))
                    if metrics["NDCG@10"] > best:
                        best = metrics["NDCG@10"]
                        torch.save(ckpt, os.path.join(args.output_dir, "best.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1
    pbar.close()
    logger.info("done, best NDCG@10 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
