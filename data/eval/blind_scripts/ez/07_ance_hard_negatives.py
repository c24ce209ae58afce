#!/usr/bin/env python
"""Siamese (shared encoder) product/tag matcher with ANCE-style hard negatives.

Every --refresh-every epochs the current encoder embeds all tag names, retrieves
the top tags for every training product, and the non-positive ones become that
product's hard negatives for the next epochs.

    torchrun --nproc_per_node=8 07_ance_hard_negatives.py \
        --data-dir /mnt/shared/tagging/catalog_v7_tok --encoder /mnt/shared/models/distilbert-base-uncased
"""
import argparse
import math
import os

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--encoder", required=True)
    p.add_argument("--output-dir", default="/mnt/shared/tagging/runs/ance")
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--refresh-every", type=int, default=3)
    p.add_argument("--num-hard", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


class SiameseEncoder(nn.Module):
    def __init__(self, path, dim=256):
        super().__init__()
        self.bert = AutoModel.from_pretrained(path)
        self.head = nn.Linear(self.bert.config.hidden_size, dim)

    def encode_text(self, ids, mask):
        h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        h = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return F.normalize(self.head(h), dim=-1)

    def forward(self, doc_ids, doc_mask, lab_ids, lab_mask):
        return self.encode_text(doc_ids, doc_mask), self.encode_text(lab_ids, lab_mask)


class TrainPairs(Dataset):
    """Products without any tag are dropped by the export job, so every row has a positive."""

    def __init__(self, ids, mask, Y):
        self.ids, self.mask, self.Y = ids, mask, Y
        self.hard = None

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        labs = self.Y.indices[self.Y.indptr[i]:self.Y.indptr[i + 1]]
        pos = int(np.random.choice(labs))
        neg = -1
        if self.hard is not None:
            cands = self.hard[i][self.hard[i] >= 0]
            if len(cands):
                neg = int(np.random.choice(cands))
        return (torch.from_numpy(self.ids[i].astype(np.int64)),
                torch.from_numpy(self.mask[i].astype(np.int64)), pos, neg)


def chunk_rows(n, rank, world):
    size = math.ceil(n / world)
    return np.arange(rank * size, min(n, (rank + 1) * size)), size


@torch.no_grad()
def encode_all_labels(encoder, lab_ids, lab_mask, rank, world, device, bs=1024):
    """Every rank embeds a slice of the tag names, then the slices are all-gathered."""
    rows, size = chunk_rows(lab_ids.size(0), rank, world)
    out = torch.zeros(size, 256, device=device, dtype=torch.float16)
    for s in range(0, len(rows), bs):
        r = torch.from_numpy(rows[s:s + bs]).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out[s:s + len(r)] = encoder.encode_text(lab_ids[r], lab_mask[r]).half()
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts)[: lab_ids.size(0)]


@torch.no_grad()
def mine_hard_negatives(model, ds, lab_ids, lab_mask, num_hard, rank, world, device, bs=1024):
    model.eval()
    L = encode_all_labels(model, lab_ids, lab_mask, rank, world, device)
    rows, size = chunk_rows(len(ds), rank, world)
    local = torch.full((size, num_hard), -1, dtype=torch.long, device=device)
    for s in range(0, len(rows), bs):
        r = rows[s:s + bs]
        ids = torch.from_numpy(ds.ids[r].astype(np.int64)).to(device)
        mask = torch.from_numpy(ds.mask[r].astype(np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            q = model.encode_text(ids, mask).half()
        top = (q @ L.t()).topk(num_hard + 10, dim=1).indices.cpu().numpy()
        for j, row in enumerate(r):
            true = ds.Y.indices[ds.Y.indptr[row]:ds.Y.indptr[row + 1]]
            negs = top[j][~np.isin(top[j], true)][:num_hard]
            local[s + j, : len(negs)] = torch.from_numpy(negs)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    model.train()
    return torch.cat(parts)[: len(ds)].cpu().numpy()


@torch.no_grad()
def evaluate(encoder, te_ids, te_mask, Y_te, lab_ids, lab_mask, rank, world, device, k=5):
    encoder.eval()
    L = encode_all_labels(encoder, lab_ids, lab_mask, rank, world, device)
    rows = np.arange(rank, te_ids.shape[0], world)
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for s in range(0, len(rows), 1024):
        r = rows[s:s + 1024]
        ids = torch.from_numpy(te_ids[r].astype(np.int64)).to(device)
        mask = torch.from_numpy(te_mask[r].astype(np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            q = encoder.encode_text(ids, mask).half()
        top = (q @ L.t()).topk(k, dim=1).indices.cpu().numpy()
        for j, row in enumerate(r):
            hit = np.isin(top[j], Y_te.indices[Y_te.indptr[row]:Y_te.indptr[row + 1]])
            acc[0] += float(hit[0])
            acc[1] += hit.sum() / k
        acc[2] += len(r)
    dist.all_reduce(acc)
    encoder.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + 1000 * rank)

    d = args.data_dir
    tr_ids, tr_mask = np.load(f"{d}/train_ids.npy", mmap_mode="r"), np.load(f"{d}/train_mask.npy", mmap_mode="r")
    te_ids, te_mask = np.load(f"{d}/test_ids.npy", mmap_mode="r"), np.load(f"{d}/test_mask.npy", mmap_mode="r")
    Y_tr = sp.load_npz(f"{d}/Y_train.npz").tocsr()
    Y_te = sp.load_npz(f"{d}/Y_test.npz").tocsr()
    lab_ids = torch.from_numpy(np.load(f"{d}/label_ids.npy").astype(np.int64)).to(device)
    lab_mask = torch.from_numpy(np.load(f"{d}/label_mask.npy").astype(np.int64)).to(device)

    train_ds = TrainPairs(tr_ids, tr_mask, Y_tr)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)

    encoder = SiameseEncoder(args.encoder).to(device)
    model = DDP(encoder, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        if epoch % args.refresh_every == 0:
            train_ds.hard = mine_hard_negatives(model, train_ds, lab_ids, lab_mask, args.num_hard,
                                                rank, world, device)
        # re-create the loader so the workers pick up the new hard negatives
        loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        sampler.set_epoch(epoch)
        for step, (ids, mask, pos, neg) in enumerate(loader):
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            pos, neg = pos.to(device), neg.to(device)
            cand = torch.cat([pos, neg])
            cand = torch.where(cand >= 0, cand, pos.repeat(2))
            with torch.autocast("cuda", dtype=torch.float16):
                q, l = model(ids, mask, lab_ids[cand], lab_mask[cand])
                logits = (q @ l.t()).float() / args.tau
            clash = cand.unsqueeze(0) == pos.unsqueeze(1)
            target = torch.arange(ids.size(0), device=device)
            clash[target, target] = False
            loss = F.cross_entropy(logits.masked_fill(clash, -1e4), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        p1, p5 = evaluate(model.module, te_ids, te_mask, Y_te, lab_ids, lab_mask, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} P@1 {p1:.4f} P@5 {p5:.4f}", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, f"encoder_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
