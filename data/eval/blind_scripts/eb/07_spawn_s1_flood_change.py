"""Flood mapping as change detection on Sentinel-1 GRD (pre / post event, VV+VH).

Chips come from several flood events; each event is entirely in train or in val
(events.csv has an `split` column), so no event's neighbouring chips leak.
Some events also ship a permanent-water (JRC) mask; when a batch has one we add
an auxiliary permanent-water loss.

Started with torch.multiprocessing on a single node:
    python 07_spawn_s1_flood_change.py --data /data/s1floods --gpus 4
"""
import argparse
import csv
import os
import socket
from contextlib import closing

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DB_MIN, DB_MAX = -30.0, 5.0


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class S1FloodChips(Dataset):
    def __init__(self, root, events, train):
        self.rows = []
        with open(os.path.join(root, "chips.csv")) as f:
            for r in csv.DictReader(f):
                if r["event"] in events:
                    self.rows.append(r)
        self.root, self.train = root, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        z = np.load(os.path.join(self.root, r["file"]))
        x = np.concatenate([z["pre"], z["post"]], 0).astype(np.float32)  # (4, H, W) dB
        x = (np.clip(x, DB_MIN, DB_MAX) - DB_MIN) / (DB_MAX - DB_MIN)
        flood = z["flood"].astype(np.int64)                                # 0/1, -1 nodata
        perm = z["perm"].astype(np.float32) if "perm" in z.files else np.zeros(flood.shape, np.float32)
        has_perm = np.float32("perm" in z.files)
        if self.train and np.random.rand() < 0.5:
            x, flood, perm = x[..., ::-1], flood[..., ::-1], perm[..., ::-1]
        return (torch.from_numpy(x.copy()), torch.from_numpy(flood.copy()),
                torch.from_numpy(perm.copy()), torch.tensor(has_perm))


class FloodChangeNet(nn.Module):
    def __init__(self, encoder="resnet34"):
        super().__init__()
        self.unet = smp.Unet(encoder, encoder_weights=None, in_channels=4, classes=2)
        self.perm_head = nn.Conv2d(16, 1, kernel_size=1)  # 16 = last decoder channels

    def forward(self, x, with_perm=False):
        feats = self.unet.encoder(x)
        dec = self.unet.decoder(*feats)
        flood = self.unet.segmentation_head(dec)
        perm = self.perm_head(dec).squeeze(1) if with_perm else None
        return flood, perm


def load_events(root):
    train, val = set(), set()
    with open(os.path.join(root, "events.csv")) as f:
        for r in csv.DictReader(f):
            (train if r["split"] == "train" else val).add(r["event"])
    return train, val


def main_worker(local_rank, ngpus, args):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=local_rank, world_size=ngpus)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_events, val_events = load_events(args.data)
    train_ds = S1FloodChips(args.data, train_events, train=True)
    val_ds = S1FloodChips(args.data, val_events, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=ngpus, rank=local_rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(local_rank, len(val_ds), ngpus)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = FloodChangeNet(args.encoder)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        missing, unexpected = model.unet.encoder.load_state_dict(sd, strict=False)
        if local_rank == 0:
            print(f"encoder init: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # perm_head only gets a gradient on batches that carry a JRC mask
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * ngpus, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    class_w = torch.tensor([1.0, args.flood_weight], device=device)

    if local_rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, flood, perm, has_perm in train_loader:
            x, flood = x.to(device, non_blocking=True), flood.to(device, non_blocking=True)
            use_perm = bool(has_perm.any())
            logits, perm_logits = model(x, with_perm=use_perm)
            loss = F.cross_entropy(logits, flood, weight=class_w, ignore_index=-1)
            if use_perm:
                sel = has_perm.to(device).bool()
                loss = loss + args.aux_weight * F.binary_cross_entropy_with_logits(
                    perm_logits[sel], perm.to(device)[sel])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()

        model.eval()
        inter_union = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, flood, _, _ in val_loader:
                x, flood = x.to(device), flood.to(device)
                pred = model.module(x)[0].argmax(1)
                valid = flood >= 0
                p, t = (pred == 1) & valid, (flood == 1) & valid
                inter_union += torch.stack([(p & t).sum(), (p | t).sum()]).double()
        dist.all_reduce(inter_union)
        iou = (inter_union[0] / inter_union[1].clamp(min=1)).item()
        if local_rank == 0:
            print(f"epoch {epoch}: flood IoU {iou:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "iou": iou}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if iou > best_iou:
                best_iou = iou
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/s1floods")
    ap.add_argument("--out", default="runs/s1flood")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--encoder", default="resnet34")
    ap.add_argument("--pretrained", default="")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4, help="per GPU")
    ap.add_argument("--flood-weight", type=float, default=3.0)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    assert 0 < args.gpus <= torch.cuda.device_count(), "not enough visible GPUs"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
