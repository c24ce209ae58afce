"""Pillar CenterNet-style detector on Lyft Level 5 (multi-sweep), ported from the single-GPU notebook.

    torchrun --nproc_per_node=4 20_lyft_pillar_center.py --data-root /data/lyft --sweeps 3
"""
import argparse
import math
import os
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


@dataclass
class Cfg:
    classes: tuple = ("car", "truck", "pedestrian", "bicycle")
    pc_range: tuple = (-80.0, -80.0, -5.0, 80.0, 80.0, 3.0)
    voxel: tuple = (0.25, 0.25, 8.0)
    max_pts: int = 20
    max_pillars: int = 40000
    stride: int = 2
    max_objs: int = 256


C = Cfg()
NX = int(round((C.pc_range[3] - C.pc_range[0]) / C.voxel[0]))
NY = int(round((C.pc_range[4] - C.pc_range[1]) / C.voxel[1]))


def read_sweeps(root, info, n_sweeps):
    pts = np.fromfile(os.path.join(root, info["lidar_path"]), np.float32).reshape(-1, 5)[:, :4]
    out = [np.pad(pts, ((0, 0), (0, 1)))]
    for sw in info["sweeps"][:n_sweeps - 1]:
        p = np.fromfile(os.path.join(root, sw["lidar_path"]), np.float32).reshape(-1, 5)[:, :4]
        T = sw["transform_matrix"]
        p[:, :3] = p[:, :3] @ T[:3, :3].T + T[:3, 3]
        out.append(np.pad(p, ((0, 0), (0, 1)), constant_values=sw["time_lag"]))
    return np.concatenate(out)


def pillarize(pts):
    lo = np.array(C.pc_range[:2], np.float32)
    ij = ((pts[:, :2] - lo) / np.array(C.voxel[:2], np.float32)).astype(np.int64)
    key = ij[:, 1] * NX + ij[:, 0]
    order = np.argsort(key, kind="stable")
    pts, ij, key = pts[order], ij[order], key[order]
    _, first, cnt = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, cnt)
    ok = slot < C.max_pts
    pil = np.zeros((len(first), C.max_pts, pts.shape[1]), np.float32)
    pil[np.repeat(np.arange(len(first)), cnt)[ok], slot[ok]] = pts[ok]
    num, yx = np.minimum(cnt, C.max_pts).astype(np.int32), ij[first][:, ::-1].astype(np.int64)
    if len(first) > C.max_pillars:
        sel = np.random.choice(len(first), C.max_pillars, replace=False)
        pil, num, yx = pil[sel], num[sel], yx[sel]
    return pil, yx, num


def make_targets(boxes, labels):
    H, W = NY // C.stride, NX // C.stride
    hm = np.zeros((len(C.classes), H, W), np.float32)
    reg = np.zeros((C.max_objs, 8), np.float32)
    ind, mask = np.zeros(C.max_objs, np.int64), np.zeros(C.max_objs, np.float32)
    for k, (b, c) in enumerate(zip(boxes[:C.max_objs], labels)):
        fx = (b[0] - C.pc_range[0]) / C.voxel[0] / C.stride
        fy = (b[1] - C.pc_range[1]) / C.voxel[1] / C.stride
        cx, cy = int(fx), int(fy)
        if not (0 <= cx < W and 0 <= cy < H):
            continue
        r = max(2, int(0.3 * math.hypot(b[3], b[4]) / C.voxel[0] / C.stride))
        yy, xx = np.ogrid[-r:r + 1, -r:r + 1]
        g = np.exp(-(xx * xx + yy * yy) / (2 * ((2 * r + 1) / 6) ** 2))
        x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
        hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
        ind[k], mask[k] = cy * W + cx, 1
        reg[k] = [fx - cx, fy - cy, b[2], *np.log(b[3:6]), math.sin(b[6]), math.cos(b[6])]
    return hm, reg, ind, mask


class LyftPillars(Dataset):
    def __init__(self, root, split, sweeps, train):
        self.root, self.sweeps, self.train = root, sweeps, train
        with open(os.path.join(root, f"lyft_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        pts = read_sweeps(self.root, info, self.sweeps)
        keep = np.isin(info["gt_names"], C.classes)
        boxes = info["gt_boxes"][keep][:, :7].astype(np.float32)
        labels = np.array([C.classes.index(n) for n in info["gt_names"][keep]], np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                pts[:, 1], boxes[:, 1], boxes[:, 6] = -pts[:, 1], -boxes[:, 1], -boxes[:, 6]
            a = np.random.uniform(-0.3925, 0.3925)
            R = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], np.float32)
            pts[:, :2], boxes[:, :2], boxes[:, 6] = pts[:, :2] @ R.T, boxes[:, :2] @ R.T, boxes[:, 6] + a
        lo, hi = np.array(C.pc_range[:3]), np.array(C.pc_range[3:])
        pts = pts[np.all((pts[:, :3] >= lo) & (pts[:, :3] < hi), 1)]
        pil, yx, num = pillarize(pts)
        hm, reg, ind, mask = make_targets(boxes, labels)
        return dict(pillars=pil, coords=yx, num=num, hm=hm, reg=reg, ind=ind, mask=mask)


def collate(batch):
    out = {k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in ("hm", "reg", "ind", "mask")}
    out["pillars"] = torch.from_numpy(np.concatenate([b["pillars"] for b in batch]))
    out["num"] = torch.from_numpy(np.concatenate([b["num"] for b in batch]))
    out["coords"] = torch.from_numpy(np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i)
                                                     for i, b in enumerate(batch)]))
    out["batch_size"] = len(batch)
    return out


