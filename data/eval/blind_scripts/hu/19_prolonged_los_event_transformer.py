"""Prolonged length of stay (> 7 days) from the first 24h of hospital events.

Long event sequences (up to 4k tokens) with activation checkpointing and gradient
accumulation; AUROC/AUPRC via torchmetrics, which syncs its states across ranks.

    torchrun --nproc_per_node=8 19_prolonged_los_event_transformer.py \
        --events /mnt/ehr/los24/events.parquet --labels /mnt/ehr/los24/cohort.parquet
"""
import argparse
import contextlib
import os
import time
import uuid

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--labels", required=True)
    p.add_argument("--runs", default="/mnt/ehr/los24/runs")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--min_freq", type=int, default=10)
    return p.parse_args()


def build_vocab(events, train_ids, min_freq):
    counts = events[events.hadm_id.isin(train_ids)].token.value_counts()
    kept = sorted(counts[counts >= min_freq].index.tolist())
    return {t: i + 2 for i, t in enumerate(kept)}  # 0 pad, 1 unk


class Stays(Dataset):
    def __init__(self, seqs, labels, max_len):
        self.seqs, self.labels, self.max_len = seqs, labels, max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        ids, minutes = self.seqs[i]
        return ids[: self.max_len], minutes[: self.max_len], self.labels[i]


def collate(batch):
    L = max(len(b[0]) for b in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    mins = torch.zeros(len(batch), L)
    for j, (a, m, _) in enumerate(batch):
        ids[j, : len(a)] = torch.as_tensor(a)
        mins[j, : len(m)] = torch.as_tensor(m, dtype=torch.float32)
    return ids, mins, torch.tensor([b[2] for b in batch], dtype=torch.float32)


class EventTransformer(nn.Module):
    def __init__(self, vocab, d, layers, checkpointing=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.time = nn.Sequential(nn.Linear(1, d), nn.Tanh(), nn.Linear(d, d))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)
        self.checkpointing = checkpointing

    def forward(self, ids, minutes):
        pad = ids == 0
        x = self.emb(ids) + self.time((minutes / 1440.0).unsqueeze(-1))
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = ckpt.checkpoint(layer, x, None, pad, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=pad)
        x = self.norm(x)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1)).squeeze(-1)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # one run directory name for all ranks
    run_id = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(run_id, src=0)
    run_dir = os.path.join(args.runs, run_id[0])

    cohort = pd.read_parquet(args.labels)  # hadm_id, split, los_days
    events = pd.read_parquet(args.events, columns=["hadm_id", "minute", "token"])
    train_ids = cohort.loc[cohort.split == "train", "hadm_id"]
    vocab = [build_vocab(events, train_ids, args.min_freq) if rank == 0 else None]
    dist.broadcast_object_list(vocab, src=0)
    vocab = vocab[0]

    events["tid"] = events.token.map(vocab).fillna(1).astype("int64")
    grouped = {h: (g.tid.tolist(), g.minute.tolist()) for h, g in events.sort_values("minute").groupby("hadm_id")}
    data = {}
    for split in ("train", "val"):
        part = cohort[(cohort.split == split) & cohort.hadm_id.isin(grouped)]
        data[split] = Stays([grouped[h] for h in part.hadm_id], (part.los_days > 7).astype(int).tolist(),
                            args.max_len)

    sampler = DistributedSampler(data["train"], shuffle=True, seed=17, drop_last=True)
    train_dl = DataLoader(data["train"], batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    # strided, unpadded shard: every stay is scored once; torchmetrics handles uneven shard sizes
    val_shard = Subset(data["val"], range(rank, len(data["val"]), world))
    val_dl = DataLoader(val_shard, batch_size=16, collate_fn=collate, num_workers=2)

    model = DDP(EventTransformer(len(vocab) + 2, args.d, args.layers).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    updates = args.epochs * (len(train_dl) // args.accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=updates, pct_start=0.1)
    auroc = BinaryAUROC().to(device)
    auprc = BinaryAveragePrecision().to(device)

    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        print(f"run {run_id[0]}: vocab {len(vocab)}, train {len(data['train'])}, val {len(data['val'])}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        n_micro = (len(train_dl) // args.accum) * args.accum
        for i, (ids, mins, y) in enumerate(train_dl):
            if i >= n_micro:
                break
            ids, mins, y = ids.to(device, non_blocking=True), mins.to(device, non_blocking=True), y.to(device)
            sync_now = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logit = model(ids, mins)
                loss = F.binary_cross_entropy_with_logits(logit.float(), y) / args.accum
                loss.backward()
            loss_sum += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)

        model.eval()
        with torch.no_grad():
            for ids, mins, y in val_dl:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    p = torch.sigmoid(model.module(ids.to(device), mins.to(device)).float())
                auroc.update(p, y.to(device).long())
                auprc.update(p, y.to(device).long())
        val_auc, val_ap = auroc.compute().item(), auprc.compute().item()
        auroc.reset()
        auprc.reset()

        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} val AUROC {val_auc:.4f} "
                  f"AUPRC {val_ap:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_auc > best:
                best = val_auc
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                           os.path.join(run_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
