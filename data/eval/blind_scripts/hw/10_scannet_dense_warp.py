"""Dense matcher (global correlation + warp regression) on ScanNet RGB-D pairs.

    torchrun --standalone --nproc_per_node=4 10_scannet_dense_warp.py \
        --scannet /data/scannet/scans --index /data/scannet/index/scene_data/train --out ckpt/dense_warp_scannet
"""
import argparse
import glob
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

IMG_H, IMG_W = 480, 640


class ScanNetPairs(Dataset):
    def __init__(self, scannet_root, npz_path, min_score=0.4):
        z = np.load(npz_path)
        names, scores = z["name"], z["score"]
        self.names = names[scores > min_score]
        self.root = scannet_root

    def __len__(self):
        return len(self.names)

    def _frame(self, scene, sub, idx):
        d = os.path.join(self.root, f"scene{scene:04d}_{sub:02d}")
        img = cv2.imread(os.path.join(d, "color", f"{idx}.jpg"))[..., ::-1]
        img = cv2.resize(img, (IMG_W, IMG_H)).astype(np.float32) / 255.0
        depth = cv2.imread(os.path.join(d, "depth", f"{idx}.png"), cv2.IMREAD_UNCHANGED).astype(np.float32) / 1000.0
        depth = cv2.resize(depth, (IMG_W, IMG_H), interpolation=cv2.INTER_NEAREST)
        pose = np.loadtxt(os.path.join(d, "pose", f"{idx}.txt"))  # camera-to-world
        K = np.loadtxt(os.path.join(d, "intrinsic", "intrinsic_depth.txt"))[:3, :3]
        return img, depth, pose, K

    def __getitem__(self, i):
        scene, sub, a, b = self.names[i]
        im0, d0, P0, K0 = self._frame(scene, sub, a)
        im1, d1, P1, K1 = self._frame(scene, sub, b)
        T_0to1 = np.linalg.inv(P1) @ P0
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).float()
        return {"im0": t(im0).permute(2, 0, 1), "im1": t(im1).permute(2, 0, 1), "d0": t(d0), "d1": t(d1),
                "K0": t(K0), "K1": t(K1), "T_0to1": t(T_0to1)}


def build(scannet_root, index_dir):
    files = sorted(glob.glob(os.path.join(index_dir, "*.npz")))
    return ConcatDataset([ScanNetPairs(scannet_root, f) for f in files])


@torch.no_grad()
def gt_warp(d0, d1, K0, K1, T_0to1, stride=8):
    """Ground-truth location in image 1 (pixels) of every stride-th pixel of image 0 + validity."""
    b = d0.size(0)
    h, w = IMG_H // stride, IMG_W // stride
    ys, xs = torch.meshgrid(torch.arange(h, device=d0.device), torch.arange(w, device=d0.device), indexing="ij")
    px = torch.stack([xs, ys], -1).float() * stride + stride / 2 - 0.5
    z0 = d0[:, px[..., 1].long(), px[..., 0].long()]
    hom = torch.cat([px, torch.ones_like(px[..., :1])], -1)[None].expand(b, -1, -1, -1)
    cam0 = torch.einsum("bij,bhwj->bhwi", torch.linalg.inv(K0), hom) * z0[..., None]
    cam1 = torch.einsum("bij,bhwj->bhwi", T_0to1[:, :3, :3], cam0) + T_0to1[:, None, None, :3, 3]
    uv = torch.einsum("bij,bhwj->bhwi", K1, cam1)
    uv = uv[..., :2] / uv[..., 2:].clamp(min=1e-6)
    inside = (uv[..., 0] >= 0) & (uv[..., 0] <= IMG_W - 1) & (uv[..., 1] >= 0) & (uv[..., 1] <= IMG_H - 1)
    ui = uv[..., 0].round().long().clamp(0, IMG_W - 1)
    vi = uv[..., 1].round().long().clamp(0, IMG_H - 1)
    z1 = torch.stack([d1[k, vi[k], ui[k]] for k in range(b)])
    consistent = (z1 - cam1[..., 2]).abs() < 0.05 * z1.clamp(min=1e-3)
    return uv, (z0 > 0) & (z1 > 0) & inside & consistent


