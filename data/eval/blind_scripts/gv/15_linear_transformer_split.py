"""
Causal linear-attention transformer (fast-transformers CUDA causal_product kernel)
trained on packed 16k-token chunks of a music/MIDI event corpus.

    torchrun --nproc_per_node=4 15_linear_transformer_split.py --rows data/midi_events_16k.npy
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fast_transformers.builders import TransformerEncoderBuilder
from fast_transformers.masking import TriangularCausalMask
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", required=True, help="int16 array [n_rows, seq_len + 1]")
    ap.add_argument("--vocab", type=int, default=390)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--n_layers", type=int, default=12)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--feature_map", default="elu", choices=["elu", "favor"])
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--save", default="ckpt/linear_midi")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class Rows(Dataset):
    def __init__(self, arr, idx):
        self.arr, self.idx = arr, idx

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[self.idx[i]].astype(np.int64))


class LinearLM(nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, feature_map, dropout, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        builder = TransformerEncoderBuilder.from_kwargs(
            n_layers=n_layers, n_heads=n_heads,
            query_dimensions=d_model // n_heads, value_dimensions=d_model // n_heads,
            feed_forward_dimensions=4 * d_model, attention_type="causal-linear",
            activation="gelu", dropout=dropout, attention_dropout=0.0,
        )
        if feature_map == "favor":
            from fast_transformers.feature_maps import Favor
            builder.feature_map = Favor.factory(n_dims=256)
        self.encoder = builder.get()
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x):
        B, L = x.shape
        pos = torch.arange(L, device=x.device)
        h = self.drop(self.tok(x) + self.pos(pos)[None])
        h = self.encoder(h, attn_mask=TriangularCausalMask(L, device=x.device))
        return self.head(self.norm(h))


def cosine_warmup(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # causal_product kernel is fp32 only; let matmuls use TF32
    torch.backends.cuda.matmul.allow_tf32 = True
    # different dropout / favor random features per rank
    seed_everything(args.seed + rank)

    arr = np.load(args.rows, mmap_mode="r")
    seq_len = arr.shape[1] - 1
    perm = np.random.permutation(arr.shape[0])
    n_val = int(len(perm) * args.val_frac)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    train_ds, val_ds = Rows(arr, train_idx), Rows(arr, val_idx)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = LinearLM(args.vocab, args.d_model, args.n_layers, args.n_heads, args.feature_map,
                     args.dropout, seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_warmup(s, args.warmup, total))

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"rows: {len(train_ds)} train / {len(val_ds)} val, seq_len {seq_len}, world {world}")

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        vagg = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x in val_loader:
                x = x.to(device)
                logits = model.module(x[:, :-1])
                vagg[0] += F.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1),
                                           reduction="sum")
                vagg[1] += x[:, 1:].numel()
        dist.all_reduce(agg)
        dist.all_reduce(vagg)
        train_loss = (agg[0] / agg[1]).item()
        val_loss = (vagg[0] / vagg[1]).item()
        if rank == 0:
            print(f"epoch {epoch:2d} train {train_loss:.4f} val {val_loss:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "val_loss": val_loss,
                     "args": vars(args)}
            torch.save(state, os.path.join(args.save, "last.pt"))
            if val_loss < best:
                best = val_loss
                torch.save(state, os.path.join(args.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
