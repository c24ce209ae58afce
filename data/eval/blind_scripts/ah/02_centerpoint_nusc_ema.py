# CenterPoint-Pillar on nuScenes (10 classes, 10 sweeps) with AMP and EMA.
#   torchrun --nnodes=1 --nproc_per_node=8 train_centerpoint.py --data-root data/nuscenes --amp
import argparse
import copy
import json
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

NUSC_CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
                "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
PC_RANGE = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]
VOXEL = [0.2, 0.2, 8.0]
BEV = 512
STRIDE = 4
MAX_OBJS = 500


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--out", default="work_dirs/centerpoint_pillar")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=1e-3, help="lr for a total batch of 32")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--ema-decay", type=float, default=0.9998)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class NuScenesSweeps(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"nuscenes_infos_{split}.pkl"), "rb") as f:
            data = pickle.load(f)
        self.infos = data["infos"] if isinstance(data, dict) else data
        self.root, self.train = root, train

    def __len__(self):
        return len(self.infos)

    def _load_points(self, info):
        pts = np.fromfile(os.path.join(self.root, info["lidar_path"]), np.float32).reshape(-1, 5)
        pts[:, 4] = 0.0
        clouds = [pts]
        for sw in info["sweeps"][:9]:
            s = np.fromfile(os.path.join(self.root, sw["data_path"]), np.float32).reshape(-1, 5)
            s[:, :3] = s[:, :3] @ sw["sensor2lidar_rotation"].T + sw["sensor2lidar_translation"]
            s[:, 4] = info["timestamp"] / 1e6 - sw["timestamp"] / 1e6
            clouds.append(s)
        return np.concatenate(clouds, 0)

    def __getitem__(self, i):
        info = self.infos[i]
        pts = self._load_points(info)
        keep = np.array([n in NUSC_CLASSES for n in info["gt_names"]], bool) & (info["num_lidar_pts"] > 0)
        boxes = info["gt_boxes"][keep].astype(np.float32)
        vel = np.nan_to_num(info["gt_velocity"][keep]).astype(np.float32)
        labels = np.array([NUSC_CLASSES.index(n) for n in info["gt_names"][keep]], np.int64)
        if self.train and np.random.rand() < 0.5:
            pts[:, 1] *= -1
            boxes[:, 1] *= -1
            boxes[:, 6] *= -1
            vel[:, 1] *= -1
        lo, hi = np.array(PC_RANGE[:3]), np.array(PC_RANGE[3:])
        pts = pts[np.all((pts[:, :3] >= lo) & (pts[:, :3] < hi), 1)]
        return {"points": pts, "boxes": np.concatenate([boxes, vel], 1), "labels": labels,
                "token": info["token"]}


def collate(batch):
    pts = [np.pad(b["points"], ((0, 0), (1, 0)), constant_values=i) for i, b in enumerate(batch)]
    return {"points": torch.from_numpy(np.concatenate(pts)),
            "boxes": [torch.from_numpy(b["boxes"]) for b in batch],
            "labels": [torch.from_numpy(b["labels"]) for b in batch],
            "tokens": [b["token"] for b in batch]}


class ShardSampler(Sampler):
    """Contiguous, unpadded shard of the dataset for inference."""

    def __init__(self, n, rank, world):
        per = math.ceil(n / world)
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class PillarScatter(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.pfn = nn.Sequential(nn.Linear(8, c, bias=False), nn.BatchNorm1d(c), nn.ReLU())
        self.c = c

    def forward(self, pts, bs):
        xy = ((pts[:, 1:3] - pts.new_tensor(PC_RANGE[:2])) / VOXEL[0]).long().clamp_(0, BEV - 1)
        key = pts[:, 0].long() * BEV * BEV + xy[:, 1] * BEV + xy[:, 0]
        uniq, inv = torch.unique(key, return_inverse=True)
        cnt = torch.bincount(inv, minlength=len(uniq)).clamp(min=1).float()[:, None]
        mean = torch.zeros(len(uniq), 3, device=pts.device).index_add_(0, inv, pts[:, 1:4]) / cnt
        f = self.pfn(torch.cat([pts[:, 1:6], pts[:, 1:4] - mean[inv]], 1))
        pill = f.new_full((len(uniq), self.c), -1e4).scatter_reduce(0, inv[:, None].expand_as(f), f, "amax")
        canvas = f.new_zeros(bs * BEV * BEV, self.c)
        canvas[uniq] = pill
        return canvas.view(bs, BEV, BEV, self.c).permute(0, 3, 1, 2)


def block(cin, cout, n, stride):
    layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    for _ in range(n):
        layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers)