class DenseWarp(nn.Module):
    def __init__(self, dim=256, temp=0.02):
        super().__init__()
        r = torchvision.models.resnet18()
        self.enc = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2)  # stride 8, 128 ch
        self.proj = nn.Conv2d(128, dim, 1)
        self.refine = nn.Sequential(nn.Conv2d(2 * dim + 2, 256, 3, padding=1), nn.ReLU(True),
                                    nn.Conv2d(256, 128, 3, padding=1), nn.ReLU(True), nn.Conv2d(128, 3, 3, padding=1))
        self.temp = temp
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406])[:, None, None])
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225])[:, None, None])

    def forward(self, im0, im1):
        b = im0.size(0)
        f = self.proj(self.enc((torch.cat([im0, im1]) - self.mean) / self.std))
        f = F.normalize(f, dim=1)
        f0, f1 = f[:b], f[b:]
        _, c, h, w = f0.shape
        corr = torch.einsum("bchw,bcxy->bhwxy", f0, f1).reshape(b, h, w, h * w) / self.temp
        prob = corr.softmax(-1)
        ys, xs = torch.meshgrid(torch.arange(h, device=f.device), torch.arange(w, device=f.device), indexing="ij")
        grid = torch.stack([xs, ys], -1).reshape(-1, 2).float()
        coarse = prob @ grid  # b,h,w,2 in cells
        norm = torch.stack([coarse[..., 0] / (w - 1), coarse[..., 1] / (h - 1)], -1) * 2 - 1
        f1w = F.grid_sample(f1, norm, align_corners=True)
        out = self.refine(torch.cat([f0, f1w, norm.permute(0, 3, 1, 2)], 1))
        warp = coarse + out[:, :2].permute(0, 2, 3, 1)
        stride = IMG_W // w
        return warp * stride + stride / 2 - 0.5, out[:, 2]


def warp_loss(warp, cert_logit, gt, valid):
    epe = (warp - gt).norm(dim=-1)
    l_reg = (epe.clamp(max=50.0) * valid).sum() / valid.sum().clamp(min=1)
    l_cert = F.binary_cross_entropy_with_logits(cert_logit, valid.float())
    return l_reg + l_cert, epe[valid]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scannet", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--val_index", default=None)
    ap.add_argument("--out", default="ckpt/dense_warp")
    ap.add_argument("--backbone", default="weights/resnet18-f37072fd.pth", help="ImageNet ResNet-18 weights")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_set = build(args.scannet, args.index)
    val_set = build(args.scannet, args.val_index or args.index.replace("train", "val"))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = np.linspace(0, len(val_set) - 1, 1500).astype(int)[rank::world]
    val_loader = DataLoader(Subset(val_set, val_idx.tolist()), batch_size=4, num_workers=4)

    net = DenseWarp()
    if args.backbone:
        r18 = torch.load(args.backbone, map_location="cpu")
        enc_keys = ["conv1", "bn1", "layer1", "layer2"]
        enc_sd = {k: v for k, v in r18.items() if k.split(".")[0] in enc_keys}
        # nn.Sequential indices: conv1=0, bn1=1, layer1=4, layer2=5
        remap = {"conv1": "0", "bn1": "1", "layer1": "4", "layer2": "5"}
        net.enc.load_state_dict({remap[k.split(".")[0]] + k[len(k.split(".")[0]):]: v for k, v in enc_sd.items()})
    model = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(model, device_ids=[local_rank])
    enc_params = list(model.module.enc.parameters())
    enc_ids = {id(p) for p in enc_params}
    opt = torch.optim.AdamW([
        {"params": enc_params, "lr": args.lr * 0.1},
        {"params": [p for p in model.parameters() if id(p) not in enc_ids], "lr": args.lr},
    ], weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train pairs {len(train_set)}, val pairs {len(val_idx)}/rank, {len(train_loader)} it/epoch")

    for epoch in range(args.epochs):
        model.train()
        run = torch.zeros(2, device=dev)
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            gt, valid = gt_warp(batch["d0"], batch["d1"], batch["K0"], batch["K1"], batch["T_0to1"])
            warp, cert = model(batch["im0"], batch["im1"])
            loss, _ = warp_loss(warp, cert, gt, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=dev)])
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] loss {loss.item():.3f}", flush=True)
        sched.step()
        dist.all_reduce(run)

        # PCK over the fixed validation subset, counted over all ranks
        model.eval()
        counts = torch.zeros(4, device=dev)  # <1px, <3px, <5px, total
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(dev) for k, v in batch.items()}
                gt, valid = gt_warp(batch["d0"], batch["d1"], batch["K0"], batch["K1"], batch["T_0to1"])
                warp, cert = model.module(batch["im0"], batch["im1"])
                _, epe = warp_loss(warp, cert, gt, valid)
                counts += torch.stack([(epe < 1).sum(), (epe < 3).sum(), (epe < 5).sum(),
                                       torch.tensor(epe.numel(), device=dev)]).float()
        dist.all_reduce(counts)
        if rank == 0:
            pck = (counts[:3] / counts[3].clamp(min=1)).tolist()
            print(f"epoch {epoch} train loss {(run[0] / run[1]).item():.4f} "
                  f"PCK@1/3/5 {pck[0]:.3f}/{pck[1]:.3f}/{pck[2]:.3f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"dense_warp_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