def to_device(batch):
    return {k: v.to(DEVICE, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def cbr(cin, cout, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(True))


class PillarCenterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("vsize", torch.tensor(C.voxel[:2]))
        self.register_buffer("origin", torch.tensor(C.pc_range[:2]))
        self.pfn = nn.Linear(10, 64, bias=False)
        self.pfn_bn = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)
        self.b1 = nn.Sequential(cbr(64, 64, 2), *[cbr(64, 64) for _ in range(3)])
        self.b2 = nn.Sequential(cbr(64, 128, 2), *[cbr(128, 128) for _ in range(5)])
        self.b3 = nn.Sequential(cbr(128, 256, 2), *[cbr(256, 256) for _ in range(5)])
        self.u1 = nn.Sequential(nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.hm = nn.Sequential(cbr(384, 64), nn.Conv2d(64, len(C.classes), 1))
        self.reg = nn.Sequential(cbr(384, 64), nn.Conv2d(64, 8, 1))
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, pillars, coords, num, batch_size):
        valid = (torch.arange(pillars.shape[1], device=pillars.device)[None] < num[:, None]).unsqueeze(-1)
        mean = pillars[..., :3].sum(1, keepdim=True) / num.clamp(min=1).view(-1, 1, 1)
        ctr = coords[:, [2, 1]].float() * self.vsize + self.vsize / 2 + self.origin
        f = torch.cat([pillars, pillars[..., :3] - mean, pillars[..., :2] - ctr[:, None]], -1) * valid
        f = F.relu(self.pfn_bn(self.pfn(f).transpose(1, 2))).max(-1)[0]
        bev = f.new_zeros(batch_size, 64, NY * NX)
        bev[coords[:, 0], :, coords[:, 1] * NX + coords[:, 2]] = f
        x1 = self.b1(bev.view(batch_size, 64, NY, NX))
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        x = torch.cat([self.u1(x1), self.u2(x2), self.u3(x3)], 1)
        return self.hm(x), self.reg(x)


def loss_fn(hm_logit, reg_map, batch):
    p = hm_logit.sigmoid().clamp(1e-4, 1 - 1e-4)
    gt = batch["hm"]
    pos = gt.eq(1).float()
    l_hm = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - gt) ** 4 * (1 - pos)).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    ind = batch["ind"]
    pr = reg_map.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
    m = batch["mask"].unsqueeze(-1)
    l_reg = F.l1_loss(pr * m, batch["reg"] * m, reduction="sum") / (m.sum() * 8).clamp(min=1)
    return l_hm, l_reg


@torch.no_grad()
def validate(model, loader):
    model.eval()
    tot = torch.zeros(3, device=DEVICE)
    for batch in loader:
        batch = to_device(batch)
        l_hm, l_reg = loss_fn(*model(batch["pillars"], batch["coords"], batch["num"], batch["batch_size"]), batch)
        tot += torch.stack([l_hm * batch["batch_size"], l_reg * batch["batch_size"], tot.new_tensor(batch["batch_size"])])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/lyft")
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="checkpoints/lyft_pillar_center")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    np.random.seed(rank)

    train_set = LyftPillars(args.data_root, "train", args.sweeps, True)
    val_set = LyftPillars(args.data_root, "val", args.sweeps, False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.bs, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PillarCenterNet()).to(DEVICE)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader), pct_start=0.3)
    tb = SummaryWriter(args.out) if rank == 0 else None

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = to_device(batch)
            l_hm, l_reg = loss_fn(*model(batch["pillars"], batch["coords"], batch["num"], batch["batch_size"]), batch)
            opt.zero_grad(set_to_none=True)
            (l_hm + 0.25 * l_reg).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            opt.step()
            sched.step()
            if it % 100 == 0:
                s = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tb.add_scalar("train/hm", s[0].item(), epoch * len(loader) + it)
                    tb.add_scalar("train/reg", s[1].item(), epoch * len(loader) + it)
                    print(f"ep {epoch} it {it}/{len(loader)} hm {s[0]:.4f} reg {s[1]:.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        v_hm, v_reg = validate(model.module, val_loader)
        if rank == 0:
            tb.add_scalar("val/hm", v_hm, epoch)
            tb.add_scalar("val/reg", v_reg, epoch)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, f"ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
