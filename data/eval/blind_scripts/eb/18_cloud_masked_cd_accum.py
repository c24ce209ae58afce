"""Cloud-robust Sentinel-2 change detection with gradient accumulation.

Pairs are taken as they come (no cloud filtering at export time).  The s2cloudless
probability of both dates is stored with each chip; pixels that are cloudy in
either date are masked out of the loss and the metrics instead of throwing the
chip away.  Large 384 px chips -> small per-GPU batch -> accumulate gradients.

    torchrun --nproc_per_node=8 18_cloud_masked_cd_accum.py --root /data/s2_cd_raw --accum 4
"""
import argparse
import contextlib
import glob
import os
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_BANDS = 12
CLOUD_T = 0.4


class CloudyPairs(Dataset):
    def __init__(self, root, regions, train):
        self.files = sorted(f for r in regions for f in glob.glob(os.path.join(root, r, "*.npz")))
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        x = np.concatenate([z["s2_t1"], z["s2_t2"]], 0).astype(np.float32) / 10000.0
        y = z["change"].astype(np.float32)
        clear = ((z["cld_t1"] < CLOUD_T) & (z["cld_t2"] < CLOUD_T) & (z["change"] != 255)).astype(np.float32)
        y[clear == 0] = 0
        if self.train:
            if np.random.rand() < 0.5:
                x, y, clear = x[..., ::-1], y[..., ::-1], clear[..., ::-1]
            if np.random.rand() < 0.5:
                x, y, clear = x[:, ::-1], y[::-1], clear[::-1]
        t = lambda v: torch.from_numpy(np.ascontiguousarray(v))
        return t(x), t(y)[None], t(clear)[None]


def masked_bce_dice(logits, y, clear, pos_weight):
    bce = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight, reduction="none")
    bce = (bce * clear).sum() / clear.sum().clamp(min=1.0)   # all-cloudy batch -> 0, graph kept
    p = torch.sigmoid(logits) * clear
    dice = 1 - (2 * (p * y).sum() + 1) / (p.sum() + (y * clear).sum() + 1)
    return bce + dice


def strip_module(sd):
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/cloudcd")
    ap.add_argument("--encoder", default="tu-regnety_016")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--bs", type=int, default=4, help="per GPU micro-batch")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4, help="for an effective global batch of 128")
    ap.add_argument("--patience", type=int, default=12)
    ap.add_argument("--init", default="", help="warm start from an earlier run's best.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    regions = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    val_regions = [r for r in regions if r.startswith("val_")]
    train_regions = [r for r in regions if not r.startswith("val_")]
    train_ds, val_ds = CloudyPairs(args.root, train_regions, True), CloudyPairs(args.root, val_regions, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs, num_workers=8, pin_memory=True)

    net = smp.Unet(args.encoder, encoder_weights=None, in_channels=2 * N_BANDS, classes=1)
    if args.init:
        ck = torch.load(args.init, map_location="cpu")
        net.load_state_dict(strip_module(ck["model"]))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    eff_batch = args.bs * args.accum * world
    lr = args.lr * eff_batch / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)
    pos_w = torch.tensor(3.0, device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"effective batch {eff_batch}, lr {lr:.2e}", flush=True)

    best, bad_epochs = 0.0, 0
    steps_per_epoch = len(train_dl) // args.accum * args.accum
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for i, (x, y, clear) in enumerate(train_dl):
            if i >= steps_per_epoch:
                break
            x, y, clear = x.to(device, non_blocking=True), y.to(device, non_blocking=True), clear.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                loss = masked_bce_dice(logits.float(), y, clear, pos_w) / args.accum
                loss.backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

        net.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y, clear in val_dl:
                x, y, clear = x.to(device), y.to(device), clear.to(device)
                p, t, c = net(x) > 0, y > 0.5, clear > 0.5
                s += torch.stack([(p & t & c).sum(), (p & ~t & c).sum(), (~p & t & c).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)
        plateau.step(f1)  # same value on every rank after the all_reduce

        if f1 > best:
            best, bad_epochs = f1, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "f1": f1, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} val F1 (clear px) {f1:.4f} best {best:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        dist.barrier()
        if bad_epochs >= args.patience:
            if rank == 0:
                print(f"early stop at epoch {epoch}", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
