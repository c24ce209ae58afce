"""Frame-level VQA baseline: train on KoNViD-1k, cross-dataset test on LIVE-VQC.

8 frames per video are scored by a shared 2-D ConvNeXt-T + MLP and averaged
(with a learned temporal attention). Decoding is the bottleneck, so test videos
are split between ranks with no repeats and the per-video predictions are
gathered on every rank for SRCC/PLCC.

    torchrun --nproc_per_node=4 15_ugc_vqa_crossdataset.py \
        --train-root /data/KoNViD_1k --train-csv KoNViD_1k_mos.csv \
        --test-root /data/LIVE-VQC --test-csv livevqc_mos.csv
"""
import argparse
import os

import av
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import curve_fit
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def read_frames(path, n_frames, size, train):
    with av.open(path) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    total = len(frames)
    if train:
        seg = np.linspace(0, total, n_frames + 1).astype(int)
        idx = [np.random.randint(seg[k], max(seg[k] + 1, seg[k + 1])) for k in range(n_frames)]
    else:
        idx = np.linspace(0, total - 1, n_frames).astype(int)
    clip = torch.from_numpy(np.stack([frames[i] for i in idx])).permute(0, 3, 1, 2).float() / 255.0
    clip = F.interpolate(clip, size=size, mode="bilinear", align_corners=False, antialias=True)
    return (clip - MEAN) / STD


class VideoMOS(Dataset):
    def __init__(self, root, csv, n_frames=8, size=(288, 512), train=True, mos_range=(1, 5)):
        df = pd.read_csv(os.path.join(root, csv))
        self.paths = [os.path.join(root, "videos", v) for v in df["file"]]
        lo, hi = mos_range
        self.mos = ((df["mos"].values - lo) / (hi - lo)).astype(np.float32)
        self.n_frames, self.size, self.train = n_frames, size, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return read_frames(self.paths[i], self.n_frames, self.size, self.train), self.mos[i]


class FrameVQA(nn.Module):
    def __init__(self, arch="convnext_tiny.fb_in22k_ft_in1k"):
        super().__init__()
        self.enc = timm.create_model(arch, pretrained=True, num_classes=0)
        d = self.enc.num_features
        self.q = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, 1))
        self.att = nn.Linear(d, 1)

    def forward(self, clip):
        b, t = clip.shape[:2]
        f = self.enc(clip.flatten(0, 1)).view(b, t, -1)
        w = torch.softmax(self.att(f).squeeze(-1), dim=1)
        q = self.q(f).squeeze(-1)
        return (w * q).sum(1)


def logistic4(x, b1, b2, b3, b4):
    return (b1 - b2) / (1 + np.exp(-(x - b3) / abs(b4))) + b2


def fitted_plcc(pred, mos):
    try:
        beta, _ = curve_fit(logistic4, pred, mos, p0=[mos.max(), mos.min(), pred.mean(), pred.std() + 1e-3],
                            maxfev=10000)
        return pearsonr(logistic4(pred, *beta), mos)[0]
    except RuntimeError:
        return pearsonr(pred, mos)[0]


@torch.no_grad()
def cross_test(model, ds, device, workers):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(ds), world))
    loader = DataLoader(Subset(ds, mine), batch_size=2, num_workers=workers, pin_memory=True)
    model.eval()
    preds, gts = [], []
    for clip, mos in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds.append(model(clip.to(device, non_blocking=True)).float())
        gts.append(mos.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(gts)], 1)
    everything = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(everything, local)
    arr = torch.cat(everything).cpu().numpy()
    model.train()
    return spearmanr(arr[:, 0], arr[:, 1])[0], fitted_plcc(arr[:, 0], arr[:, 1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-root", required=True)
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--test-root", required=True)
    ap.add_argument("--test-csv", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--ckpt", default="ckpt/konvid_framevqa.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    train_ds = VideoMOS(args.train_root, args.train_csv, train=True)
    test_ds = VideoMOS(args.test_root, args.test_csv, train=False, mos_range=(0, 100))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, prefetch_factor=4)

    model = DDP(FrameVQA().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for clip, mos in loader:
            clip, mos = clip.to(device, non_blocking=True), mos.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(clip).float()
            # L1 + in-batch hinge ranking
            dp = pred[:, None] - pred[None]
            dm = mos[:, None] - mos[None]
            loss = F.l1_loss(pred, mos) + F.relu(-dp * torch.sign(dm)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        srcc, plcc = cross_test(model, test_ds, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch}: loss {tot[0] / tot[1]:.4f}  LIVE-VQC SRCC {srcc:.4f} PLCC {plcc:.4f}",
                  flush=True)
            if srcc > best:
                best = srcc
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
