"""BigEarthNet-S2 (19-class nomenclature) multi-label classification with a ViT-S/16.

12 Sentinel-2 bands resampled to 120x120 and upsampled to 224. Patch embedding is
adapted from an RGB checkpoint; activation checkpointing on the transformer blocks
lets us run batch 256 per GPU.

    torchrun --nproc_per_node=8 15_bigearthnet_vit.py --lmdb /data/BigEarthNet-S2.lmdb --epochs 100 --grad-ckpt
"""
import argparse
import os
import pickle
import time

import lmdb
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BANDS = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B11", "B12"]
MEAN = np.array([360.6, 438.4, 614.0, 588.4, 942.8, 1769.9, 2049.5, 2193.3, 2241.1, 2235.1, 1568.2, 997.7], np.float32)
STD = np.array([563.2, 607.0, 603.3, 684.6, 727.6, 1087.4, 1261.4, 1369.3, 1342.5, 1294.4, 1063.9, 806.4], np.float32)
NUM_CLASSES = 19


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmdb", required=True)
    ap.add_argument("--splits", default="splits/bigearthnet")
    ap.add_argument("--output", default="outputs/ben_vits16")
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--blr", type=float, default=5e-4, help="lr for a global batch of 256")
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--grad-ckpt", action="store_true")
    return ap.parse_args()


class BigEarthNetLMDB(Dataset):
    def __init__(self, path, names, train):
        self.path, self.names, self.train = path, names, train
        self.env = None  # opened lazily in each worker

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)
        with self.env.begin() as txn:
            rec = pickle.loads(txn.get(self.names[i].encode()))
        x = (rec["bands"].astype(np.float32) - MEAN[:, None, None]) / STD[:, None, None]  # (12, 120, 120)
        y = np.zeros(NUM_CLASSES, np.float32)
        y[rec["labels19"]] = 1.0
        x = torch.from_numpy(x)
        if self.train:
            if torch.rand(1) < 0.5:
                x = x.flip(-1)
            if torch.rand(1) < 0.5:
                x = x.flip(-2)
        x = F.interpolate(x[None], size=224, mode="bilinear", align_corners=False)[0]
        return x, torch.from_numpy(y)


class CkptViT(nn.Module):
    """timm ViT whose blocks are recomputed in backward when grad_ckpt is on."""

    def __init__(self, name, pretrained, grad_ckpt):
        super().__init__()
        self.vit = timm.create_model(name, pretrained=pretrained, in_chans=len(BANDS), num_classes=NUM_CLASSES,
                                     drop_path_rate=0.1)
        self.grad_ckpt = grad_ckpt

    def forward(self, x):
        v = self.vit
        x = v._pos_embed(v.patch_embed(x))
        x = v.norm_pre(x)
        for blk in v.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return v.forward_head(v.norm(x))


def gather_variable(t, world):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    def read_split(name):
        with open(os.path.join(args.splits, f"{name}.csv")) as f:
            return [l.strip().split(",")[0] for l in f if l.strip()]

    train_ds = BigEarthNetLMDB(args.lmdb, read_split("train"), train=True)
    val_names = read_split("val")
    val_ds = BigEarthNetLMDB(args.lmdb, val_names[rank::world], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=512, shuffle=False, num_workers=args.workers, pin_memory=True)

    # only rank 0 reads the RGB checkpoint; DDP copies rank 0's weights to the others at construction
    model = CkptViT(args.model, pretrained=(rank == 0), grad_ckpt=args.grad_ckpt).to(device)
    model = DDP(model, device_ids=[local_rank])

    eff_bs = args.batch_size * world
    lr = args.blr * eff_bs / 256
    decay, no_decay = [], []
    for n_, p in model.named_parameters():
        (no_decay if p.ndim == 1 or "pos_embed" in n_ or "cls_token" in n_ else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    steps_per_epoch = len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=args.warmup_epochs / args.epochs, anneal_strategy="cos")

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"world {world}, global batch {eff_bs}, lr {lr:.2e}, {len(train_ds)} train / {len(val_names)} val")
    best_map = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        scores, targets = [], []
        with torch.no_grad():
            for x, y in val_dl:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s = model.module(x.to(device, non_blocking=True)).float().sigmoid()
                scores.append(s)
                targets.append(y.to(device))
        scores = gather_variable(torch.cat(scores), world)
        targets = gather_variable(torch.cat(targets), world)

        if rank == 0:
            y_true, y_score = targets.cpu().numpy(), scores.cpu().numpy()
            micro = average_precision_score(y_true, y_score, average="micro")
            macro = average_precision_score(y_true, y_score, average="macro")
            print(f"epoch {epoch:3d} loss {(run[0] / run[1]).item():.4f} mAP micro {micro:.4f} macro {macro:.4f} "
                  f"[{y_true.shape[0]} patches] ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "map_micro": micro, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output, "checkpoint-last.pth"))
            if micro > best_map:
                best_map = micro
                torch.save(ckpt, os.path.join(args.output, "checkpoint-best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