class CenterPoint(nn.Module):
    # heads: heatmap(10), offset(2), z(1), dim(3), rot(2), vel(2)
    HEADS = {"reg": 2, "height": 1, "dim": 3, "rot": 2, "vel": 2}

    def __init__(self, ncls=len(NUSC_CLASSES)):
        super().__init__()
        self.scatter = PillarScatter(64)
        self.b1, self.b2, self.b3 = block(64, 64, 3, 2), block(64, 128, 5, 2), block(128, 256, 5, 2)
        self.d1 = nn.Sequential(nn.ConvTranspose2d(64, 128, 1, 1), nn.BatchNorm2d(128), nn.ReLU())
        self.d2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2), nn.BatchNorm2d(128), nn.ReLU())
        self.d3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4), nn.BatchNorm2d(128), nn.ReLU())
        self.shared = nn.Sequential(nn.Conv2d(384, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.hm = nn.Conv2d(64, ncls, 3, 1, 1)
        nn.init.constant_(self.hm.bias, -2.19)
        self.regs = nn.ModuleDict({k: nn.Conv2d(64, c, 3, 1, 1) for k, c in self.HEADS.items()})

    def forward(self, pts, bs):
        x = self.scatter(pts, bs)
        x1 = self.b1(x)
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        f = self.shared(torch.cat([self.d1(x1), self.d2(x2), self.d3(x3)], 1))
        return self.hm(f), torch.cat([h(f) for h in self.regs.values()], 1)


def build_targets(boxes_list, labels_list, device):
    H = W = BEV // STRIDE
    B = len(boxes_list)
    hm = torch.zeros(B, len(NUSC_CLASSES), H, W, device=device)
    reg = torch.zeros(B, MAX_OBJS, 10, device=device)
    ind = torch.zeros(B, MAX_OBJS, dtype=torch.long, device=device)
    mask = torch.zeros(B, MAX_OBJS, device=device)
    yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    for b, (bx, lb) in enumerate(zip(boxes_list, labels_list)):
        bx, lb = bx[:MAX_OBJS].to(device), lb[:MAX_OBJS].to(device)
        for k in range(len(bx)):
            cx = (bx[k, 0] - PC_RANGE[0]) / VOXEL[0] / STRIDE
            cy = (bx[k, 1] - PC_RANGE[1]) / VOXEL[1] / STRIDE
            ix, iy = int(cx), int(cy)
            if not (0 <= ix < W and 0 <= iy < H):
                continue
            r = max(2.0, float(bx[k, 3:5].min()) / VOXEL[0] / STRIDE)
            g = torch.exp(-((xx - ix) ** 2 + (yy - iy) ** 2) / (2 * (r / 3) ** 2))
            hm[b, lb[k]] = torch.maximum(hm[b, lb[k]], g)
            ind[b, k], mask[b, k] = iy * W + ix, 1
            reg[b, k] = torch.stack([cx - ix, cy - iy, bx[k, 2], *bx[k, 3:6].log(),
                                     bx[k, 6].sin(), bx[k, 6].cos(), bx[k, 7], bx[k, 8]])
    return hm, reg, ind, mask


def centerpoint_loss(hm_pred, reg_pred, tgt):
    hm, reg, ind, mask = tgt
    p = hm_pred.float().sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm.eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - hm) ** 4 * p ** 2 * (1 - p).log()).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    B, C = reg_pred.shape[:2]
    pr = reg_pred.float().flatten(2).gather(2, ind[:, None].expand(-1, C, -1)).permute(0, 2, 1)
    w = pr.new_tensor([1, 1, 1, 1, 1, 1, 1, 1, 0.2, 0.2])
    l_reg = ((pr - reg).abs() * w * mask[..., None]).sum() / mask.sum().clamp(min=1)
    return l_hm + 0.25 * l_reg, l_hm.detach(), l_reg.detach()


class ModelEMA:
    def __init__(self, model, decay):
        self.ema = copy.deepcopy(model).eval()
        self.decay, self.updates = decay, 0
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / 2000))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
            else:
                v.copy_(msd[k])


