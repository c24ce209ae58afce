"""
Landslide4Sense: binary landslide segmentation on 14-band 128x128 patches
(Sentinel-2 + slope + DEM) with a SegFormer-B2 trained from scratch for 14 channels.

Jobs on our cluster are pre-empted every 12h, so the script resumes from the
last checkpoint:

    torchrun --nproc_per_node=4 16_landslide_segformer_resume.py --data /data/landslide4sense \
        --resume runs/segformer_l4s/last.pth
"""
import argparse
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import SegformerConfig, SegformerForSemanticSegmentation

MEAN = np.array([-0.4914, -0.3074, -0.1277, -0.0625, 0.0439, 0.0803, 0.0644, 0.0802,
                 0.3000, 0.4082, 0.0823, 0.0516, 0.3338, 0.7819], dtype=np.float32)
STD = np.array([0.9325, 0.8775, 0.8860, 0.8869, 0.8857, 0.8418, 0.8354, 0.8491,
                0.9061, 1.6072, 0.8848, 0.9232, 0.9018, 1.2913], dtype=np.float32)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/landslide4sense")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--out", default="runs/segformer_l4s")
    p.add_argument("--resume", default="")
    p.add_argument("--save_every", type=int, default=2)
    return p.parse_args()


class L4SDataset(Dataset):
    def __init__(self, files, train):
        self.files = files
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img_path = self.files[i]
        mask_path = img_path.replace("img", "mask").replace("image_", "mask_")
        with h5py.File(img_path, "r") as f:
            img = f["img"][()].astype(np.float32)       # (128, 128, 14)
        with h5py.File(mask_path, "r") as f:
            mask = f["mask"][()].astype(np.int64)       # (128, 128)
        img = ((img - MEAN) / STD).transpose(2, 0, 1)
        if self.train:
            if np.random.rand() < 0.5:
                img, mask = img[:, :, ::-1], mask[:, ::-1]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1, :], mask[::-1, :]
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


def build_model():
    cfg = SegformerConfig.from_pretrained("nvidia/mit-b2")
    cfg.num_channels = 14
    cfg.num_labels = 2
    return SegformerForSemanticSegmentation(cfg)


def seg_loss(logits, mask):
    logits = F.interpolate(logits, size=mask.shape[-2:], mode="bilinear", align_corners=False)
    ce = F.cross_entropy(logits, mask, weight=torch.tensor([1.0, 4.0], device=logits.device))
    prob = logits.softmax(1)[:, 1]
    inter = (prob * (mask == 1)).sum()
    dice = 1 - (2 * inter + 1) / (prob.sum() + (mask == 1).sum() + 1)
    return ce + dice, logits


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data, "TrainData", "img", "*.h5")))
    rng = np.random.RandomState(0)
    perm = rng.permutation(len(files))
    n_val = len(files) // 10
    train_files = [files[i] for i in perm[n_val:]]
    val_files = [files[i] for i in perm[:n_val]]

    train_ds = L4SDataset(train_files, train=True)
    val_ds = Subset(L4SDataset(val_files, train=False), range(rank, n_val, world))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=32, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=0.01)
    total_iters = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / total_iters) ** 1.0)

    start_epoch, best_f1 = 0, 0.0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_f1 = ckpt.get("best_f1", 0.0)
        if rank == 0:
            print(f"=> resumed from {args.resume} (epoch {ckpt['epoch']})")
        del ckpt

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(pixel_values=img).logits
            loss, _ = seg_loss(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        # precision / recall / F1 of the landslide class, summed over ranks
        model.eval()
        tp_fp_fn = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, mask in val_dl:
                img, mask = img.to(device), mask.to(device)
                logits = model.module(pixel_values=img).logits
                pred = F.interpolate(logits, size=mask.shape[-2:], mode="bilinear").argmax(1)
                tp_fp_fn[0] += ((pred == 1) & (mask == 1)).sum()
                tp_fp_fn[1] += ((pred == 1) & (mask == 0)).sum()
                tp_fp_fn[2] += ((pred == 0) & (mask == 1)).sum()
        dist.all_reduce(run)
        dist.all_reduce(tp_fp_fn)
        tp, fp, fn = tp_fp_fn.tolist()
        prec, rec = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-8)

        if rank == 0:
            print(f"epoch {epoch:03d} loss {(run[0] / run[1]).item():.4f} P {prec:.3f} R {rec:.3f} F1 {f1:.4f} "
                  f"[{time.time() - t0:.0f}s]")
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best_f1": max(best_f1, f1)}
            if (epoch + 1) % args.save_every == 0:
                torch.save(state, os.path.join(args.out, "last.pth"))
            if f1 > best_f1:
                torch.save(state, os.path.join(args.out, "best.pth"))
        best_f1 = max(best_f1, f1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
