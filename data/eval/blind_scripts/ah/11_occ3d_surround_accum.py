"""Camera-only 3D semantic occupancy (Occ3D-nuScenes, 18 classes incl. free) - voxel-query baseline.

Voxel centres are projected into the six cameras and bilinearly sample image features,
then a 3D conv decoder predicts per-voxel semantics at 200x200x16.

    torchrun --nproc_per_node=8 train_occ.py --data-root data/occ3d-nus --bs 1 --accum 2 --bf16
"""
import argparse
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 18
FREE = 17
PC_RANGE = [-40.0, -40.0, -1.0, 40.0, 40.0, 5.4]
OCC_SIZE = (200, 200, 16)
IMG_SIZE = (256, 704)
CAMS = ["CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT"]


class Occ3DNuScenes(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"occ_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.root, self.train = root, train
        self.mean = torch.tensor([123.675, 116.28, 103.53])[:, None, None]
        self.std = torch.tensor([58.395, 57.12, 57.375])[:, None, None]

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, lidar2img = [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.root, c["data_path"])).convert("RGB")
            sx, sy = IMG_SIZE[1] / img.width, IMG_SIZE[0] / img.height
            img = img.resize((IMG_SIZE[1], IMG_SIZE[0]), Image.BILINEAR)
            x = torch.from_numpy(np.asarray(img, np.float32).copy()).permute(2, 0, 1)
            if self.train:
                x = x * np.random.uniform(0.8, 1.2) + np.random.uniform(-20, 20)
            imgs.append((x - self.mean) / self.std)
            K = np.eye(4, dtype=np.float32)
            K[:3, :3] = c["cam_intrinsic"]
            K[0] *= sx
            K[1] *= sy
            l2c = np.linalg.inv(c["cam2lidar"]).astype(np.float32)
            lidar2img.append(K @ l2c)
        occ = np.load(os.path.join(self.root, info["occ_path"]))
        return {"imgs": torch.stack(imgs), "lidar2img": torch.from_numpy(np.stack(lidar2img)),
                "semantics": torch.from_numpy(occ["semantics"].astype(np.int64)),
                "mask_camera": torch.from_numpy(occ["mask_camera"].astype(bool))}


class ImageEncoder(nn.Module):
    def __init__(self, out_ch=128):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.layer2, self.layer3 = r.layer2, r.layer3
        self.lat2, self.lat3 = nn.Conv2d(512, out_ch, 1), nn.Conv2d(1024, out_ch, 1)
        self.out = nn.Sequential(nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU())

    def forward(self, x):
        c2 = self.layer2(self.stem(x))
        c3 = self.layer3(c2)
        p = self.lat2(c2) + F.interpolate(self.lat3(c3), size=c2.shape[-2:], mode="bilinear", align_corners=False)
        return self.out(p)  # stride 8


class Res3D(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(c, c, 3, 1, 1, bias=False), nn.GroupNorm(16, c), nn.ReLU(True),
                                  nn.Conv3d(c, c, 3, 1, 1, bias=False), nn.GroupNorm(16, c))

    def forward(self, x):
        return F.relu(x + self.body(x))


