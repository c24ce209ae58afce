"""BEVFormer-lite: learnable BEV queries + spatial cross-attention (grid-sample variant)
for nuScenes HD-map segmentation (drivable / ped_crossing / walkway / divider).

    torchrun --nproc_per_node=8 04_bevformer_lite_mapseg.py --work-dir /nfs/exp/bevformer_lite
"""
import argparse
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["drivable_area", "ped_crossing", "walkway", "divider"]
IMG_H, IMG_W = 256, 704


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/nfs/datasets/nuscenes")
    p.add_argument("--ann-train", default="/nfs/datasets/nuscenes/bevformer_infos_train.pkl")
    p.add_argument("--ann-val", default="/nfs/datasets/nuscenes/bevformer_infos_val.pkl")
    p.add_argument("--work-dir", default="/nfs/exp/bevformer_lite")
    p.add_argument("--bev-size", type=int, default=50)
    p.add_argument("--embed-dims", type=int, default=256)
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--samples-per-gpu", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4, help="for 8 GPUs x 1 sample")
    p.add_argument("--workers-per-gpu", type=int, default=4)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--eval-interval", type=int, default=2)
    return p.parse_args()


class NuScenesMapSeg(Dataset):
    def __init__(self, data_root, ann_file, train):
        with open(ann_file, "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.data_root = data_root
        self.train = train
        self.mean = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
        self.std = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, lidar2img = [], []
        for cam in info["cams"].values():
            img = Image.open(os.path.join(self.data_root, cam["data_path"])).convert("RGB")
            sx, sy = IMG_W / img.width, IMG_H / img.height
            img = img.resize((IMG_W, IMG_H), Image.BILINEAR)
            if self.train:
                img = torchvision.transforms.functional.adjust_brightness(img, np.random.uniform(0.8, 1.2))
            t = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)
            imgs.append((t - self.mean) / self.std)
            scale = np.diag([sx, sy, 1.0, 1.0]).astype(np.float32)
            lidar2img.append(torch.from_numpy(scale @ np.asarray(cam["lidar2img"], dtype=np.float32)))
        seg = np.load(os.path.join(self.data_root, info["map_mask_path"]))  # (4, 100, 100) uint8
        return torch.stack(imgs), torch.stack(lidar2img), torch.from_numpy(seg).float()


class FrozenBNBackbone(nn.Module):
    def __init__(self, out_dims):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool)
        self.layers = nn.Sequential(r50.layer1, r50.layer2, r50.layer3)
        self.neck = nn.Sequential(nn.Conv2d(1024, out_dims, 1), nn.GroupNorm(32, out_dims))
        for p in self.stem.parameters():
            p.requires_grad_(False)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():  # norm_eval: keep ImageNet statistics
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, x):
        return self.neck(self.layers(self.stem(x)))


class SpatialCrossAttnLite(nn.Module):
    def __init__(self, dims, bev_size, pc_range=(-51.2, -51.2, -5.0, 51.2, 51.2, 3.0), num_z=4):
        super().__init__()
        xs = torch.linspace(pc_range[0], pc_range[3], bev_size)
        ys = torch.linspace(pc_range[1], pc_range[4], bev_size)
        zs = torch.linspace(pc_range[2], pc_range[5], num_z)
        gy, gx, gz = torch.meshgrid(ys, xs, zs, indexing="ij")
        ref = torch.stack([gx, gy, gz, torch.ones_like(gx)], -1).view(-1, 4)
        self.register_buffer("ref_3d", ref, persistent=False)  # (HW*Z, 4)
        self.num_z = num_z
        self.value_proj = nn.Conv2d(dims, dims, 1)
        self.out_proj = nn.Linear(dims, dims)

    def forward(self, query, feats, lidar2img):
        B, N, C, h, w = feats.shape
        with torch.autocast("cuda", enabled=False):  # projection in fp32
            cam = torch.einsum("bnij,pj->bnpi", lidar2img.float(), self.ref_3d)
            depth = cam[..., 2:3]
            uv = cam[..., :2] / depth.clamp(min=1e-5)
            uv = torch.stack([uv[..., 0] / IMG_W, uv[..., 1] / IMG_H], -1) * 2 - 1
            valid = (depth[..., 0] > 1e-5) & (uv.abs() <= 1).all(-1)
        grid = uv.view(B * N, -1, self.num_z, 2)
        value = self.value_proj(feats.flatten(0, 1))
        sampled = F.grid_sample(value, grid.to(value.dtype), align_corners=False)  # (BN, C, HW, Z)
        sampled = sampled.view(B, N, C, -1, self.num_z)
        vmask = valid.view(B, N, 1, -1, self.num_z).to(sampled.dtype)
        agg = (sampled * vmask).sum((1, 4)) / vmask.sum((1, 4)).clamp(min=1.0)
        return query + self.out_proj(agg.transpose(1, 2))