@torch.no_grad()
def run_inference(model, loader, device, topk=300):
    model.eval()
    results = {}
    for batch in loader:
        bs = len(batch["tokens"])
        hm, reg = model(batch["points"].to(device, non_blocking=True), bs)
        hm = hm.sigmoid()
        hm = hm * (F.max_pool2d(hm, 3, 1, 1) == hm)
        W = hm.shape[-1]
        scores, idx = hm.flatten(1).topk(topk)
        cls, pix = idx // (W * W), idx % (W * W)
        r = reg.flatten(2).gather(2, pix[:, None].expand(-1, reg.shape[1], -1))
        x = ((pix % W).float() + r[:, 0]) * VOXEL[0] * STRIDE + PC_RANGE[0]
        y = ((pix // W).float() + r[:, 1]) * VOXEL[1] * STRIDE + PC_RANGE[1]
        for b, tok in enumerate(batch["tokens"]):
            results[tok] = {"xy": torch.stack([x[b], y[b]], -1).cpu().numpy(),
                            "vel": r[b, 8:10].T.cpu().numpy(),
                            "score": scores[b].cpu().numpy(), "label": cls[b].cpu().numpy(),
                            "gt": (batch["boxes"][b].numpy(), batch["labels"][b].numpy())}
    return results


def nds_lite(results, dist_thr=2.0):
    """Center-distance mAP plus mean velocity error, a quick stand-in for the devkit NDS."""
    aps, ave = [], []
    for c in range(len(NUSC_CLASSES)):
        rec, npos = [], 0
        for r in results.values():
            gb, gl = r["gt"]
            g = gb[gl == c]
            npos += len(g)
            m = r["label"] == c
            used = np.zeros(len(g), bool)
            for j in np.argsort(-r["score"][m]):
                d = np.linalg.norm(g[:, :2] - r["xy"][m][j], axis=1) if len(g) else np.array([np.inf])
                if len(g):
                    d[used] = np.inf
                k = int(np.argmin(d))
                ok = d[k] < dist_thr
                if ok:
                    used[k] = True
                    ave.append(np.linalg.norm(g[k, 7:9] - r["vel"][m][j]))
                rec.append((r["score"][m][j], float(ok)))
        if npos == 0:
            continue
        rec.sort(key=lambda t: -t[0])
        tp = np.cumsum([t[1] for t in rec])
        prec, recall = tp / np.arange(1, len(rec) + 1), tp / npos
        aps.append(np.mean([prec[recall >= t].max() if (recall >= t).any() else 0 for t in np.linspace(0.1, 1, 91)]))
    mAP = float(np.mean(aps)) if aps else 0.0
    mAVE = float(np.mean(ave)) if ave else 1.0
    return mAP, (4 * mAP + (1 - min(mAVE, 1.0))) / 5


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    train_ds = NuScenesSweeps(args.data_root, "train", True)
    val_ds = NuScenesSweeps(args.data_root, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_per_gpu, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_per_gpu, sampler=ShardSampler(len(val_ds), rank, world),
                        num_workers=args.workers, collate_fn=collate)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(CenterPoint()).to(device)
    ema = ModelEMA(net, args.ema_decay)
    model = DDP(net, device_ids=[local_rank])

    lr = args.base_lr * args.batch_per_gpu * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.4)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    start = 0
    ckpt_path = args.resume or os.path.join(args.out, "latest.pth")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        ema.ema.load_state_dict(ck["ema"])
        ema.updates = ck["ema_updates"]
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, batch in enumerate(train_dl):
            pts = batch["points"].to(device, non_blocking=True)
            tgt = build_targets(batch["boxes"], batch["labels"], device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                hm, reg = model(pts, len(batch["tokens"]))
            loss, l_hm, l_reg = centerpoint_loss(hm, reg, tgt)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)
            if rank == 0 and it % 50 == 0:
                step = epoch * len(train_dl) + it
                writer.add_scalar("loss/total", loss.item(), step)
                writer.add_scalar("loss/hm", l_hm.item(), step)
                writer.add_scalar("loss/reg", l_reg.item(), step)
                print(f"[{epoch}][{it}/{len(train_dl)}] loss {loss.item():.3f} {time.time() - tic:.0f}s", flush=True)

        res = run_inference(ema.ema, val_dl, device)
        parts = [None] * world
        dist.all_gather_object(parts, res)
        if rank == 0:
            merged = {}
            for p in parts:
                merged.update(p)
            mAP, nds = nds_lite(merged)
            writer.add_scalar("val/mAP", mAP, epoch)
            writer.add_scalar("val/NDS", nds, epoch)
            print(f"epoch {epoch}: mAP {mAP:.4f} NDS {nds:.4f} ({len(merged)} samples)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            tmp = os.path.join(args.out, "latest.pth.tmp")
            torch.save({"model": net.state_dict(), "ema": ema.ema.state_dict(), "ema_updates": ema.updates,
                        "opt": opt.state_dict(), "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch}, tmp)
            os.replace(tmp, os.path.join(args.out, "latest.pth"))
            with open(os.path.join(args.out, f"metrics_{epoch}.json"), "w") as f:
                json.dump({"mAP": mAP, "NDS": nds}, f)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
