"""CenterTrack on MOT17 (train-half / val-half split).

Input: current frame, previous frame and a heatmap rendered from the previous frame's
objects. Output: center heatmap, box size, sub-pixel offset and a 2-D displacement to the
same object's center in the previous frame, which is used for greedy association.
"""
import argparse
import glob
import math
import os
import random
import time

import cv2
import motmetrics as mm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

INP_H, INP_W, DOWN = 544, 960, 4
MEAN = np.array([0.408, 0.447, 0.470], np.float32)
STD = np.array([0.289, 0.274, 0.278], np.float32)


def get_args():
    parser = argparse.ArgumentParser(description="CenterTrack MOT17 half")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data_dir", type=str, default="/home/shared/data/MOT17/train")
    parser.add_argument("--save_dir", type=str, default="../exp/centertrack_mot17_half")
    parser.add_argument("--num_epochs", type=int, default=70)
    parser.add_argument("--lr_step", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.25e-4)
    parser.add_argument("--hm_disturb", type=float, default=0.05)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--val_intervals", type=int, default=10)
    return parser.parse_args()


def read_gt(seq_dir):
    gt = {}
    for r in np.loadtxt(os.path.join(seq_dir, "gt", "gt.txt"), delimiter=","):
        if r[6] != 1 or r[7] != 1:
            continue
        gt.setdefault(int(r[0]), []).append((int(r[1]), r[2], r[3], r[4], r[5]))
    return gt


def preprocess(path):
    img = cv2.resize(cv2.imread(path), (INP_W, INP_H)).astype(np.float32) / 255.0
    return torch.from_numpy(((img - MEAN) / STD).transpose(2, 0, 1).copy())


def draw_gaussian(hm, cx, cy, w, h):
    r = max(0, int(0.3 * math.sqrt(w * h)))
    sigma = (2 * r + 1) / 6
    H, W = hm.shape
    ys, xs = np.ogrid[max(0, int(cy) - r): min(H, int(cy) + r + 1), max(0, int(cx) - r): min(W, int(cx) + r + 1)]
    g = np.exp(-((xs - int(cx)) ** 2 + (ys - int(cy)) ** 2) / (2 * sigma ** 2))
    hm[ys, xs] = np.maximum(hm[ys, xs], g)


