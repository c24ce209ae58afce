#!/usr/bin/env python
"""Fine-tune the top layers of ESM-2 plus a bilinear contact head on PDB chains.

Targets are C-beta contacts (< 8 A). Training examples are random windows of
--crop_size residues; validation uses full-length chains, one chain per step,
and long-range precision@L is computed on rank 0 over the whole validation set.

    torchrun --nproc_per_node=4 01_esm2_contact_head.py \
        --train_list splits/train.txt --val_list splits/val.txt --npz_dir data/npz
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import esm


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_list", required=True)
    p.add_argument("--val_list", required=True)
    p.add_argument("--npz_dir", required=True)
    p.add_argument("--esm_model", default="esm2_t33_650M_UR50D")
    p.add_argument("--unfreeze_last", type=int, default=4)
    p.add_argument("--crop_size", type=int, default=384)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--backbone_lr", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--warmup_steps", type=int, default=300)
    p.add_argument("--min_sep", type=int, default=24)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--out_dir", default="runs/esm2_contacts")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class PDBContactDataset(Dataset):
    """npz files with `seq` (str) and `cb_dist` (L x L, nan where atoms are missing)."""

    def __init__(self, list_file, npz_dir, crop_size=None):
        with open(list_file) as f:
            self.ids = [line.split()[0] for line in f if line.strip()]
        self.npz_dir = npz_dir
        self.crop_size = crop_size

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        data = np.load(os.path.join(self.npz_dir, self.ids[idx] + ".npz"))
        seq = str(data["seq"])
        dmap = torch.from_numpy(data["cb_dist"].astype(np.float32))
        if self.crop_size is not None and len(seq) > self.crop_size:
            start = random.randint(0, len(seq) - self.crop_size)
            end = start + self.crop_size
            seq = seq[start:end]
            dmap = dmap[start:end, start:end]
        valid = ~torch.isnan(dmap)
        contacts = (torch.nan_to_num(dmap, nan=1e4) < 8.0).float()
        return idx, seq, contacts, valid


class Collate:
    def __init__(self, alphabet):
        self.converter = alphabet.get_batch_converter()

    def __call__(self, batch):
        idxs, seqs, contacts, valids = zip(*batch)
        _, _, tokens = self.converter([(str(i), s) for i, s in zip(idxs, seqs)])
        L = max(len(s) for s in seqs)
        tgt = torch.zeros(len(seqs), L, L)
        msk = torch.zeros(len(seqs), L, L, dtype=torch.bool)
        for b, (c, v) in enumerate(zip(contacts, valids)):
            n = c.shape[0]
            tgt[b, :n, :n] = c
            msk[b, :n, :n] = v
        return torch.tensor(idxs), tokens, tgt, msk


class ESMContactModel(nn.Module):
    def __init__(self, backbone, unfreeze_last, head_dim=128):
        super().__init__()
        self.backbone = backbone
        self.repr_layer = backbone.num_layers
        for p in self.backbone.parameters():
            p.requires_grad = False
        for layer in self.backbone.layers[-unfreeze_last:]:
            for p in layer.parameters():
                p.requires_grad = True
        for p in self.backbone.emb_layer_norm_after.parameters():
            p.requires_grad = True
        d = backbone.embed_dim
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, head_dim)
        self.k = nn.Linear(d, head_dim)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, L):
        out = self.backbone(tokens, repr_layers=[self.repr_layer])
        h = self.norm(out["representations"][self.repr_layer][:, 1:L + 1])
        q, k = self.q(h), self.k(h)
        logits = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(q.shape[-1])
        return 0.5 * (logits + logits.transpose(1, 2)) + self.bias


def contact_loss(logits, tgt, msk, min_sep=6):
    L = logits.shape[-1]
    pos = torch.arange(L, device=logits.device)
    sep = (pos[None, :] - pos[:, None]).abs() >= min_sep
    m = msk & sep[None]
    return F.binary_cross_entropy_with_logits(logits.float()[m], tgt[m])


def precision_at_l(probs, tgt, msk, min_sep):
    L = probs.shape[0]
    i, j = torch.triu_indices(L, L, offset=min_sep, device=probs.device)
    keep = msk[i, j]
    p, t = probs[i, j][keep], tgt[i, j][keep]
    if p.numel() == 0:
        return None
    top = torch.topk(p, min(L, p.numel())).indices
    return t[top].mean().item()


@torch.no_grad()
def evaluate(model, loader, device, args, rank, world_size):
    model.eval()
    results = {}
    for idx, tokens, tgt, msk in loader:
        idx, tokens = idx.to(device), tokens.to(device)
        tgt, msk = tgt.to(device), msk.to(device)
        L = tgt.shape[-1]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, L)
        probs = torch.sigmoid(logits.float())[0]
        packed = torch.stack([probs, tgt[0], msk[0].float()])
        gathered = [torch.empty_like(packed) for _ in range(world_size)]
        dist.all_gather(gathered, packed)
        gathered_idx = [torch.empty_like(idx) for _ in range(world_size)]
        dist.all_gather(gathered_idx, idx)
        if rank == 0:
            for gi, g in zip(gathered_idx, gathered):
                key = int(gi.item())
                if key in results:
                    # DistributedSampler repeats a few chains to even out the last round
                    continue
                prec = precision_at_l(g[0], g[1], g[2].bool(), args.min_sep)
                if prec is not None:
                    results[key] = prec
    model.train()
    if rank == 0 and results:
        return float(np.mean(list(results.values())))
    return 0.0


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    # let rank 0 fill the torch hub cache before the others read it
    if rank != 0:
        dist.barrier()
    backbone, alphabet = esm.pretrained.load_model_and_alphabet(args.esm_model)
    if rank == 0:
        dist.barrier()

    model = ESMContactModel(backbone, args.unfreeze_last).to(device)
    model = DDP(model, device_ids=[local_rank])

    collate = Collate(alphabet)
    train_set = PDBContactDataset(args.train_list, args.npz_dir, crop_size=args.crop_size)
    val_set = PDBContactDataset(args.val_list, args.npz_dir, crop_size=None)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler,
                            num_workers=2, collate_fn=collate)

    backbone_params = [p for p in model.module.backbone.parameters() if p.requires_grad]
    head_params = [p for n, p in model.module.named_parameters()
                   if p.requires_grad and not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([
        {"params": backbone_params, "lr": args.backbone_lr},
        {"params": head_params, "lr": args.lr},
    ], weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world_size={world_size} train={len(train_set)} val={len(val_set)} "
              f"steps/epoch={len(train_loader)}", flush=True)

    best = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for idx, tokens, tgt, msk in train_loader:
            tokens = tokens.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            msk = msk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens, tgt.shape[-1])
            loss = contact_loss(logits, tgt, msk)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % args.log_every == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {running[0] / running[1]:.4f} "
                          f"lr {scheduler.get_last_lr()[1]:.2e}", flush=True)
                running.zero_()

        p_at_l = evaluate(model, val_loader, device, args, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s  val long-range P@L {p_at_l:.4f}",
                  flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "p_at_l": p_at_l, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if p_at_l > best:
                best = p_at_l
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
