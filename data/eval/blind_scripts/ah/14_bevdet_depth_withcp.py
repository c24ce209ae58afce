"""BEVDet-style camera 3D detection (LSS view transform + CenterHead) with optional LiDAR depth supervision.

Memory: the image backbone runs with per-block activation checkpointing (with_cp) so that
6 x 256x704 images x 4 samples fit in 24 GB.

    torchrun --nproc_per_node=8 tools/train_bevdet.py --data-root data/nuscenes --depth-sup
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
import torch.utils.checkpoint as cp
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle", "bicycle",
           "pedestrian", "traffic_cone"]
IMG = (256, 704)
DBOUND = (1.0, 60.0, 1.0)
GRID = (-51.2, 51.2, 0.8)
NX = int((GRID[1] - GRID[0]) / GRID[2])  # 128
DOWN = 16


class BEVDetData(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"bevdetv2-nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.root, self.train = root, train
        self.mean = np.array([123.675, 116.28, 103.53], np.float32)
        self.std = np.array([58.395, 57.12, 57.375], np.float32)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, intr, c2e, depths = [], [], [], []
        for cam, c in info["cams"].items():
            im = Image.open(os.path.join(self.root, c["data_path"])).convert("RGB")
            s = IMG[1] / im.width
            im = im.resize((IMG[1], int(im.height * s))).crop((0, int(im.height * s) - IMG[0], IMG[1],
                                                                int(im.height * s)))
            top = int(c["img_h"] * s) - IMG[0]
            K = np.array(c["cam_intrinsic"], np.float32)
            K[:2] *= s
            K[1, 2] -= top
            imgs.append(((np.asarray(im, np.float32) - self.mean) / self.std).transpose(2, 0, 1))
            intr.append(K)
            T = np.eye(4, dtype=np.float32)
            T[:3, :3], T[:3, 3] = c["sensor2ego_rotation_mat"], c["sensor2ego_translation"]
            c2e.append(T)
            d = np.load(os.path.join(self.root, c["depth_path"])) if "depth_path" in c else None
            depths.append(np.zeros((IMG[0] // DOWN, IMG[1] // DOWN), np.float32) if d is None else d)
        keep = np.isin(info["gt_names"], CLASSES)
        return {"imgs": torch.from_numpy(np.stack(imgs)), "intrins": torch.from_numpy(np.stack(intr)),
                "cam2ego": torch.from_numpy(np.stack(c2e)), "depth": torch.from_numpy(np.stack(depths)),
                "boxes": torch.from_numpy(info["gt_boxes"][keep].astype(np.float32)),
                "labels": torch.tensor([CLASSES.index(n) for n in info["gt_names"][keep]], dtype=torch.long)}


def collate(batch):
    out = {k: torch.stack([b[k] for b in batch]) for k in ("imgs", "intrins", "cam2ego", "depth")}
    out["boxes"] = [b["boxes"] for b in batch]
    out["labels"] = [b["labels"] for b in batch]
    return out


class CPBottleneckStage(nn.Module):
    """Wraps a torchvision ResNet stage and checkpoints each block."""

    def __init__(self, stage, with_cp=True):
        super().__init__()
        self.blocks = nn.ModuleList(list(stage))
        self.with_cp = with_cp

    def forward(self, x):
        for blk in self.blocks:
            if self.with_cp and x.requires_grad:
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        return x


class BEVDet(nn.Module):
    def __init__(self, C=80):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.stages = nn.ModuleList([CPBottleneckStage(s) for s in (r.layer1, r.layer2, r.layer3)])
        self.neck = nn.Sequential(nn.Conv2d(1024, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.D = int((DBOUND[1] - DBOUND[0]) / DBOUND[2])
        self.depth_net = nn.Conv2d(256, self.D + C, 1)
        self.C = C
        self.bev_enc = nn.Sequential(nn.Conv2d(C, 128, 3, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
                                     nn.Conv2d(128, 128, 3, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.hm = nn.Conv2d(128, len(CLASSES), 3, 1, 1)
        self.reg = nn.Conv2d(128, 8, 3, 1, 1)
        nn.init.constant_(self.hm.bias, -2.19)
        fH, fW = IMG[0] // DOWN, IMG[1] // DOWN
        ds = torch.arange(*DBOUND).view(-1, 1, 1).expand(-1, fH, fW)
        xs = torch.linspace(0, IMG[1] - 1, fW).view(1, 1, fW).expand(self.D, fH, fW)
        ys = torch.linspace(0, IMG[0] - 1, fH).view(1, fH, 1).expand(self.D, fH, fW)
        self.register_buffer("frustum", torch.stack([xs * ds, ys * ds, ds], -1), persistent=False)

    def forward(self, imgs, intrins, cam2ego):
        B, N = imgs.shape[:2]
        x = self.stem(imgs.flatten(0, 1))
        for st in self.stages:
            x = st(x)
        x = self.depth_net(self.neck(x))
        depth = x[:, :self.D].softmax(1)
        feat = x[:, self.D:]
        vol = (depth[:, None] * feat[:, :, None]).view(B, N, self.C, self.D, *x.shape[-2:])
        # frustum -> ego
        cam_pts = torch.einsum("bnij,dhwj->bndhwi", torch.inverse(intrins), self.frustum)
        ego = torch.einsum("bnij,bndhwj->bndhwi", cam2ego[..., :3, :3], cam_pts) + cam2ego[..., None, None, None, :3, 3]
        gx = ((ego[..., 0] - GRID[0]) / GRID[2]).long()
        gy = ((ego[..., 1] - GRID[0]) / GRID[2]).long()
        ok = (gx >= 0) & (gx < NX) & (gy >= 0) & (gy < NX) & (ego[..., 2].abs() < 5)
        bidx = torch.arange(B, device=x.device).view(B, 1, 1, 1, 1).expand_as(gx)
        flat = (bidx * NX * NX + gy * NX + gx)[ok]
        vals = vol.permute(0, 1, 3, 4, 5, 2)[ok]
        bev = vals.new_zeros(B * NX * NX, self.C).index_add_(0, flat, vals)
        bev = bev.view(B, NX, NX, self.C).permute(0, 3, 1, 2)
        f = self.bev_enc(bev)
        return self.hm(f), self.reg(f), depth


def targets(boxes, labels, device):
    B = len(boxes)
    hm = torch.zeros(B, len(CLASSES), NX, NX, device=device)
    ys, xs = torch.meshgrid(torch.arange(NX, device=device), torch.arange(NX, device=device), indexing="ij")
    reg_t, idx = [], []
    for b in range(B):
        for box, lab in zip(boxes[b].to(device), labels[b].to(device)):
            fx, fy = (box[0] - GRID[0]) / GRID[2], (box[1] - GRID[0]) / GRID[2]
            ix, iy = int(fx), int(fy)
            if not (0 <= ix < NX and 0 <= iy < NX):
                continue
            sig = max(1.0, float(box[3:5].min()) / GRID[2] / 2)
            hm[b, lab] = torch.maximum(hm[b, lab], torch.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sig ** 2)))
            idx.append((b, iy, ix))
            reg_t.append(torch.stack([fx - ix, fy - iy, box[2], *box[3:6].log(), box[6].sin(), box[6].cos()]))
    return hm, idx, reg_t


def losses(hm_p, reg_p, depth_p, batch, device, depth_sup):
    hm, idx, reg_t = targets(batch["boxes"], batch["labels"], device)
    p = hm_p.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm.eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - hm) ** 4 * p ** 2 * (1 - p).log()).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    if idx:
        b, y, x = (torch.tensor(v, device=device) for v in zip(*idx))
        l_reg = F.l1_loss(reg_p[b, :, y, x], torch.stack(reg_t))
    else:
        l_reg = reg_p.sum() * 0.0
    total = l_hm + 0.25 * l_reg
    if depth_sup:
        gt = batch["depth"].to(device).flatten(0, 1)
        valid = (gt > DBOUND[0]) & (gt < DBOUND[1])
        bins = ((gt - DBOUND[0]) / DBOUND[2]).long().clamp(0, depth_p.shape[1] - 1)
        l_depth = F.nll_loss(depth_p.clamp(min=1e-6).log().permute(0, 2, 3, 1)[valid], bins[valid]) \
            if valid.any() else depth_p.sum() * 0.0
        total = total + 3.0 * l_depth
    return total, l_hm.detach(), l_reg.detach()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)  # loss sum, center hits, gt count
    for batch in loader:
        hm_p, reg_p, depth_p = model(batch["imgs"].to(device), batch["intrins"].to(device),
                                     batch["cam2ego"].to(device))
        loss, _, _ = losses(hm_p, reg_p, depth_p, batch, device, depth_sup=False)
        acc[0] += loss
        peaks = (hm_p.sigmoid().amax(1) > 0.3) & (F.max_pool2d(hm_p.amax(1, keepdim=True), 3, 1, 1)[:, 0] ==
                                                  hm_p.amax(1))
        for b, boxes in enumerate(batch["boxes"]):
            gx = ((boxes[:, 0] - GRID[0]) / GRID[2]).long().clamp(0, NX - 1).to(device)
            gy = ((boxes[:, 1] - GRID[0]) / GRID[2]).long().clamp(0, NX - 1).to(device)
            near = F.max_pool2d(peaks[b][None, None].float(), 5, 1, 2)[0, 0]
            acc[1] += near[gy, gx].sum()
            acc[2] += len(boxes)
    n = torch.tensor([len(loader)], device=device, dtype=torch.float)
    dist.all_reduce(acc)
    dist.all_reduce(n)
    model.train()
    return (acc[0] / n).item(), (acc[1] / acc[2].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", default="work_dirs/bevdet-r50-depth")
    ap.add_argument("--samples-per-gpu", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--depth-sup", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = BEVDetData(args.data_root, "train", True), BEVDetData(args.data_root, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.samples_per_gpu, sampler=sampler, num_workers=4, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.samples_per_gpu,
                        num_workers=4, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(BEVDet()).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.8) * len(train_dl)], 0.1)

    start = 0
    latest = os.path.join(args.work_dir, "latest.pth")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start = ck["epoch"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_dl):
            hm_p, reg_p, depth_p = model(batch["imgs"].to(device, non_blocking=True),
                                         batch["intrins"].to(device), batch["cam2ego"].to(device))
            loss, l_hm, l_reg = losses(hm_p, reg_p, depth_p, batch, device, args.depth_sup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"Epoch [{epoch + 1}][{it}/{len(train_dl)}] loss {loss.item():.4f} hm {l_hm.item():.4f} "
                      f"reg {l_reg.item():.4f} time {time.time() - t0:.0f}s", flush=True)

        vloss, recall = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"Epoch {epoch + 1}: val loss {vloss:.4f} center recall {recall:.4f}", flush=True)
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch + 1}, latest)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
