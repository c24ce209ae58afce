"""Burn-scar change segmentation from HLS (Harmonized Landsat Sentinel-2) pre/post fire.

Chips are stored raw (uint16 reflectance, 6 bands x 2 dates) in WebDataset-style
tar shards; decoding is cheap, so normalisation, dNBR and the augmentations run
on the GPU to keep the data loader light.
Fires are split by fire ID (MTBS) into train / val, see fires_split.csv.

    torchrun --nproc_per_node=8 20_hls_burn_scar_gpu_aug.py --data /data/hls_burn --epochs 60
"""
import argparse
import csv
import io
import json
import os
import tarfile
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

NB = 6              # B, G, R, NIR, SWIR1, SWIR2
NIR, SWIR2 = 3, 5


class ShardedChips(Dataset):
    """Random access into tar shards through a (shard, member) index."""

    def __init__(self, root, fire_ids):
        self.items = []
        with open(os.path.join(root, "index.csv")) as f:
            for r in csv.DictReader(f):
                if r["fire_id"] in fire_ids:
                    self.items.append((os.path.join(root, r["shard"]), r["member"]))
        self._tars = {}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        shard, member = self.items[i]
        if shard not in self._tars:
            self._tars[shard] = tarfile.open(shard)
        z = np.load(io.BytesIO(self._tars[shard].extractfile(member).read()))
        x = np.concatenate([z["pre"], z["post"]], 0).astype(np.int32)   # raw DN, normalised on GPU
        return torch.from_numpy(x), torch.from_numpy(z["burn"].astype(np.int64))


def load_band_stats(path, device="cuda:0"):
    with open(path) as f:
        s = json.load(f)
    mean = torch.tensor(s["mean"] * 2, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std = torch.tensor(s["std"] * 2, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return mean, std


def gpu_prepare(x, y, mean, std, train):
    x = x.float() * 1e-4
    pre, post = x[:, :NB], x[:, NB:]
    nbr = lambda s: (s[:, NIR] - s[:, SWIR2]) / (s[:, NIR] + s[:, SWIR2] + 1e-6)
    dnbr = (nbr(pre) - nbr(post)).unsqueeze(1)
    x = torch.cat([(x - mean) / std, dnbr], 1)
    if train:
        # per-sample flips / 90 degree rotations on the GPU
        flip = torch.rand(x.shape[0], device=x.device) < 0.5
        x[flip], y[flip] = x[flip].flip(-1), y[flip].flip(-1)
        k = int(torch.randint(0, 4, (1,)))
        x, y = torch.rot90(x, k, (2, 3)), torch.rot90(y, k, (1, 2))
        # brightness jitter on the post-fire date only
        x[:, NB:2 * NB] *= 1 + 0.1 * torch.randn(x.shape[0], 1, 1, 1, device=x.device)
    return x.contiguous(), y.contiguous()


@torch.no_grad()
def evaluate(net, loader, mean, std, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = gpu_prepare(x.to(device), y.to(device), mean, std, train=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = net(x).argmax(1) == 1
        m = y != 255
        t = y == 1
        s += torch.stack([(p & t & m).sum(), (p & ~t & m).sum(), (~p & t & m).sum()]).double()
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    return 2 * tp / max(1.0, 2 * tp + fp + fn), tp / max(1.0, tp + fp + fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/hls_burn")
    ap.add_argument("--arch", default="UnetPlusPlus")
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 256")
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    split = {"train": set(), "val": set()}
    with open(os.path.join(args.data, "fires_split.csv")) as f:
        for r in csv.DictReader(f):
            split[r["split"]].add(r["fire_id"])
    train_ds, val_ds = ShardedChips(args.data, split["train"]), ShardedChips(args.data, split["val"])
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size,
                        num_workers=args.workers, pin_memory=True)
    mean, std = load_band_stats(os.path.join(args.data, "band_stats.json"))

    net = getattr(smp, args.arch)(args.encoder, encoder_weights=None, in_channels=2 * NB + 1, classes=2)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=lr * 0.01)
    cls_w = torch.tensor([1.0, 2.5], device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(split['train'])} train fires ({len(train_ds)} chips), "
              f"{len(split['val'])} val fires ({len(val_ds)} chips)", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = gpu_prepare(x.to(device, non_blocking=True), y.to(device, non_blocking=True), mean, std, train=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, weight=cls_w, ignore_index=255)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        f1, iou = evaluate(net, val_dl, mean, std, device)
        if rank == 0:
            print(f"epoch {epoch}: val F1 {f1:.4f} IoU {iou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if f1 > best:
                best = f1
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
