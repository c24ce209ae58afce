#!/usr/bin/env python3
"""Clip-level training of an end-to-end query-based multi-object tracker (MOTR-style).

Every sample is a short clip of frames from one sequence. Detect queries find new
objects; queries that hold an identity after a frame are refined by the query
interaction module (QIM) and fed into the next frame as track queries.
"""
import argparse
import json
import math
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, generalized_box_iou

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args():
    p = argparse.ArgumentParser("MOTR clip training")
    p.add_argument("--data-root", default="/data/MOT17")
    p.add_argument("--out", default="runs/motr_clip")
    p.add_argument("--clip-len", type=int, default=5)
    p.add_argument("--max-interval", type=int, default=3)
    p.add_argument("--min-vis", type=float, default=0.25)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-backbone", type=float, default=2e-5)
    p.add_argument("--lr-drop", type=int, default=40)
    p.add_argument("--num-queries", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clip-grad", type=float, default=0.1)
    p.add_argument("--resume", default="")
    return p.parse_args()


class MOTClipDataset(Dataset):
    def __init__(self, root, split, clip_len, max_interval, min_vis, crop=True):
        self.clip_len, self.max_interval, self.crop = clip_len, max_interval, crop
        self.seqs, self.index = {}, []
        split_dir = os.path.join(root, split)
        for seq in sorted(os.listdir(split_dir)):
            if not seq.endswith("FRCNN"):  # MOT17 ships every sequence three times
                continue
            boxes = defaultdict(list)
            with open(os.path.join(split_dir, seq, "gt", "gt.txt")) as f:
                for line in f:
                    fr, tid, x, y, w, h, mark, cls, vis = line.strip().split(",")[:9]
                    if int(mark) == 0 or int(cls) != 1 or float(vis) < min_vis:
                        continue
                    boxes[int(fr)].append((int(tid), float(x), float(y), float(w), float(h)))
            img_dir = os.path.join(split_dir, seq, "img1")
            n = len(os.listdir(img_dir))
            self.seqs[seq] = (img_dir, boxes)
            for start in range(1, n - (clip_len - 1) * max_interval + 1):
                self.index.append((seq, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        seq, start = self.index[i]
        img_dir, boxes = self.seqs[seq]
        step = random.randint(1, self.max_interval)
        frames, targets = [], []
        crop_box = None
        for k in range(self.clip_len):
            fr = start + k * step
            img = Image.open(os.path.join(img_dir, f"{fr:06d}.jpg")).convert("RGB")
            W, H = img.size
            b = torch.tensor([[x, y, x + w, y + h] for _, x, y, w, h in boxes[fr]], dtype=torch.float32).reshape(-1, 4)
            ids = torch.tensor([t for t, *_ in boxes[fr]], dtype=torch.int64)
            if self.crop and crop_box is None:
                cw, ch = int(W * random.uniform(0.5, 1.0)), int(H * random.uniform(0.5, 1.0))
                crop_box = (random.randint(0, W - cw), random.randint(0, H - ch), cw, ch)
            if crop_box is not None:
                x0, y0, cw, ch = crop_box
                img = img.crop((x0, y0, x0 + cw, y0 + ch))
                b = b - torch.tensor([x0, y0, x0, y0])
                b[:, 0::2].clamp_(0, cw)
                b[:, 1::2].clamp_(0, ch)
                keep = ((b[:, 2] - b[:, 0]) > 4) & ((b[:, 3] - b[:, 1]) > 4)
                b, ids = b[keep], ids[keep]
                W, H = cw, ch
            img = TF.resize(img, [608, 1088])
            img = TF.normalize(TF.to_tensor(img), MEAN, STD)
            b = box_convert(b, "xyxy", "cxcywh") / torch.tensor([W, H, W, H])
            frames.append(img)
            targets.append({"boxes": b, "ids": ids})
        return torch.stack(frames), targets


def collate_clip(batch):
    assert len(batch) == 1, "one clip per GPU"
    return batch[0]


class MLP(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, n):
        super().__init__()
        dims = [d_in] + [d_hidden] * (n - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:] + [d_out]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


class QueryInteraction(nn.Module):
    def __init__(self, dim, ffn=1024, dropout=0.1):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 8, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ffn, dim))
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, q):
        q = self.norm1(q + self.attn(q, q, q)[0])
        return self.norm2(q + self.ffn(q))


class MOTRLite(nn.Module):
    def __init__(self, num_queries=300, dim=256, dec_layers=6):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r50.children())[:-2])
        self.input_proj = nn.Conv2d(2048, dim, 1)
        self.pos = nn.Parameter(torch.randn(1, dim, 19, 34) * 0.02)
        layer = nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, dec_layers)
        self.query_embed = nn.Embedding(num_queries, dim)
        self.class_head = nn.Linear(dim, 1)
        self.box_head = MLP(dim, dim, 4, 3)
        self.qim = QueryInteraction(dim)

    def forward_frame(self, img, track_q):
        feat = self.input_proj(self.backbone(img))
        pos = F.interpolate(self.pos, size=feat.shape[-2:], mode="bilinear", align_corners=False)
        memory = (feat + pos).flatten(2).transpose(1, 2)
        q = self.query_embed.weight.unsqueeze(0)
        if track_q is not None:
            q = torch.cat([track_q, q], 1)
        hs = self.decoder(q, memory)
        return hs, self.class_head(hs)[0, :, 0], self.box_head(hs)[0].sigmoid()

    def forward(self, frames, targets, criterion):
        track_q, track_ids, losses = None, [], defaultdict(float)
        for t in range(frames.shape[0]):
            hs, logits, boxes = self.forward_frame(frames[t : t + 1], track_q)
            frame_losses, matched = criterion(logits, boxes, targets[t], track_ids)
            for k, v in frame_losses.items():
                losses[k] = losses[k] + v / frames.shape[0]
            if len(matched) > 0 and t < frames.shape[0] - 1:
                idx = torch.tensor([q for q, _ in matched], device=hs.device)
                track_q = self.qim(hs[:, idx])
                track_ids = [tid for _, tid in matched]
            else:
                track_q, track_ids = None, []
        return losses