class VoxelQueryOcc(nn.Module):
    def __init__(self, c=128, coarse=(100, 100, 8), use_ckpt=True):
        super().__init__()
        self.enc = ImageEncoder(c)
        X, Y, Z = coarse
        xs = torch.linspace(PC_RANGE[0], PC_RANGE[3], X + 1)[:-1] + (PC_RANGE[3] - PC_RANGE[0]) / X / 2
        ys = torch.linspace(PC_RANGE[1], PC_RANGE[4], Y + 1)[:-1] + (PC_RANGE[4] - PC_RANGE[1]) / Y / 2
        zs = torch.linspace(PC_RANGE[2], PC_RANGE[5], Z + 1)[:-1] + (PC_RANGE[5] - PC_RANGE[2]) / Z / 2
        grid = torch.stack(torch.meshgrid(xs, ys, zs, indexing="ij"), -1).view(-1, 3)
        self.register_buffer("ref", torch.cat([grid, torch.ones(len(grid), 1)], 1), persistent=False)
        self.coarse = coarse
        self.blocks = nn.ModuleList([Res3D(c) for _ in range(4)])
        self.up = nn.Sequential(nn.ConvTranspose3d(c, 64, 2, 2, bias=False), nn.BatchNorm3d(64), nn.ReLU(True))
        self.cls = nn.Conv3d(64, NUM_CLASSES, 1)
        self.use_ckpt = use_ckpt

    def lift(self, feats, lidar2img):
        B, N, C, h, w = feats.shape
        pts = torch.einsum("bnij,vj->bnvi", lidar2img, self.ref)
        depth = pts[..., 2:3]
        uv = pts[..., :2] / depth.clamp(min=1e-5)
        uv = torch.stack([uv[..., 0] / IMG_SIZE[1], uv[..., 1] / IMG_SIZE[0]], -1) * 2 - 1
        valid = ((depth[..., 0] > 1e-5) & (uv.abs() <= 1).all(-1)).float()
        sampled = F.grid_sample(feats.flatten(0, 1), uv.flatten(0, 1)[:, None], align_corners=False)
        sampled = sampled.view(B, N, C, -1) * valid[:, :, None]
        vox = sampled.sum(1) / valid.sum(1).clamp(min=1)[:, None]
        return vox.view(B, C, *self.coarse)

    def forward(self, imgs, lidar2img):
        B, N = imgs.shape[:2]
        f = self.enc(imgs.flatten(0, 1))
        x = self.lift(f.view(B, N, *f.shape[1:]), lidar2img)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.use_ckpt and self.training else blk(x)
        return self.cls(self.up(x))  # B, C, 200, 200, 16


def occ_loss(logits, sem, mask, weight):
    ce = F.cross_entropy(logits.float(), sem, weight=weight, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def eval_miou(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.float64, device=device)
    for b in loader:
        logits = model(b["imgs"].to(device), b["lidar2img"].to(device))
        pred = logits.argmax(1)
        sem, m = b["semantics"].to(device), b["mask_camera"].to(device)
        idx = sem[m] * NUM_CLASSES + pred[m]
        hist += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    model.train()
    return iou[:FREE].mean().item(), iou.cpu().tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/occ3d-nus")
    ap.add_argument("--work-dir", default="work_dirs/voxelquery_occ")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 16")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    train_ds = Occ3DNuScenes(args.data_root, "train", True)
    val_ds = Occ3DNuScenes(args.data_root, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 1,
                        num_workers=args.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(VoxelQueryOcc()).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_batch = args.bs * args.accum * world
    lr = args.lr * global_batch / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.05, anneal_strategy="cos")
    cls_w = torch.ones(NUM_CLASSES, device=device)
    cls_w[FREE] = 0.5
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float32

    start_epoch = 0
    ck_path = os.path.join(args.work_dir, "latest.pth")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        n_iters = steps_per_epoch * args.accum
        for it, b in enumerate(train_dl):
            if it >= n_iters:
                break
            imgs, l2i = b["imgs"].to(device, non_blocking=True), b["lidar2img"].to(device, non_blocking=True)
            sem, mask = b["semantics"].to(device), b["mask_camera"].to(device).float()
            sync_now = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=args.bf16):
                    logits = model(imgs, l2i)
                loss = occ_loss(logits, sem, mask, cls_w) / args.accum
                loss.backward()
            if sync_now:
                gn = nn.utils.clip_grad_norm_(model.parameters(), 35.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0 and (it // args.accum) % 50 == 0:
                    print(f"[{epoch}][{it // args.accum}/{steps_per_epoch}] loss {loss.item() * args.accum:.4f} "
                          f"gnorm {gn:.2f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        miou, ious = eval_miou(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: mIoU {miou * 100:.2f}", flush=True)
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "miou": miou, "ious": ious},
                       ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
