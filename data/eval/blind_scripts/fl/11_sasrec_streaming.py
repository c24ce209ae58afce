"""SASRec next-item model trained on sharded session logs (parquet part files) with DeepSpeed.

Training data is streamed: each rank reads its own subset of part files, and each
DataLoader worker a subset of those, so no rank ever loads the full log.

    deepspeed --num_gpus 8 11_sasrec_streaming.py --train-glob '/data/sessions/train/part-*.parquet' \
        --valid /data/sessions/valid.parquet --n-items 2400000
"""
import argparse
import glob
import math
import os
import random

import deepspeed
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler


def pad_left(seq, max_len):
    seq = list(seq[-max_len:])
    return [0] * (max_len - len(seq)) + seq


class ShardedSessions(IterableDataset):
    def __init__(self, files, max_len, seed=0):
        self.files = files
        self.max_len = max_len
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        rng = random.Random(self.seed + self.epoch)
        files = list(files)
        rng.shuffle(files)
        for f in files:
            table = pq.read_table(f, columns=["items"])
            for items in table.column("items").to_pylist():
                if len(items) < 2:
                    continue
                seq = pad_left(items[:-1], self.max_len)
                tgt = pad_left(items[1:], self.max_len)
                yield torch.tensor(seq), torch.tensor(tgt)


class LeaveOneOut(Dataset):
    def __init__(self, path, max_len):
        self.sessions = pq.read_table(path, columns=["items"]).column("items").to_pylist()
        self.max_len = max_len

    def __len__(self):
        return len(self.sessions)

    def __getitem__(self, i):
        items = self.sessions[i]
        return torch.tensor(pad_left(items[:-1], self.max_len)), items[-1]


class SASRec(nn.Module):
    def __init__(self, n_items, d=256, n_layers=4, n_heads=4, max_len=200, dropout=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        causal = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, seq):
        L = seq.size(1)
        pos = torch.arange(L, device=seq.device)
        h = self.drop(self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb(pos))
        h = self.encoder(h, mask=self.causal[:L, :L], src_key_padding_mask=seq == 0)
        return self.norm(h)


def sampled_softmax_loss(model, hidden, targets, n_items, n_neg=8192):
    mask = targets > 0
    h = hidden[mask]
    pos = targets[mask]
    neg = torch.randint(1, n_items + 1, (n_neg,), device=h.device)
    w = model.item_emb.weight
    pos_logit = (h * w[pos]).sum(-1, keepdim=True)
    neg_logit = h @ w[neg].t()
    logits = torch.cat([pos_logit, neg_logit], dim=1).float()
    return F.cross_entropy(logits, torch.zeros(len(pos), dtype=torch.long, device=h.device))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-glob", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--n-items", type=int, required=True)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default="runs/sasrec")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


@torch.no_grad()
def evaluate(engine, loader, k=10):
    engine.eval()
    acc = torch.zeros(3, device=engine.device)  # hr, ndcg, n
    w = engine.module.item_emb.weight
    for seq, target in loader:
        seq, target = seq.to(engine.device), target.to(engine.device)
        h = engine(seq)[:, -1]
        scores = (h @ w.t()).float()
        scores[:, 0] = -1e9
        scores.scatter_(1, seq, -1e9)  # do not recommend already seen items
        scores[torch.arange(len(target)), target] = (h * w[target]).sum(-1).float()
        rank = (scores > scores[torch.arange(len(target)), target].unsqueeze(1)).sum(1)
        hit = rank < k
        acc[0] += hit.sum()
        acc[1] += (hit.float() / torch.log2(rank.float() + 2)).sum()
        acc[2] += len(target)
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)

    files = sorted(glob.glob(args.train_glob))
    train_set = ShardedSessions(files[rank::world], args.max_len)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, num_workers=4, pin_memory=True,
                              drop_last=True)
    valid_set = LeaveOneOut(args.valid, args.max_len)
    valid_loader = DataLoader(valid_set, batch_size=512, num_workers=2,
                              sampler=DistributedSampler(valid_set, shuffle=False))

    model = SASRec(args.n_items, max_len=args.max_len)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.9, 0.98]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 2000}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    best_ndcg = 0.0
    for epoch in range(args.epochs):
        train_set.set_epoch(epoch)
        for step, (seq, tgt) in enumerate(train_loader):
            seq, tgt = seq.to(engine.device, non_blocking=True), tgt.to(engine.device, non_blocking=True)
            hidden = engine(seq)
            loss = sampled_softmax_loss(engine.module, hidden, tgt, args.n_items)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        hr, ndcg = evaluate(engine, valid_loader)
        if rank == 0:
            print(f"epoch {epoch}: HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch, "ndcg": ndcg})
        if ndcg > best_ndcg:
            best_ndcg = ndcg
            if rank == 0:
                sd = {k: v.float().cpu() for k, v in engine.module.state_dict().items()}
                torch.save(sd, os.path.join(args.out, "sasrec_best.pt"))
                np.save(os.path.join(args.out, "item_embeddings.npy"), sd["item_emb.weight"].numpy())

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