class ClipCriterion(nn.Module):
    def __init__(self, w_cls=2.0, w_l1=5.0, w_giou=2.0):
        super().__init__()
        self.w = dict(cls=w_cls, l1=w_l1, giou=w_giou)

    def forward(self, logits, boxes, tgt, track_ids):
        gt_boxes, gt_ids = tgt["boxes"], tgt["ids"].tolist()
        n_track = len(track_ids)
        pairs = []  # (query index, gt index)
        for qi, tid in enumerate(track_ids):
            if tid in gt_ids:
                pairs.append((qi, gt_ids.index(tid)))
        free_gt = [g for g in range(len(gt_ids)) if g not in {p[1] for p in pairs}]
        if free_gt:
            det_boxes = boxes[n_track:]
            cost = torch.cdist(det_boxes, gt_boxes[free_gt], p=1) * self.w["l1"]
            cost -= generalized_box_iou(box_convert(det_boxes, "cxcywh", "xyxy"), box_convert(gt_boxes[free_gt], "cxcywh", "xyxy")) * self.w["giou"]
            cost -= logits[n_track:].sigmoid().unsqueeze(1) * self.w["cls"]
            rows, cols = linear_sum_assignment(cost.detach().cpu())
            pairs += [(n_track + r, free_gt[c]) for r, c in zip(rows, cols)]
        cls_t = torch.zeros_like(logits)
        loss_l1 = loss_giou = boxes.sum() * 0
        if pairs:
            q_idx = torch.tensor([p[0] for p in pairs], device=logits.device)
            g_idx = torch.tensor([p[1] for p in pairs], device=logits.device)
            cls_t[q_idx] = 1.0
            src, dst = boxes[q_idx], gt_boxes[g_idx]
            loss_l1 = F.l1_loss(src, dst, reduction="sum") / len(pairs)
            loss_giou = (1 - torch.diag(generalized_box_iou(box_convert(src, "cxcywh", "xyxy"), box_convert(dst, "cxcywh", "xyxy")))).mean()
        loss_cls = torchvision.ops.sigmoid_focal_loss(logits, cls_t, reduction="sum") / max(len(pairs), 1)
        losses = {"cls": loss_cls * self.w["cls"], "l1": loss_l1 * self.w["l1"], "giou": loss_giou * self.w["giou"]}
        return losses, [(q, gt_ids[g]) for q, g in pairs]


def reduce_dict(d):
    keys = sorted(d)
    vals = torch.stack([d[k].detach() for k in keys])
    dist.all_reduce(vals)
    vals /= dist.get_world_size()
    return {k: v.item() for k, v in zip(keys, vals)}


def to_cuda(frames, targets, device):
    return frames.to(device, non_blocking=True), [{k: v.to(device) for k, v in t.items()} for t in targets]


@torch.no_grad()
def evaluate(model, criterion, loader, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for frames, targets in loader:
        frames, targets = to_cuda(frames, targets, device)
        losses = model.module(frames, targets, criterion)
        total[0] += sum(losses.values()).item()
        total[1] += 1
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    random.seed(42 + rank)

    train_set = MOTClipDataset(args.data_root, "train", args.clip_len, args.max_interval, args.min_vis)
    val_set = MOTClipDataset(args.data_root, "val", args.clip_len, 1, args.min_vis, crop=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=args.workers,
                              collate_fn=collate_clip, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=args.workers, collate_fn=collate_clip)

    model = MOTRLite(args.num_queries).to(device)
    criterion = ClipCriterion()
    model = DDP(model, device_ids=[local_rank])

    backbone_params = [p for n, p in model.module.named_parameters() if n.startswith("backbone") and p.requires_grad]
    other_params = [p for n, p in model.module.named_parameters() if not n.startswith("backbone") and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": other_params, "lr": args.lr},
                                   {"params": backbone_params, "lr": args.lr_backbone}], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log_file = open(os.path.join(args.out, "log.jsonl"), "a")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (frames, targets) in enumerate(train_loader):
            frames, targets = to_cuda(frames, targets, device)
            losses = model(frames, targets, criterion)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            if it % 50 == 0:
                logged = reduce_dict(losses)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{len(train_loader)} " + " ".join(f"{k}={v:.4f}" for k, v in logged.items()), flush=True)
        scheduler.step()
        val_loss = evaluate(model, criterion, val_loader, device)
        if rank == 0:
            rec = {"epoch": epoch, "val_loss": val_loss, "time": time.time() - t0}
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
