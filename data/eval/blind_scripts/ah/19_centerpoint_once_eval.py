"""CenterPoint with dynamic pillars on the ONCE dataset (5 classes), AMP training, distributed evaluation.

    torchrun --nproc_per_node=8 train_once_centerpoint.py --data-root data/once --amp
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Car", "Bus", "Truck", "Pedestrian", "Cyclist"]
PC_RANGE = torch.tensor([-75.2, -75.2, -5.0, 75.2, 75.2, 3.0])
PILLAR = 0.2
NXY = int(150.4 / PILLAR)  # 752
STRIDE = 4
SCORE_THR = 0.1


class OnceDataset(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"once_infos_{split}.pkl"), "rb") as f:
            infos = pickle.load(f)
        self.infos = [i for i in infos if "annos" in i]
        self.root, self.train = root, train

    def __len__(self):
        return len(self.infos)

    def gt(self, i):
        a = self.infos[i]["annos"]
        keep = np.isin(a["name"], CLASSES)
        return a["boxes_3d"][keep].astype(np.float32), np.array([CLASSES.index(n) for n in a["name"][keep]])

    def __getitem__(self, i):
        info = self.infos[i]
        pts = np.fromfile(os.path.join(self.root, "data", info["sequence_id"], "lidar_roof",
                                       f"{info['frame_id']}.bin"), np.float32).reshape(-1, 4)
        boxes, labels = self.gt(i)
        if self.train:
            if np.random.rand() < 0.5:
                pts[:, 1] *= -1
                boxes[:, 1] *= -1
                boxes[:, 6] *= -1
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            pts[:, :2] = pts[:, :2] @ R.T
            boxes[:, :2] = boxes[:, :2] @ R.T
            boxes[:, 6] += a
        lo, hi = PC_RANGE[:3].numpy(), PC_RANGE[3:].numpy()
        pts = pts[np.all((pts[:, :3] > lo) & (pts[:, :3] < hi), 1)]
        return torch.from_numpy(pts), torch.from_numpy(boxes), torch.from_numpy(labels).long(), i


def collate(batch):
    pts = torch.cat([F.pad(b[0], (1, 0), value=k) for k, b in enumerate(batch)])
    return pts, [b[1] for b in batch], [b[2] for b in batch], torch.tensor([b[3] for b in batch])


class DynamicPillarNet(nn.Module):
    def __init__(self, ncls=len(CLASSES), c=64):
        super().__init__()
        self.pfn1 = nn.Sequential(nn.Linear(9, c, bias=False), nn.BatchNorm1d(c), nn.ReLU())
        self.pfn2 = nn.Sequential(nn.Linear(2 * c, c, bias=False), nn.BatchNorm1d(c), nn.ReLU())
        chans = [c, 64, 128, 256]
        self.down = nn.ModuleList()
        for i in range(3):
            blk = [nn.Conv2d(chans[i], chans[i + 1], 3, 2 if i else 1, 1, bias=False), nn.BatchNorm2d(chans[i + 1]),
                   nn.ReLU()]
            for _ in range(3):
                blk += [nn.Conv2d(chans[i + 1], chans[i + 1], 3, 1, 1, bias=False), nn.BatchNorm2d(chans[i + 1]),
                        nn.ReLU()]
            self.down.append(nn.Sequential(*blk))
        self.lat = nn.ModuleList([nn.Sequential(nn.ConvTranspose2d(ch, 128, s, s, bias=False), nn.BatchNorm2d(128),
                                                nn.ReLU()) for ch, s in ((64, 1), (128, 2), (256, 4))])
        self.pre = nn.Sequential(nn.Conv2d(384, 128, 3, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.hm = nn.Conv2d(128, ncls, 3, 1, 1)
        self.box = nn.Conv2d(128, 8, 3, 1, 1)
        nn.init.constant_(self.hm.bias, -2.19)
        self.c = c

    def scatter(self, pts, B):
        lo = PC_RANGE.to(pts.device)
        ij = ((pts[:, 1:3] - lo[:2]) / PILLAR).long().clamp(0, NXY - 1)
        key = pts[:, 0].long() * NXY * NXY + ij[:, 1] * NXY + ij[:, 0]
        uk, inv = torch.unique(key, return_inverse=True)
        cnt = torch.bincount(inv).float()[:, None]
        mean = torch.zeros(len(uk), 3, device=pts.device).index_add_(0, inv, pts[:, 1:4]) / cnt
        ctr = (ij.float() + 0.5) * PILLAR + lo[:2]
        f = self.pfn1(torch.cat([pts[:, 1:5], pts[:, 1:4] - mean[inv], pts[:, 1:3] - ctr], 1))
        agg = f.new_full((len(uk), self.c), -1e4).scatter_reduce(0, inv[:, None].expand_as(f), f, "amax")
        f = self.pfn2(torch.cat([f, agg[inv]], 1))
        agg = f.new_full((len(uk), self.c), -1e4).scatter_reduce(0, inv[:, None].expand_as(f), f, "amax")
        canvas = f.new_zeros(B * NXY * NXY, self.c)
        canvas[uk] = agg
        return canvas.view(B, NXY, NXY, self.c).permute(0, 3, 1, 2)

    def forward(self, pts, B):
        x = F.max_pool2d(self.scatter(pts, B), 2)  # stride 2
        feats = []
        for d in self.down:
            x = d(x)
            feats.append(x)
        x = self.pre(torch.cat([l(f) for l, f in zip(self.lat, feats)], 1))
        x = F.max_pool2d(x, 2)  # stride 4
        return self.hm(x), self.box(x)


def make_targets(boxes, labels, H, W, device):
    B = len(boxes)
    hm = torch.zeros(B, len(CLASSES), H, W, device=device)
    ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    b_idx, pix, reg = [], [], []
    for b in range(B):
        for bx, lb in zip(boxes[b].to(device), labels[b].to(device)):
            fx = (bx[0] - PC_RANGE[0].item()) / PILLAR / STRIDE
            fy = (bx[1] - PC_RANGE[1].item()) / PILLAR / STRIDE
            ix, iy = int(fx), int(fy)
            if 0 <= ix < W and 0 <= iy < H:
                sig = max(0.7, float(bx[3:5].min()) / PILLAR / STRIDE / 3)
                hm[b, lb] = torch.maximum(hm[b, lb], torch.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sig * sig)))
                b_idx.append(b)
                pix.append(iy * W + ix)
                reg.append(torch.stack([fx - ix, fy - iy, bx[2], *bx[3:6].log(), bx[6].sin(), bx[6].cos()]))
    return hm, b_idx, pix, reg


def loss_fn(hm_p, box_p, tgt):
    hm, b_idx, pix, reg = tgt
    p = hm_p.float().sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm.eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - hm) ** 4 * p ** 2 * (1 - p).log()).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    if not reg:
        return l_hm + box_p.sum() * 0.0
    bp = box_p.float().flatten(2)[torch.tensor(b_idx, device=hm.device), :, torch.tensor(pix, device=hm.device)]
    return l_hm + 2.0 * F.l1_loss(bp, torch.stack(reg))


@torch.no_grad()
def predict(model, loader, device, k=200):
    model.eval()
    rows = []
    for pts, _, _, idx in loader:
        hm, box = model(pts.to(device), len(idx))
        hm = hm.float().sigmoid()
        hm = hm * (F.max_pool2d(hm, 3, 1, 1) == hm)
        B, C, H, W = hm.shape
        score, top = hm.view(B, -1).topk(k)
        cls, pix = top // (H * W), top % (H * W)
        r = box.float().flatten(2).gather(2, pix[:, None].expand(-1, 8, -1)).transpose(1, 2)
        x = ((pix % W).float() + r[..., 0]) * PILLAR * STRIDE + PC_RANGE[0].item()
        y = ((pix // W).float() + r[..., 1]) * PILLAR * STRIDE + PC_RANGE[1].item()
        det = torch.cat([torch.stack([x, y], -1), r[..., 2:6].clone(), torch.atan2(r[..., 6], r[..., 7])[..., None],
                         score[..., None], cls[..., None].float(),
                         idx.to(device)[:, None, None].float().expand(-1, k, 1)], -1)
        det[..., 3:6] = det[..., 3:6].exp()
        rows.append(det[score > SCORE_THR])
    model.train()
    return torch.cat(rows) if rows else torch.zeros(0, 10, device=device)


def gather_detections(local):
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return torch.cat(out)


def center_map(dets, dataset, thr=2.0):
    aps = []
    for c in range(len(CLASSES)):
        d = dets[dets[:, 8] == c]
        d = d[np.argsort(-d[:, 7])]
        gts = {i: dataset.gt(i) for i in np.unique(d[:, 9]).astype(int)}
        npos = sum(int((dataset.gt(i)[1] == c).sum()) for i in range(len(dataset)))
        used = {i: np.zeros(int((g[1] == c).sum()), bool) for i, g in gts.items()}
        tp = np.zeros(len(d))
        for j, row in enumerate(d):
            gb, gl = gts[int(row[9])]
            g = gb[gl == c]
            if len(g) == 0:
                continue
            dd = np.linalg.norm(g[:, :2] - row[:2], axis=1)
            dd[used[int(row[9])]] = np.inf
            m = int(dd.argmin())
            if dd[m] < thr:
                used[int(row[9])][m] = True
                tp[j] = 1
        if npos == 0:
            continue
        ctp = np.cumsum(tp)
        prec, rec = ctp / np.arange(1, len(d) + 1), ctp / npos
        aps.append(np.mean([prec[rec >= t].max() if (rec >= t).any() else 0.0 for t in np.linspace(0.02, 1, 50)]))
    return float(np.mean(aps)) if aps else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/once")
    ap.add_argument("--out", default="output/once_centerpoint_pillar")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--eval-interval", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    train_ds, val_ds = OnceDataset(args.data_root, "train", True), OnceDataset(args.data_root, "val", False)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=6, collate_fn=collate, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), args.bs, num_workers=6,
                        collate_fn=collate)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DynamicPillarNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start = 0
    ck_path = os.path.join(args.out, "latest.pth")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (pts, boxes, labels, idx) in enumerate(train_dl):
            pts = pts.to(device, non_blocking=True)
            with torch.autocast("cuda", enabled=args.amp):
                hm_p, box_p = model(pts, len(idx))
            loss = loss_fn(hm_p, box_p, make_targets(boxes, labels, hm_p.shape[2], hm_p.shape[3], device))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_dl)}] loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            dets = gather_detections(predict(net, val_dl, device))
            if rank == 0:
                mAP = center_map(dets.cpu().numpy(), val_ds)
                print(f"epoch {epoch}: center-distance mAP {mAP:.4f} ({len(dets)} detections)", flush=True)
                with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "mAP": mAP}) + "\n")
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