class BEVFormerLite(nn.Module):
    def __init__(self, dims=256, bev_size=50, num_layers=3, num_classes=4):
        super().__init__()
        self.bev_size = bev_size
        self.backbone = FrozenBNBackbone(dims)
        self.bev_queries = nn.Parameter(torch.randn(bev_size * bev_size, dims) * 0.02)
        self.bev_pos = nn.Parameter(torch.randn(bev_size * bev_size, dims) * 0.02)
        self.sca = nn.ModuleList([SpatialCrossAttnLite(dims, bev_size) for _ in range(num_layers)])
        self.self_attn = nn.ModuleList([nn.TransformerEncoderLayer(dims, 8, dims * 2, 0.1, batch_first=True,
                                                                   norm_first=True) for _ in range(num_layers)])
        self.head = nn.Sequential(
            nn.Conv2d(dims, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU(inplace=True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(128, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU(inplace=True),
            nn.Conv2d(128, num_classes, 1))

    def forward(self, imgs, lidar2img):
        B, N = imgs.shape[:2]
        feats = self.backbone(imgs.flatten(0, 1))
        feats = feats.view(B, N, *feats.shape[1:])
        bev = self.bev_queries.unsqueeze(0).expand(B, -1, -1)
        for sca, sa in zip(self.sca, self.self_attn):
            bev = sa(bev + self.bev_pos)
            bev = sca(bev, feats, lidar2img)
        bev = bev.transpose(1, 2).reshape(B, -1, self.bev_size, self.bev_size)
        return self.head(bev)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    inter = torch.zeros(len(CLASSES), device=device, dtype=torch.float64)
    union = torch.zeros_like(inter)
    for imgs, l2i, seg in loader:
        imgs, l2i, seg = imgs.to(device), l2i.to(device), seg.to(device)
        with autocast():
            pred = net(imgs, l2i).sigmoid() > 0.5
        gt = seg > 0.5
        inter += (pred & gt).sum((0, 2, 3)).double()
        union += (pred | gt).sum((0, 2, 3)).double()
    dist.all_reduce(inter)
    dist.all_reduce(union)
    net.train()
    return (inter / union.clamp(min=1)).tolist()


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", local_rank)

    train_ds = NuScenesMapSeg(args.data_root, args.ann_train, train=True)
    val_ds = NuScenesMapSeg(args.data_root, args.ann_val, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.samples_per_gpu, sampler=sampler,
                              num_workers=args.workers_per_gpu, pin_memory=True, drop_last=True)
    val_subset = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_subset, batch_size=1, num_workers=args.workers_per_gpu, pin_memory=True)

    net = BEVFormerLite(args.embed_dims, args.bev_size, num_classes=len(CLASSES)).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world_size * args.samples_per_gpu / 8
    params = [
        {"params": [p for n, p in net.named_parameters() if p.requires_grad and n.startswith("backbone.")],
         "lr": lr * 0.1},
        {"params": [p for n, p in net.named_parameters() if p.requires_grad and not n.startswith("backbone.")]},
    ]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + np.cos(np.pi * s / total)))
    scaler = GradScaler()
    pos_weight = torch.tensor([1.0, 3.0, 2.0, 4.0], device=device).view(1, -1, 1, 1)

    start_epoch = 0
    if args.resume_from:
        checkpoint = torch.load(args.resume_from)
        net.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume_from} at epoch {start_epoch}")

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        log_file = open(os.path.join(args.work_dir, "log.jsonl"), "a")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_start = time.time()
        for it, (imgs, l2i, seg) in enumerate(train_loader):
            imgs, l2i, seg = imgs.to(device, non_blocking=True), l2i.to(device), seg.to(device)
            with autocast():
                logits = model(imgs, l2i)
            loss = F.binary_cross_entropy_with_logits(logits.float(), seg, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 50 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rec = {"epoch": epoch, "iter": it, "loss": loss_avg.item(), "lr": scheduler.get_last_lr()[1],
                           "time": time.time() - t_start}
                    log_file.write(json.dumps(rec) + "\n")
                    log_file.flush()

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            ious = evaluate(net, val_loader, device)
            if rank == 0:
                rec = {"epoch": epoch, **{f"iou_{c}": v for c, v in zip(CLASSES, ious)}, "mIoU": float(np.mean(ious))}
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                print(rec)
        if rank == 0:
            torch.save({"state_dict": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, "latest.pth"))
        dist.barrier()

    if rank == 0:
        log_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
