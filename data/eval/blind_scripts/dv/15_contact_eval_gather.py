"""Distogram / contact predictor on top of frozen ESM-2 embeddings.

Per-residue ESM-2 (3B, layer 36) embeddings are precomputed with esm's extract.py
(<id>.pt with {"representations": {36: (L, 2560)}}); distances come from the PDB
(<id>.npz with "cb_dist", NaN where unresolved).  A 2D dilated ResNet on the pair
features predicts 37 distance bins (2-20 A + no-contact bin) like trRosetta.

    torchrun --nproc_per_node=8 15_contact_eval_gather.py --emb-dir emb/esm2_3b --dist-dir pdb_dist \
        --train-ids splits/train.txt --valid-ids splits/valid.txt
"""
import argparse
import contextlib
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BINS = torch.linspace(2.0, 20.0, 37)           # upper edges; last bin = beyond 20 A
CONTACT_BINS = int((BINS < 8.0).sum())


class PairSet(Dataset):
    def __init__(self, id_file, emb_dir, dist_dir, layer=36, crop=None):
        self.ids = [l.strip() for l in open(id_file) if l.strip()]
        self.emb_dir, self.dist_dir, self.layer, self.crop = emb_dir, dist_dir, layer, crop

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pid = self.ids[i]
        emb = torch.load(os.path.join(self.emb_dir, pid + ".pt"), map_location="cpu")["representations"][self.layer]
        d = torch.from_numpy(np.load(os.path.join(self.dist_dir, pid + ".npz"))["cb_dist"]).float()
        L = emb.shape[0]
        if self.crop and L > self.crop:
            s = random.randint(0, L - self.crop)
            emb, d = emb[s:s + self.crop], d[s:s + self.crop, s:s + self.crop]
        target = torch.bucketize(d.nan_to_num(-1.0), BINS)
        target[torch.isnan(d)] = -100
        return emb.float(), target


class ResBlock2d(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.n1, self.c1 = nn.InstanceNorm2d(c, affine=True), nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)
        self.n2, self.c2 = nn.InstanceNorm2d(c, affine=True), nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)
        self.drop = nn.Dropout2d(0.15)

    def forward(self, x):
        h = self.c1(F.elu(self.n1(x)))
        h = self.c2(self.drop(F.elu(self.n2(h))))
        return x + h


class DistogramNet(nn.Module):
    def __init__(self, d_emb=2560, d_proj=64, c=96, n_blocks=24, n_bins=38):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(d_emb), nn.Linear(d_emb, d_proj))
        self.inp = nn.Conv2d(2 * d_proj, c, 1)
        self.blocks = nn.Sequential(*[ResBlock2d(c, [1, 2, 4, 8][i % 4]) for i in range(n_blocks)])
        self.out = nn.Conv2d(c, n_bins, 1)

    def forward(self, emb):
        z = self.proj(emb)                                   # (B, L, d)
        L = z.size(1)
        pair = torch.cat([z[:, :, None].expand(-1, -1, L, -1), z[:, None].expand(-1, L, -1, -1)], -1)
        x = self.blocks(self.inp(pair.permute(0, 3, 1, 2)))
        logits = self.out(x)
        return 0.5 * (logits + logits.transpose(-1, -2))     # (B, bins, L, L)


@torch.no_grad()
def evaluate(model, loader, device, min_sep=24):
    model.eval()
    pl = torch.zeros(2, device=device)
    all_p, all_y = [], []
    for emb, target in loader:
        emb, target = emb.to(device), target[0].to(device)
        probs = model(emb).float().softmax(1)[0]
        p_contact = probs[:CONTACT_BINS].sum(0)
        L = target.size(0)
        i, j = torch.triu_indices(L, L, offset=min_sep, device=device)
        p, t = p_contact[i, j], target[i, j]
        ok = t != -100
        p, y = p[ok], (t[ok] < CONTACT_BINS).float()
        if y.numel() == 0:
            continue
        pl[0] += y[p.topk(min(L, y.numel())).indices].mean()
        pl[1] += 1
        all_p.append(p)
        all_y.append(y)
    dist.all_reduce(pl)

    local_p = torch.cat(all_p)
    local_y = torch.cat(all_y)
    world = dist.get_world_size()
    gathered_p = [torch.empty_like(local_p) for _ in range(world)]
    gathered_y = [torch.empty_like(local_y) for _ in range(world)]
    dist.all_gather(gathered_p, local_p)
    dist.all_gather(gathered_y, local_y)
    auprc = average_precision_score(torch.cat(gathered_y).cpu().numpy(), torch.cat(gathered_p).cpu().numpy())
    model.train()
    return (pl[0] / pl[1]).item(), auprc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb-dir", required=True)
    ap.add_argument("--dist-dir", required=True)
    ap.add_argument("--train-ids", required=True)
    ap.add_argument("--valid-ids", required=True)
    ap.add_argument("--out", default="runs/distogram_esm3b")
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--accum", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_ds = PairSet(args.train_ids, args.emb_dir, args.dist_dir, crop=args.crop)
    valid_all = PairSet(args.valid_ids, args.emb_dir, args.dist_dir)
    valid_ds = Subset(valid_all, range(rank, len(valid_all), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=6, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, num_workers=2)

    model = DistogramNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        for it, (emb, target) in enumerate(train_loader):
            emb, target = emb.to(device, non_blocking=True), target.to(device, non_blocking=True)
            sync = (it + 1) % args.accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(emb)
                loss = F.cross_entropy(logits.float(), target, ignore_index=-100) / args.accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            tot += loss.item() * args.accum
        sched.step()

        p_at_l, auprc = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train ce {tot / len(train_loader):.4f} valid P@L(LR) {p_at_l:.4f} "
                  f"AUPRC {auprc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if p_at_l > best:
                best = p_at_l
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
