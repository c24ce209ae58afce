"""Anchor-free temporal action localisation on THUMOS14 I3D features (ActionFormer-lite).

Features: one .npy per video, [T, 2048] at 4-frame stride (30 fps, 16-frame windows).
Evaluation gathers the detections of every rank and computes mAP@tIoU 0.3:0.7 on rank 0.

  torchrun --nproc_per_node=4 06_tal_thumos_anchorfree.py --feat-dir thumos/i3d_features \
      --ann thumos/thumos14.json --out runs/tal_thumos
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.ops import batched_nms, sigmoid_focal_loss

FPS, STRIDE, WIN = 30.0, 4, 16
NUM_CLASSES = 20


class ThumosFeatures(Dataset):
    def __init__(self, feat_dir, ann_file, subset, max_len=2304):
        with open(ann_file) as f:
            db = json.load(f)["database"]
        self.feat_dir, self.max_len = feat_dir, max_len
        self.train = subset == "validation"  # THUMOS14: train on 'validation', test on 'test'
        self.items = []
        for vid, info in sorted(db.items()):
            if info["subset"] != subset:
                continue
            segs = np.array([a["segment"] for a in info["annotations"]], dtype=np.float32).reshape(-1, 2)
            labels = np.array([a["label_id"] for a in info["annotations"]], dtype=np.int64)
            self.items.append((vid, segs, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, segs, labels = self.items[i]
        feats = np.load(os.path.join(self.feat_dir, vid + ".npy")).astype(np.float32)
        # seconds -> feature index (center of each 16-frame window)
        segs_f = (segs * FPS - 0.5 * WIN) / STRIDE
        if self.train and len(feats) > self.max_len:
            st = np.random.randint(0, len(feats) - self.max_len + 1)
            feats = feats[st:st + self.max_len]
            segs_f = segs_f - st
            keep = (segs_f[:, 1] > 0) & (segs_f[:, 0] < self.max_len)
            segs_f, labels = np.clip(segs_f[keep], 0, self.max_len), labels[keep]
        return {"vid": i, "feats": torch.from_numpy(feats), "segs": torch.from_numpy(segs_f),
                "labels": torch.from_numpy(labels)}


def collate(batch):
    max_t = max(b["feats"].shape[0] for b in batch)
    max_t = int(np.ceil(max_t / 32) * 32)
    feats = torch.zeros(len(batch), max_t, batch[0]["feats"].shape[1])
    mask = torch.zeros(len(batch), max_t, dtype=torch.bool)
    for i, b in enumerate(batch):
        feats[i, : len(b["feats"])] = b["feats"]
        mask[i, : len(b["feats"])] = True
    return {"vid": torch.tensor([b["vid"] for b in batch]), "feats": feats, "mask": mask,
            "segs": [b["segs"] for b in batch], "labels": [b["labels"] for b in batch]}


class ConvBlock(nn.Module):
    def __init__(self, dim, k=3):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, k, padding=k // 2)
        self.norm = nn.GroupNorm(16, dim)

    def forward(self, x):
        return F.relu(self.norm(self.conv(x))) + x


class LocNet(nn.Module):
    def __init__(self, in_dim=2048, dim=512, depth=4):
        super().__init__()
        self.proj = nn.Conv1d(in_dim, dim, 1)
        self.body = nn.Sequential(*[ConvBlock(dim) for _ in range(depth)])
        self.cls_head = nn.Sequential(ConvBlock(dim), nn.Conv1d(dim, NUM_CLASSES, 3, padding=1))
        self.reg_head = nn.Sequential(ConvBlock(dim), nn.Conv1d(dim, 2, 3, padding=1))
        nn.init.constant_(self.cls_head[-1].bias, -4.6)  # prior 0.01

    def forward(self, feats, mask):
        x = self.body(self.proj(feats.transpose(1, 2))) * mask[:, None]
        cls = self.cls_head(x).transpose(1, 2)                  # B T C
        reg = F.relu(self.reg_head(x)).transpose(1, 2)          # B T 2  (dist to start / end)
        return cls, reg


def build_targets(segs_list, labels_list, T, device, radius=1.5):
    cls_t = torch.zeros(len(segs_list), T, NUM_CLASSES, device=device)
    reg_t = torch.zeros(len(segs_list), T, 2, device=device)
    pos = torch.zeros(len(segs_list), T, dtype=torch.bool, device=device)
    t = torch.arange(T, device=device, dtype=torch.float32)
    for b, (segs, labels) in enumerate(zip(segs_list, labels_list)):
        segs, labels = segs.to(device), labels.to(device)
        if segs.numel() == 0:
            continue
        center = segs.mean(1)
        inside = (t[:, None] >= segs[None, :, 0]) & (t[:, None] <= segs[None, :, 1])
        near = (t[:, None] - center[None]).abs() <= radius * (segs[:, 1] - segs[:, 0]).clamp(min=1)[None] / 2
        ok = inside & near
        length = (segs[:, 1] - segs[:, 0])[None].expand(T, -1).masked_fill(~ok, float("inf"))
        best_len, best = length.min(1)
        p = torch.isfinite(best_len)
        pos[b] = p
        cls_t[b, p, labels[best[p]]] = 1.0
        reg_t[b, p, 0] = t[p] - segs[best[p], 0]
        reg_t[b, p, 1] = segs[best[p], 1] - t[p]
    return cls_t, reg_t, pos


def diou_loss(pred, tgt):
    ps, pe, ts, te = -pred[:, 0], pred[:, 1], -tgt[:, 0], tgt[:, 1]
    inter = (torch.min(pe, te) - torch.max(ps, ts)).clamp(min=0)
    union = (pe - ps) + (te - ts) - inter
    enclose = torch.max(pe, te) - torch.min(ps, ts)
    center = ((ps + pe) - (ts + te)) / 2
    return (1 - inter / union.clamp(min=1e-6) + (center / enclose.clamp(min=1e-6)) ** 2).mean()


@torch.no_grad()
def detect(model, batch, device, score_thr=0.001, topk=2000, nms_iou=0.5, max_dets=200):
    cls, reg = model(batch["feats"].to(device), batch["mask"].to(device))
    out = []
    for b in range(cls.shape[0]):
        T = int(batch["mask"][b].sum())
        scores = cls[b, :T].sigmoid().flatten()
        keep = scores > score_thr
        idx = keep.nonzero().squeeze(1)
        idx = idx[scores[idx].topk(min(topk, idx.numel())).indices]
        t, c = idx // NUM_CLASSES, idx % NUM_CLASSES
        st = t.float() - reg[b, t, 0]
        ed = t.float() + reg[b, t, 1]
        boxes = torch.stack([st, torch.zeros_like(st), ed, torch.ones_like(ed)], 1)
        k = batched_nms(boxes, scores[idx], c, nms_iou)[:max_dets]
        # (video index, start s, end s, label, score)
        sec = lambda x: (x * STRIDE + 0.5 * WIN) / FPS
        out.append(torch.stack([torch.full_like(st[k], float(batch["vid"][b])), sec(st[k]), sec(ed[k]),
                                c[k].float(), scores[idx][k]], 1))
    return torch.cat(out) if out else torch.zeros(0, 5, device=device)


def temporal_iou(seg, segs):
    inter = (np.minimum(seg[1], segs[:, 1]) - np.maximum(seg[0], segs[:, 0])).clip(min=0)
    union = (seg[1] - seg[0]) + (segs[:, 1] - segs[:, 0]) - inter
    return inter / np.maximum(union, 1e-6)


def average_mAP(dets, dataset, tious=(0.3, 0.4, 0.5, 0.6, 0.7)):
    gts = {i: (segs, labels) for i, (_, segs, labels) in enumerate(dataset.items)}
    maps = []
    for thr in tious:
        aps = []
        for c in range(NUM_CLASSES):
            d = dets[dets[:, 3] == c]
            d = d[np.argsort(-d[:, 4])]
            npos = sum(int((l == c).sum()) for _, l in gts.values())
            used = {v: np.zeros(int((l == c).sum()), bool) for v, (_, l) in gts.items()}
            tp = np.zeros(len(d))
            for j, (v, s, e, _, _) in enumerate(d):
                segs, labels = gts[int(v)]
                g = segs[labels == c]
                if len(g) == 0:
                    continue
                ious = temporal_iou((s, e), g)
                m = int(ious.argmax())
                if ious[m] >= thr and not used[int(v)][m]:
                    used[int(v)][m], tp[j] = True, 1
            if npos == 0:
                continue
            prec = np.cumsum(tp) / np.arange(1, len(tp) + 1)
            ap = sum(prec[tp == 1]) / npos if len(tp) else 0.0
            aps.append(ap if np.isfinite(ap) else 0.0)
        maps.append(float(np.mean(aps)))
    return maps


def evaluate(model, loader, dataset, device, world):
    model.eval()
    local = [detect(model, batch, device) for batch in loader]
    local = torch.cat(local) if local else torch.zeros(0, 5, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if dist.get_rank() != 0:
        return None
    return average_mAP(torch.cat(gathered).cpu().numpy(), dataset)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat-dir", required=True)
    ap.add_argument("--ann", required=True)
    ap.add_argument("--out", default="runs/tal_thumos")
    ap.add_argument("--epochs", type=int, default=35)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    train_ds = ThumosFeatures(args.feat_dir, args.ann, "validation")
    test_ds = ThumosFeatures(args.feat_dir, args.ann, "test")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_idx = list(range(rank, len(test_ds), world))
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, test_idx), 1, collate_fn=collate, num_workers=4)

    model = DDP(LocNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=5 / args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_loader):
            feats, mask = batch["feats"].to(device), batch["mask"].to(device)
            cls, reg = model(feats, mask)
            cls_t, reg_t, pos = build_targets(batch["segs"], batch["labels"], feats.shape[1], device)
            num_pos = pos.sum().float()
            dist.all_reduce(num_pos)
            norm = max(num_pos.item() / world, 1.0)
            valid = mask
            loss_cls = sigmoid_focal_loss(cls[valid], cls_t[valid], reduction="sum") / norm
            loss_reg = diou_loss(reg[pos], reg_t[pos]) if pos.any() else reg.sum() * 0
            loss = loss_cls + loss_reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"ep {epoch} it {it} cls {loss_cls.item():.3f} reg {loss_reg.item():.3f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            maps = evaluate(model.module, test_loader, test_ds, device, world)
            if rank == 0:
                print(f"epoch {epoch}: mAP@[.3:.7] " + " ".join(f"{m * 100:.1f}" for m in maps)
                      + f" avg {np.mean(maps) * 100:.2f}", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "mAP": maps},
                           os.path.join(args.out, f"epoch_{epoch:03d}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