class MOTHalf(Dataset):
    def __init__(self, root, seqs, hm_disturb=0.05, max_objs=256):
        self.items, self.gts, self.max_objs, self.hm_disturb = [], {}, max_objs, hm_disturb
        for s in seqs:
            d = os.path.join(root, s)
            n = len(glob.glob(os.path.join(d, "img1", "*.jpg")))
            self.gts[d] = read_gt(d)
            self.items += [(d, f, n) for f in range(1, n // 2 + 1)]

    def __len__(self):
        return len(self.items)

    def scale(self, d, f):
        img = cv2.imread(os.path.join(d, "img1", f"{f:06d}.jpg"), cv2.IMREAD_REDUCED_COLOR_2)
        return INP_W / (img.shape[1] * 2), INP_H / (img.shape[0] * 2)

    def __getitem__(self, i):
        d, f, n = self.items[i]
        pf = min(max(1, f + random.randint(-3, 3)), n // 2)
        sx, sy = self.scale(d, f)
        cur = {tid: (x, y, w, h) for tid, x, y, w, h in self.gts[d].get(f, [])}
        prev = {tid: (x, y, w, h) for tid, x, y, w, h in self.gts[d].get(pf, [])}
        oh, ow = INP_H // DOWN, INP_W // DOWN
        pre_hm = np.zeros((INP_H, INP_W), np.float32)
        for tid, (x, y, w, h) in prev.items():
            cx, cy = (x + w / 2) * sx, (y + h / 2) * sy
            cx += np.random.randn() * self.hm_disturb * w * sx
            cy += np.random.randn() * self.hm_disturb * h * sy
            draw_gaussian(pre_hm, cx, cy, w * sx, h * sy)
        hm = np.zeros((1, oh, ow), np.float32)
        wh, reg, trk = (np.zeros((self.max_objs, 2), np.float32) for _ in range(3))
        ind = np.zeros(self.max_objs, np.int64)
        mask = np.zeros(self.max_objs, np.float32)
        trk_mask = np.zeros(self.max_objs, np.float32)
        for k, (tid, (x, y, w, h)) in enumerate(list(cur.items())[: self.max_objs]):
            cx, cy = (x + w / 2) * sx / DOWN, (y + h / 2) * sy / DOWN
            if not (0 <= cx < ow and 0 <= cy < oh):
                continue
            draw_gaussian(hm[0], cx, cy, w * sx / DOWN, h * sy / DOWN)
            ind[k], mask[k] = int(cy) * ow + int(cx), 1
            wh[k] = (w * sx / DOWN, h * sy / DOWN)
            reg[k] = (cx - int(cx), cy - int(cy))
            if tid in prev:
                px, py, pw, ph = prev[tid]
                trk[k] = ((px + pw / 2) * sx / DOWN - int(cx), (py + ph / 2) * sy / DOWN - int(cy))
                trk_mask[k] = 1
        inp = torch.cat([preprocess(os.path.join(d, "img1", f"{f:06d}.jpg")),
                         preprocess(os.path.join(d, "img1", f"{pf:06d}.jpg")), torch.from_numpy(pre_hm)[None]])
        return inp, {k: torch.from_numpy(v) for k, v in dict(hm=hm, wh=wh, reg=reg, trk=trk, ind=ind, mask=mask, trk_mask=trk_mask).items()}


class CenterTrackNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        w = r.conv1.weight.data
        r.conv1 = nn.Conv2d(7, 64, 7, 2, 3, bias=False)
        r.conv1.weight.data = torch.cat([w, w, w.mean(1, keepdim=True)], 1) / 2
        self.enc = nn.Sequential(*list(r.children())[:-2])
        ups, ch = [], 512
        for o in (256, 128, 64):
            ups += [nn.ConvTranspose2d(ch, o, 4, 2, 1, bias=False), nn.GroupNorm(16, o), nn.ReLU(inplace=True)]
            ch = o
        self.dec = nn.Sequential(*ups)
        self.heads = nn.ModuleDict({k: nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, c, 1))
                                    for k, c in dict(hm=1, wh=2, reg=2, trk=2).items()})
        self.heads["hm"][-1].bias.data.fill_(-4.6)

    def forward(self, x):
        f = self.dec(self.enc(x))
        return {k: h(f) for k, h in self.heads.items()}


def gather(feat, ind):
    B, C = feat.shape[:2]
    return feat.flatten(2).gather(2, ind[:, None].expand(-1, C, -1)).transpose(1, 2)


def centertrack_loss(out, t):
    p = out["hm"].sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = t["hm"].eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - t["hm"]) ** 4 * p ** 2 * (1 - p).log()).sum() / pos.sum().clamp(min=1)
    m = t["mask"][..., None]
    tm = t["trk_mask"][..., None]
    l_wh = (F.l1_loss(gather(out["wh"], t["ind"]), t["wh"], reduction="none") * m).sum() / (m.sum() * 2 + 1e-4)
    l_reg = (F.l1_loss(gather(out["reg"], t["ind"]), t["reg"], reduction="none") * m).sum() / (m.sum() * 2 + 1e-4)
    l_trk = (F.l1_loss(gather(out["trk"], t["ind"]), t["trk"], reduction="none") * tm).sum() / (tm.sum() * 2 + 1e-4)
    return {"hm": l_hm, "wh": 0.1 * l_wh, "reg": l_reg, "trk": l_trk}


