"""5-class jet tagging (g, q, t, w, z) on JetNet-150 with a Set Transformer.

Optional auxiliary head regresses the (relative) jet mass from the constituents;
turn it on with --mass-loss-weight > 0.

    torchrun --nproc_per_node=4 16_jetnet_settransformer.py --data-dir /data/jetnet --epochs 50
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from jetnet.datasets import JetNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

JET_TYPES = ["g", "q", "t", "w", "z"]


def load_jetnet(data_dir, split):
    pf, jf = JetNet.getData(jet_type=JET_TYPES, data_dir=data_dir, num_particles=150,
                            particle_features=["etarel", "phirel", "ptrel", "mask"],
                            jet_features=["type", "pt", "eta", "mass"], split=split,
                            split_fraction=[0.7, 0.15, 0.15], seed=42, download=False)
    feats = pf[..., :3].astype(np.float32)
    mask = pf[..., 3].astype(bool)
    feats[..., 2] = np.where(mask, np.log(np.clip(feats[..., 2], 1e-6, None)), 0.0)
    label = jf[:, 0].astype(np.int64)
    rel_mass = (jf[:, 3] / jf[:, 1]).astype(np.float32)
    return feats, mask, label, rel_mass


class MAB(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, q, kv, key_padding_mask=None):
        h = q + self.attn(self.ln1(q), self.ln1(kv), self.ln1(kv), key_padding_mask=key_padding_mask,
                          need_weights=False)[0]
        return h + self.ff(self.ln2(h))


class SetTransformerTagger(nn.Module):
    def __init__(self, d=128, heads=8, n_sab=4, n_classes=5):
        super().__init__()
        self.input = nn.Sequential(nn.Linear(3, d), nn.GELU(), nn.Linear(d, d))
        self.sabs = nn.ModuleList([MAB(d, heads) for _ in range(n_sab)])
        self.seed = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pma = MAB(d, heads)
        self.cls_head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, n_classes))
        self.mass_head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x, mask, return_mass=False):
        pad = ~mask
        h = self.input(x)
        for sab in self.sabs:
            h = sab(h, h, key_padding_mask=pad)
        pooled = self.pma(self.seed.expand(h.size(0), -1, -1), h, key_padding_mask=pad).squeeze(1)
        logits = self.cls_head(pooled)
        if return_mass:
            return logits, self.mass_head(pooled).squeeze(-1)
        return logits


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/data/jetnet")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--mass-loss-weight", type=float, default=0.0)
    ap.add_argument("--ckpt-dir", default="checkpoints/jetnet_st")
    return ap.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tr = load_jetnet(args.data_dir, "train")
    va = load_jetnet(args.data_dir, "valid")
    train_ds = TensorDataset(*(torch.from_numpy(a) for a in tr))
    val_ds = TensorDataset(*(torch.from_numpy(a[rank::world]) for a in va))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, num_workers=2, pin_memory=True)

    model = SetTransformerTagger().to(device)
    model = DDP(model, device_ids=[local_rank])
    use_mass = args.mass_loss_weight > 0

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warmup = len(train_dl)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, m, y, rel_mass in train_dl:
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            y, rel_mass = y.to(device, non_blocking=True), rel_mass.to(device, non_blocking=True)
            if use_mass:
                logits, mass_pred = model(x, m, return_mass=True)
                loss = F.cross_entropy(logits, y) + args.mass_loss_weight * F.mse_loss(mass_pred, rel_mass)
            else:
                loss = F.cross_entropy(model(x, m), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, m, y, _ in val_dl:
                x, m, y = x.to(device), m.to(device), y.to(device)
                logits = model.module(x, m)
                stats[0] += F.cross_entropy(logits, y, reduction="sum")
                stats[1] += (logits.argmax(-1) == y).sum()
                stats[2] += y.numel()
        dist.all_reduce(stats)
        val_loss, val_acc = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

        if rank == 0:
            print(f"epoch {epoch:02d} val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_acc": val_acc,
                            "args": vars(args)}, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
