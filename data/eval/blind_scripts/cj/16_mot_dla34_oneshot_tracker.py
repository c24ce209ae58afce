"""One-shot tracker (CenterNet detection + re-ID head) with a DLA-34 backbone, MOT17 + MOT20.

Long runs are split over several jobs: pass --resume to continue from model_last.pth.

torchrun --nproc_per_node=8 16_mot_dla34_oneshot_tracker.py --data-root /data/mot --exp-dir exp/dla34_mix --resume
"""
import argparse
import math
import os
import os.path as osp

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MAX_OBJS = 256
TRAIN_LISTS = {"mot17": ("mot17.train", 1638), "mot20": ("mot20.train", 2215)}
VAL_LIST = "mot17.half_val"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/mot")
    ap.add_argument("--exp-dir", default="exp/dla34_mix")
    ap.add_argument("--pretrained", default="", help="CenterNet COCO weights")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--batch-size", type=int, default=6, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 48")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--input", type=int, nargs=2, default=[1088, 608])
    return ap.parse_args()


def heat_radius(h, w):
    a, b, c = 4, 2 * (h + w), (1 - 0.7) * w * h / (1 + 0.7)
    return max(0, int((b + math.sqrt(b * b - 4 * a * c)) / 4))


def splat(hm, cx, cy, r):
    size = 2 * r + 1
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    g = np.exp(-(x * x + y * y) / (2 * (size / 6) ** 2))
    H, W = hm.shape
    x0, x1, y0, y1 = max(0, cx - r), min(W, cx + r + 1), max(0, cy - r), min(H, cy + r + 1)
    hm[y0:y1, x0:x1] = np.maximum(hm[y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])


class MOTFrames(Dataset):
    def __init__(self, root, lists, input_wh, train=True):
        self.input_w, self.input_h = input_wh
        self.train = train
        self.samples, offset = [], 0
        for list_name, num_ids in lists:
            with open(osp.join(root, "lists", list_name)) as f:
                for line in f:
                    img = osp.join(root, line.strip())
                    self.samples.append((img, img.replace("images", "labels_with_ids")[:-4] + ".txt", offset))
            offset += num_ids
        self.num_ids = offset

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        img_path, label_path, id_offset = self.samples[i]
        img = cv2.resize(cv2.imread(img_path), (self.input_w, self.input_h))
        lab = np.loadtxt(label_path, dtype=np.float32, ndmin=2) if osp.getsize(label_path) else np.zeros((0, 6), np.float32)
        if self.train and np.random.rand() < 0.5:
            img = img[:, ::-1]
            lab[:, 2] = 1.0 - lab[:, 2]
        ow, oh = self.input_w // 4, self.input_h // 4
        hm = np.zeros((1, oh, ow), np.float32)
        t = {k: np.zeros(s, d) for k, s, d in [("wh", (MAX_OBJS, 2), np.float32), ("reg", (MAX_OBJS, 2), np.float32),
                                                ("ind", (MAX_OBJS,), np.int64), ("mask", (MAX_OBJS,), np.float32),
                                                ("ids", (MAX_OBJS,), np.int64)]}
        for k, (_, tid, x, y, w, h) in enumerate(lab[:MAX_OBJS]):
            x, y, w, h = x * ow, y * oh, w * ow, h * oh
            cx, cy = int(x), int(y)
            if w <= 0 or h <= 0 or not (0 <= cx < ow and 0 <= cy < oh):
                continue
            splat(hm[0], cx, cy, heat_radius(math.ceil(h), math.ceil(w)))
            t["wh"][k] = (w, h)
            t["reg"][k] = (x - cx, y - cy)
            t["ind"][k] = cy * ow + cx
            t["mask"][k] = 1
            t["ids"][k] = int(tid) + id_offset
        img = torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1))).float() / 255.0
        return img, torch.from_numpy(hm), {k: torch.from_numpy(v) for k, v in t.items()}


