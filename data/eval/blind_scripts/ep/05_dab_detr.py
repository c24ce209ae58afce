#!/usr/bin/env python3
"""DAB-DETR style detector: 4-D anchor queries refined layer by layer.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        05_dab_detr.py --coco /datasets/coco --out /checkpoint/$USER/dab_detr
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import tv_tensors
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops import FrozenBatchNorm2d, box_convert, generalized_box_iou
from torchvision.transforms import v2 as T
from pycocotools.cocoeval import COCOeval

SCALES = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]


def build_dataset(root, split, train):
    tf = [T.RandomHorizontalFlip(), T.RandomShortestSize(SCALES, max_size=1333)] if train else \
        [T.RandomShortestSize([800], max_size=1333)]
    tf += [T.ToImage(), T.ToDtype(torch.float32, scale=True),
           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
    ds = CocoDetection(f"{root}/{split}2017", f"{root}/annotations/instances_{split}2017.json",
                       transforms=T.Compose(tf))
    return wrap_dataset_for_transforms_v2(ds, target_keys={"boxes", "labels", "image_id"})


def collate(batch):
    imgs = [b[0] for b in batch]
    H, W = max(i.shape[-2] for i in imgs), max(i.shape[-1] for i in imgs)
    pixels = torch.zeros(len(imgs), 3, H, W)
    mask = torch.ones(len(imgs), H, W, dtype=torch.bool)
    targets = []
    for k, (img, tgt) in enumerate(batch):
        h, w = img.shape[-2:]
        pixels[k, :, :h, :w] = img
        mask[k, :h, :w] = False
        # images without annotations come back without "boxes"/"labels": keep them as negatives
        boxes = tgt.get("boxes", tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w)))
        boxes = box_convert(boxes.as_subclass(torch.Tensor), "xyxy", "cxcywh") / torch.tensor([w, h, w, h])
        targets.append({"boxes": boxes, "labels": tgt.get("labels", torch.zeros(0, dtype=torch.int64)),
                        "image_id": tgt["image_id"]})
    return pixels, mask, targets


def inverse_sigmoid(x, eps=1e-3):
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def sine_embed(coords, d_half=128, temperature=10000):
    """coords: (..., k) in [0,1] -> (..., k*d_half)"""
    dim_t = torch.arange(d_half, dtype=torch.float32, device=coords.device)
    dim_t = temperature ** (2 * (dim_t // 2) / d_half)
    pos = coords[..., None] * 2 * math.pi / dim_t
    pos = torch.stack((pos[..., 0::2].sin(), pos[..., 1::2].cos()), dim=-1).flatten(-2)
    return pos.flatten(-2)


def mlp(i, h, o, n):
    layers = []
    for k in range(n):
        layers += [nn.Linear(i if k == 0 else h, o if k == n - 1 else h)]
        if k < n - 1:
            layers += [nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class DABDETR(nn.Module):
    def __init__(self, num_classes=91, num_queries=300, d=256, n_enc=6, n_dec=6):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=FrozenBatchNorm2d)
        for n, p in r50.named_parameters():
            p.requires_grad_(n.startswith(("layer2", "layer3", "layer4")))
        self.backbone = IntermediateLayerGetter(r50, {"layer4": "out"})
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.0, batch_first=True), n_enc)
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 2048, 0.0, batch_first=True)
                                     for _ in range(n_dec))
        self.dec_norm = nn.LayerNorm(d)
        self.refpoint_embed = nn.Embedding(num_queries, 4)
        self.ref_point_head = mlp(4 * d // 2, d, d, 2)
        self.class_embed = nn.Linear(d, num_classes)
        self.bbox_embed = mlp(d, d, 4, 3)
        nn.init.constant_(self.class_embed.bias, -math.log(99))
        nn.init.zeros_(self.bbox_embed[-1].weight)
        nn.init.zeros_(self.bbox_embed[-1].bias)
        self.d = d

    def forward(self, pixels, mask):
        feat = self.backbone(pixels)["out"]
        m = F.interpolate(mask[None].float(), size=feat.shape[-2:])[0].bool()
        not_m = ~m
        ys = not_m.cumsum(1, dtype=torch.float32)
        xs = not_m.cumsum(2, dtype=torch.float32)
        yx = torch.stack([xs / (xs[:, :, -1:] + 1e-6), ys / (ys[:, -1:, :] + 1e-6)], -1)
        pos = sine_embed(yx, self.d // 2).flatten(1, 2)
        src = self.input_proj(feat).flatten(2).transpose(1, 2)
        m = m.flatten(1)
        memory = self.encoder(src + pos, src_key_padding_mask=m)

        bs = src.shape[0]
        ref = self.refpoint_embed.weight.sigmoid().unsqueeze(0).expand(bs, -1, -1)
        tgt = torch.zeros(bs, ref.shape[1], self.d, device=src.device)
        outs = []
        for layer in self.decoder:
            query_pos = self.ref_point_head(sine_embed(ref, self.d // 2))
            tgt = layer(tgt + query_pos, memory + pos, memory_key_padding_mask=m)
            h = self.dec_norm(tgt)
            new_ref = (self.bbox_embed(h) + inverse_sigmoid(ref)).sigmoid()
            outs.append({"pred_logits": self.class_embed(h), "pred_boxes": new_ref})
            ref = new_ref.detach()
        return outs


class Criterion(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0, w=(2.0, 5.0, 2.0)):
        super().__init__()
        self.alpha, self.gamma, self.w = alpha, gamma, w

    @torch.no_grad()
    def match(self, out, targets):
        bs, nq, _ = out["pred_logits"].shape
        if sum(len(t["labels"]) for t in targets) == 0:
            e = torch.empty(0, dtype=torch.int64)
            return [(e, e) for _ in targets]
        p = out["pred_logits"].flatten(0, 1).sigmoid()
        b = out["pred_boxes"].flatten(0, 1)
        ids = torch.cat([t["labels"] for t in targets])
        tb = torch.cat([t["boxes"] for t in targets])
        pos_cost = self.alpha * (1 - p[:, ids]) ** self.gamma * -(p[:, ids] + 1e-8).log()
        neg_cost = (1 - self.alpha) * p[:, ids] ** self.gamma * -(1 - p[:, ids] + 1e-8).log()
        C = self.w[0] * (pos_cost - neg_cost) + self.w[1] * torch.cdist(b, tb, p=1) \
            - self.w[2] * generalized_box_iou(box_convert(b, "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
        C = C.view(bs, nq, -1).cpu()
        splits = C.split([len(t["labels"]) for t in targets], -1)
        return [tuple(torch.as_tensor(a, dtype=torch.int64) for a in linear_sum_assignment(c[i]))
                for i, c in enumerate(splits)]

    def forward(self, outs, targets):
        n = torch.tensor([float(sum(len(t["labels"]) for t in targets))], device=outs[0]["pred_logits"].device)
        dist.all_reduce(n)
        num_boxes = max(n.item() / dist.get_world_size(), 1.0)
        logs, total = {}, 0.0
        for lvl, out in enumerate(outs):
            idx = self.match(out, targets)
            bi = torch.cat([torch.full_like(s, i) for i, (s, _) in enumerate(idx)])
            si = torch.cat([s for s, _ in idx])
            logits = out["pred_logits"]
            onehot = torch.zeros_like(logits)
            onehot[bi, si, torch.cat([t["labels"][j] for t, (_, j) in zip(targets, idx)])] = 1.0
            loss_cls = torchvision.ops.sigmoid_focal_loss(logits, onehot, self.alpha, self.gamma, reduction="sum")
            loss_cls = loss_cls / num_boxes
            src = out["pred_boxes"][bi, si]
            tgt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, idx)])
            loss_l1 = F.l1_loss(src, tgt, reduction="sum") / num_boxes
            loss_giou = (1 - generalized_box_iou(box_convert(src, "cxcywh", "xyxy"),
                                                 box_convert(tgt, "cxcywh", "xyxy")).diag()).sum() / num_boxes
            total = total + self.w[0] * loss_cls + self.w[1] * loss_l1 + self.w[2] * loss_giou
            if lvl == len(outs) - 1:
                logs = {"cls": loss_cls.detach(), "l1": loss_l1.detach(), "giou": loss_giou.detach()}
        return total, logs


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    preds = {}
    for pixels, mask, targets in loader:
        out = model(pixels.to(device), mask.to(device))[-1]
        prob = out["pred_logits"].sigmoid()
        scores, idx = prob.flatten(1).topk(100, dim=1)
        labels, qidx = idx % prob.shape[-1], idx // prob.shape[-1]
        boxes = out["pred_boxes"].gather(1, qidx[..., None].expand(-1, -1, 4))
        for t, s, l, b in zip(targets, scores.cpu(), labels.cpu(), boxes.cpu()):
            info = coco_gt.imgs[t["image_id"]]
            b = box_convert(b, "cxcywh", "xywh") * torch.tensor([info["width"], info["height"]] * 2)
            preds[t["image_id"]] = (s, l, b)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, preds)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for s in shards:
        merged.update(s)
    dets = [{"image_id": i, "category_id": int(l), "bbox": b.tolist(), "score": float(s)}
            for i, (ss, ll, bb) in merged.items() for s, l, b in zip(ss, ll, bb)]
    E = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    E.params.imgIds = sorted(merged)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coco", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr_drop", type=int, default=40)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--init", default="", help="warm start from a DAB-DETR checkpoint")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42 + rank)

    model = DABDETR().to(device)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("model", sd)
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        print(model.load_state_dict(sd, strict=False))
    model = DDP(model, device_ids=[local_rank])
    criterion = Criterion()
    named = list(model.module.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if p.requires_grad and not n.startswith("backbone")]},
        {"params": [p for n, p in named if p.requires_grad and n.startswith("backbone")], "lr": args.lr * 0.1},
    ], lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [args.lr_drop])

    train_ds, val_ds = build_dataset(args.coco, "train", True), build_dataset(args.coco, "val", False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=6)

    out = Path(args.out)
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(out / "tb")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for pixels, mask, targets in train_dl:
            pixels, mask = pixels.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
            loss, logs = criterion(model(pixels, mask), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            step += 1
            if step % 20 == 0:
                vec = torch.stack([loss.detach(), *logs.values()])
                dist.all_reduce(vec)
                vec /= dist.get_world_size()
                if writer is not None:
                    for name, v in zip(["loss", *logs.keys()], vec.tolist()):
                        writer.add_scalar(f"train/{name}", v, step)
        sched.step()
        stats = evaluate(model, val_dl, val_ds.coco, device)
        if rank == 0:
            writer.add_scalar("val/mAP", stats[0], epoch)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       out / f"epoch_{epoch:03d}.pth")
            print(json.dumps({"epoch": epoch, "mAP": float(stats[0]), "min": (time.time() - t0) / 60}), flush=True)
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