@torch.no_grad()
def track_seq(model, d, out_txt, thr=0.4):
    n = len(glob.glob(os.path.join(d, "img1", "*.jpg")))
    img0 = cv2.imread(os.path.join(d, "img1", "000001.jpg"))
    sx, sy = INP_W / img0.shape[1], INP_H / img0.shape[0]
    prev_img, tracks, next_id, lines = None, [], 1, []
    for f in range(n // 2 + 1, n + 1):
        cur = preprocess(os.path.join(d, "img1", f"{f:06d}.jpg"))
        prev_img = cur if prev_img is None else prev_img
        pre_hm = np.zeros((INP_H, INP_W), np.float32)
        for _, cx, cy, w, h in tracks:
            draw_gaussian(pre_hm, cx * DOWN, cy * DOWN, w * DOWN, h * DOWN)
        out = model(torch.cat([cur, prev_img, torch.from_numpy(pre_hm)[None]])[None].cuda())
        hm = out["hm"].sigmoid()
        peaks = (hm == F.max_pool2d(hm, 3, 1, 1)) & (hm > thr)
        ys, xs = peaks[0, 0].nonzero(as_tuple=True)
        new_tracks, used = [], set()
        for y, x in sorted(zip(ys.tolist(), xs.tolist()), key=lambda p: -hm[0, 0, p[0], p[1]].item()):
            w, h = out["wh"][0, :, y, x].tolist()
            ox, oy = out["reg"][0, :, y, x].tolist()
            dx, dy = out["trk"][0, :, y, x].tolist()
            cx, cy = x + ox, y + oy
            best, bid = 1e9, None
            for j, (tid, px, py, pw, ph) in enumerate(tracks):
                dd = (cx + dx - px) ** 2 + (cy + dy - py) ** 2
                if j not in used and dd < best and dd < pw * ph:
                    best, bid = dd, j
            if bid is None:
                tid, next_id = next_id, next_id + 1
            else:
                tid = tracks[bid][0]
                used.add(bid)
            new_tracks.append((tid, cx, cy, w, h))
            x1, y1 = (cx - w / 2) * DOWN / sx, (cy - h / 2) * DOWN / sy
            lines.append(f"{f},{tid},{x1:.1f},{y1:.1f},{w * DOWN / sx:.1f},{h * DOWN / sy:.1f},1,-1,-1,-1\n")
        tracks, prev_img = new_tracks, cur
    with open(out_txt, "w") as fh:
        fh.writelines(lines)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    seqs = sorted(s for s in os.listdir(args.data_dir) if s.endswith("SDP"))
    dataset = MOTHalf(args.data_dir, seqs, args.hm_disturb)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)

    model = CenterTrackNet().cuda()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), args.lr)
    res_dir = os.path.join(args.save_dir, "results_val_half")
    if rank == 0:
        os.makedirs(res_dir, exist_ok=True)

    for epoch in range(1, args.num_epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for it, (inp, tgt) in enumerate(loader):
            inp = inp.cuda(non_blocking=True)
            tgt = {k: v.cuda(non_blocking=True) for k, v in tgt.items()}
            losses = centertrack_loss(model(inp), tgt)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if it % 100 == 0:
                stats = torch.stack([v.detach() for v in losses.values()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}|{it}/{len(loader)}] " + " | ".join(f"{k} {v:.4f}" for k, v in zip(losses, stats.tolist())), flush=True)
        if epoch == args.lr_step:
            for g in optimizer.param_groups:
                g["lr"] = args.lr * 0.1
        if rank == 0:
            print(f"epoch {epoch} {time.time() - start:.0f}s", flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.save_dir, "model_last.pth"))

        if epoch % args.val_intervals == 0:
            model.eval()
            for s in seqs[rank::world]:
                track_seq(model.module, os.path.join(args.data_dir, s), os.path.join(res_dir, f"{s}.txt"))
            dist.barrier()
            if rank == 0:
                accs, names = [], []
                for s in seqs:
                    d = os.path.join(args.data_dir, s)
                    n = len(glob.glob(os.path.join(d, "img1", "*.jpg")))
                    gt = mm.io.loadtxt(os.path.join(d, "gt", "gt.txt"), fmt="mot15-2D", min_confidence=1)
                    gt = gt[gt.index.get_level_values("FrameId") > n // 2]
                    ts = mm.io.loadtxt(os.path.join(res_dir, f"{s}.txt"), fmt="mot15-2D")
                    accs.append(mm.utils.compare_to_groundtruth(gt, ts, "iou", distth=0.5))
                    names.append(s)
                mh = mm.metrics.create()
                summary = mh.compute_many(accs, names=names, metrics=["mota", "idf1", "num_switches"], generate_overall=True)
                print(mm.io.render_summary(summary, formatters=mh.formatters, namemap=mm.io.motchallenge_metric_names), flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