class DLATracker(nn.Module):
    def __init__(self, num_ids, emb_dim=128):
        super().__init__()
        self.body = timm.create_model("dla34", pretrained=True, features_only=True, out_indices=(2, 3, 4, 5))
        chs = self.body.feature_info.channels()
        self.lateral = nn.ModuleList([nn.Conv2d(c, 64, 1) for c in chs])
        self.smooth = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        head = lambda o: nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, o, 1))
        self.hm, self.wh, self.reg, self.id = head(1), head(2), head(2), head(emb_dim)
        self.hm[-1].bias.data.fill_(-2.19)
        self.id_classifier = nn.Linear(emb_dim, num_ids)
        self.emb_scale = math.sqrt(2) * math.log(num_ids - 1)

    def forward(self, x):
        feats = self.body(x)
        y = self.lateral[-1](feats[-1])
        for f, lat in zip(reversed(feats[:-1]), reversed(self.lateral[:-1])):
            y = F.interpolate(y, size=f.shape[-2:], mode="bilinear", align_corners=False) + lat(f)
        y = self.smooth(y)
        return self.hm(y), self.wh(y), self.reg(y), self.id(y)


def gather(fmap, ind):
    b, c = fmap.shape[:2]
    return fmap.flatten(2).transpose(1, 2).gather(1, ind[..., None].expand(-1, -1, c))


def tracker_loss(net, outputs, hm_gt, t, with_id=True):
    hm, wh, reg, emb = outputs
    p = hm.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm_gt.eq(1).float()
    focal = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - hm_gt) ** 4 * (1 - pos)).sum()
    focal = focal / pos.sum().clamp(min=1)
    m = t["mask"].unsqueeze(2)
    n = m.sum().clamp(min=1)
    l_wh = (F.l1_loss(gather(wh, t["ind"]) * m, t["wh"] * m, reduction="sum") / n)
    l_reg = (F.l1_loss(gather(reg, t["ind"]) * m, t["reg"] * m, reduction="sum") / n)
    l_id = torch.zeros((), device=hm.device)
    if with_id:
        sel = t["mask"] > 0
        e = net.emb_scale * F.normalize(gather(emb, t["ind"])[sel], dim=1)
        l_id = F.cross_entropy(net.id_classifier(e), t["ids"][sel])
    return focal + 0.1 * l_wh + l_reg + l_id, torch.stack([focal, l_wh, l_reg, l_id]).detach()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = MOTFrames(args.data_root, TRAIN_LISTS.values(), args.input)
    val_set = MOTFrames(args.data_root, [(VAL_LIST, 0)], args.input, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=8, pin_memory=True)

    net = DLATracker(train_set.num_ids)
    if args.pretrained:
        state = torch.load(args.pretrained, map_location=lambda storage, loc: storage)["state_dict"]
        own = net.state_dict()
        net.load_state_dict({k: v for k, v in state.items() if k in own and v.shape == own[k].shape}, strict=False)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * args.batch_size * world / 48)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [20], 0.1)

    start_epoch = 0
    last_path = osp.join(args.exp_dir, "model_last.pth")
    if args.resume and osp.exists(last_path):
        ckpt = torch.load(last_path)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {last_path} at epoch {start_epoch}", flush=True)
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (img, hm_gt, t) in enumerate(train_loader):
            img, hm_gt = img.to(device, non_blocking=True), hm_gt.to(device, non_blocking=True)
            t = {k: v.to(device, non_blocking=True) for k, v in t.items()}
            loss, parts = tracker_loss(model.module, model(img), hm_gt, t)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            if it % 100 == 0:
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch + 1} it {it}/{len(train_loader)} hm {parts[0]:.3f} wh {parts[1]:.3f} "
                          f"off {parts[2]:.3f} id {parts[3]:.3f}", flush=True)
        scheduler.step()

        model.eval()
        val = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, hm_gt, t in val_loader:
                img, hm_gt = img.to(device), hm_gt.to(device)
                t = {k: v.to(device) for k, v in t.items()}
                # val identities are not in the training label space: detection terms only
                _, parts = tracker_loss(model.module, model.module(img), hm_gt, t, with_id=False)
                val += torch.stack([parts[0], parts[1], torch.ones((), device=device)])
        dist.all_reduce(val)
        if rank == 0:
            print(f"epoch {epoch + 1}: val hm {val[0] / val[2]:.4f} wh {val[1] / val[2]:.4f}", flush=True)
            state = {"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            torch.save(state, last_path)
            if (epoch + 1) % 10 == 0:
                torch.save(state, osp.join(args.exp_dir, f"model_{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
