"""S3D on Something-Something-V2, class ids built from the annotation templates.

The webm files are decoded on the fly with PyAV (no frame extraction step). 16 frames are
sampled uniformly over the whole video (TSN-style segments, one frame per segment).

  torchrun --nproc_per_node=8 12_s3d_ssv2_template_labels.py --root /data/ssv2 --epochs 40
"""
import argparse
import json
import os
import random
import time

import av
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models.video import S3D_Weights, s3d

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


def template_key(template):
    return template.replace("[", "").replace("]", "").strip()


def build_label_map(train_json):
    with open(train_json) as f:
        anns = json.load(f)
    templates = list({template_key(a["template"]) for a in anns})
    return {t: i for i, t in enumerate(templates)}


class SSV2(Dataset):
    def __init__(self, root, split, label_map, num_frames=16, train=True):
        with open(os.path.join(root, "labels", f"{split}.json")) as f:
            anns = json.load(f)
        self.samples = [(os.path.join(root, "videos", f"{a['id']}.webm"), label_map[template_key(a["template"])])
                        for a in anns]
        self.num_frames, self.train = num_frames, train

    def __len__(self):
        return len(self.samples)

    def _frames(self, path):
        with av.open(path) as c:
            c.streams.video[0].thread_type = "AUTO"
            return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]

    def __getitem__(self, i):
        path, label = self.samples[i]
        frames = self._frames(path)
        n = len(frames)
        seg = n / self.num_frames
        if self.train:
            idx = [min(int(seg * k + random.random() * seg), n - 1) for k in range(self.num_frames)]
        else:
            idx = [min(int(seg * (k + 0.5)), n - 1) for k in range(self.num_frames)]
        x = torch.from_numpy(np.stack([frames[k] for k in idx])).permute(3, 0, 1, 2).float() / 255.0
        x = F.interpolate(x, size=(256, int(256 * x.shape[-1] / x.shape[-2])), mode="bilinear",
                          align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            # multi-scale crop, no flipping (left/right matters for SSv2 labels)
            s = random.choice([256, 224, 192, 168])
            y0, x0 = random.randint(0, h - s), random.randint(0, w - s)
            x = F.interpolate(x[..., y0:y0 + s, x0:x0 + s], size=(224, 224), mode="bilinear",
                              align_corners=False)
        else:
            x = x[..., (h - 224) // 2:(h - 224) // 2 + 224, (w - 224) // 2:(w - 224) // 2 + 224]
        return (x - MEAN) / STD, label


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.04)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--ckpt-dir", default="ckpt/s3d_ssv2")
    p.add_argument("--resume", default="")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    res = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        res[0] += (top5[:, 0] == y).sum()
        res[1] += (top5 == y[:, None]).any(1).sum()
        res[2] += y.numel()
    dist.all_reduce(res)
    return (100 * res[0] / res[2]).item(), (100 * res[1] / res[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(rank)
    torch.manual_seed(0)

    label_map = build_label_map(os.path.join(args.root, "labels", "train.json"))
    num_classes = len(label_map)  # 174
    train_set = SSV2(args.root, "train", label_map, train=True)
    val_set = SSV2(args.root, "validation", label_map, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = s3d(weights=S3D_Weights.KINETICS400_V1)
    model.classifier[1] = nn.Conv3d(1024, num_classes, kernel_size=1, stride=1, bias=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    iters = len(train_loader)
    warmup = 2 * iters
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * iters - warmup)],
        milestones=[warmup])
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if i % 100 == 0 and rank == 0:
                print(f"ep {epoch} {i}/{iters} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        top1, top5 = evaluate(model.module, val_loader, device)
        if rank == 0:
            best = max(best, top1)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} best {best:.2f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best, "label_map": label_map},
                       os.path.join(args.ckpt_dir, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
