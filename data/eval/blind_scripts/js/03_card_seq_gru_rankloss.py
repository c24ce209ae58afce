"""Per-card transaction-sequence model (GRU) trained with BCE + pairwise AUC surrogate.

Each sample is the last `seq_len` transactions of a card, label = is the last one fraud.
Sequences are pre-built by build_sequences.py into memory-mapped .npy files.

    torchrun --nproc_per_node=8 03_card_seq_gru_rankloss.py --data-dir /datasets/cardseq/v3
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class SeqDataset(Dataset):
    def __init__(self, root, split):
        self.num = np.load(os.path.join(root, f"{split}_num.npy"), mmap_mode="r")    # [N, L, F]
        self.cat = np.load(os.path.join(root, f"{split}_cat.npy"), mmap_mode="r")    # [N, L, 3] mcc, country, channel
        self.lens = np.load(os.path.join(root, f"{split}_len.npy"))
        self.y = np.load(os.path.join(root, f"{split}_y.npy"))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (
            torch.from_numpy(np.ascontiguousarray(self.num[i])).float(),
            torch.from_numpy(np.ascontiguousarray(self.cat[i])).long(),
            int(self.lens[i]),
            float(self.y[i]),
        )


class StridedShard(Sampler):
    """Deterministic, non-padded split for evaluation."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class CardGRU(nn.Module):
    def __init__(self, n_num, cat_cards=(1000, 250, 8), emb=16, hidden=128, layers=2, dropout=0.1):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb, padding_idx=0) for c in cat_cards])
        self.inp = nn.Linear(n_num + emb * len(cat_cards), hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True, dropout=dropout)
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, num, cat, lens):
        e = torch.cat([emb(cat[..., j]) for j, emb in enumerate(self.embs)], dim=-1)
        x = F.gelu(self.inp(torch.cat([num, e], dim=-1)))
        packed = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.out(h[-1]).squeeze(-1)


def pairwise_auc_loss(logits, y, margin=1.0, max_pairs=4096):
    pos = logits[y > 0.5]
    neg = logits[y < 0.5]
    if neg.numel() > max_pairs:
        neg = neg[torch.randint(neg.numel(), (max_pairs,), device=neg.device)]
    diff = margin - (pos[:, None] - neg[None, :])
    return F.relu(diff).pow(2).mean()


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, ds, args, device, rank, world):
    model.eval()
    dl = DataLoader(ds, batch_size=2048, sampler=StridedShard(len(ds), rank, world),
                    num_workers=args.workers, pin_memory=True)
    out = []
    for num, cat, lens, y in dl:
        logit = model.module(num.to(device, non_blocking=True), cat.to(device, non_blocking=True), lens)
        out.append(torch.stack([torch.sigmoid(logit).float().cpu(), y.float()], dim=1))
    local = torch.cat(out).numpy()
    parts = [None] * world
    dist.all_gather_object(parts, local)
    allp = np.concatenate(parts)
    return average_precision_score(allp[:, 1], allp[:, 0]), float(allp[:, 1].mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--save-dir", default="checkpoints/card_gru")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--rank-weight", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = SeqDataset(args.data_dir, "train")
    val_ds = SeqDataset(args.data_dir, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    model = CardGRU(n_num=train_ds.num.shape[-1]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total_steps = args.epochs * len(train_dl)

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for num, cat, lens, y in train_dl:
            num = num.to(device, non_blocking=True)
            cat = cat.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).float()
            if y.sum() == 0:
                continue  # no fraud in this batch, ranking term undefined

            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total_steps, args.warmup, args.lr)
            logits = model(num, cat, lens)
            bce = F.binary_cross_entropy_with_logits(logits, y)
            loss = bce + args.rank_weight * pairwise_auc_loss(logits, y)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1

            if step % args.log_every == 0:
                stats = torch.stack([loss.detach(), bce.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/bce", stats[1].item(), step)
                    writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)

        val_ap, base_rate = evaluate(model, val_ds, args, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} step {step} val PR-AUC {val_ap:.4f} (base rate {base_rate:.5f}) "
                  f"{time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("val/pr_auc", val_ap, epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if val_ap > best:
                best = val_ap
                torch.save(state, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
