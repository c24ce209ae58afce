#!/usr/bin/env python
"""DETR R50 on COCO 2017, standalone training script (torchrun)."""
import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops import FrozenBatchNorm2d, box_convert, generalized_box_iou

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
TRAIN_SCALES = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_process():
    return get_rank() == 0


def resize(img, boxes, size, max_size=1333):
    h, w = img.shape[-2:]
    short, long = float(min(h, w)), float(max(h, w))
    if long / short * size > max_size:
        size = int(round(max_size * short / long))
    nh, nw = (int(size * h / w), size) if w < h else (size, int(size * w / h))
    img = F.interpolate(img[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
    return img, boxes * torch.tensor([nw / w, nh / h, nw / w, nh / h])


class CocoDet(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, train):
        super().__init__(img_folder, ann_file)
        self.train = train

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        image_id = self.ids[idx]
        anns = [a for a in anns if a.get("iscrowd", 0) == 0]
        w, h = img.size
        boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(min=0, max=w)
        boxes[:, 1::2].clamp_(min=0, max=h)
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        boxes, labels = boxes[keep], labels[keep]

        img = TF.to_tensor(img)
        if self.train and random.random() < 0.5:
            img = img.flip(-1)
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1, 1, -1, 1]) + torch.tensor([w, 0, w, 0])
        size = random.choice(TRAIN_SCALES) if self.train else 800
        img, boxes = resize(img, boxes, size)
        img = TF.normalize(img, MEAN, STD)
        H, W = img.shape[-2:]
        boxes = box_convert(boxes, "xyxy", "cxcywh") / torch.tensor([W, H, W, H], dtype=torch.float32)
        target = {"boxes": boxes, "labels": labels, "image_id": torch.tensor(image_id),
                  "orig_size": torch.tensor([h, w]), "size": torch.tensor([H, W])}
        return img, target


class NestedTensor:
    def __init__(self, tensors, mask):
        self.tensors, self.mask = tensors, mask

    def to(self, device):
        return NestedTensor(self.tensors.to(device, non_blocking=True), self.mask.to(device, non_blocking=True))


def collate_fn(batch):
    imgs, targets = list(zip(*batch))
    max_h = max(i.shape[1] for i in imgs)
    max_w = max(i.shape[2] for i in imgs)
    tensor = imgs[0].new_zeros((len(imgs), 3, max_h, max_w))
    mask = torch.ones((len(imgs), max_h, max_w), dtype=torch.bool)
    for img, pad, m in zip(imgs, tensor, mask):
        pad[:, : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return NestedTensor(tensor, mask), targets


def sine_pos_embed(mask, num_pos_feats=128, temperature=10000):
    not_mask = ~mask
    y = not_mask.cumsum(1, dtype=torch.float32)
    x = not_mask.cumsum(2, dtype=torch.float32)
    y = y / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = x / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32, device=mask.device)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), dim=4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((py, px), dim=3).permute(0, 3, 1, 2)


class MLP(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, num_layers):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:] + [out_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class DETR(nn.Module):
    def __init__(self, num_classes=91, num_queries=100, d_model=256, enc_layers=6, dec_layers=6, lr_backbone=1e-5):
        super().__init__()
        body = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        for name, p in body.named_parameters():
            if lr_backbone <= 0 or not any(k in name for k in ("layer2", "layer3", "layer4")):
                p.requires_grad_(False)
        self.backbone = IntermediateLayerGetter(body, return_layers={"layer4": "0"})
        self.input_proj = nn.Conv2d(2048, d_model, kernel_size=1)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(d_model, 8, 2048, 0.1, batch_first=True)
                                     for _ in range(enc_layers))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d_model, 8, 2048, 0.1, batch_first=True)
                                     for _ in range(dec_layers))
        self.dec_norm = nn.LayerNorm(d_model)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.class_embed = nn.Linear(d_model, num_classes + 1)
        self.bbox_embed = MLP(d_model, d_model, 4, 3)

    def forward(self, samples: NestedTensor):
        feat = self.backbone(samples.tensors)["0"]
        mask = F.interpolate(samples.mask[None].float(), size=feat.shape[-2:]).to(torch.bool)[0]
        pos = sine_pos_embed(mask).flatten(2).transpose(1, 2)
        src = self.input_proj(feat).flatten(2).transpose(1, 2)
        mask = mask.flatten(1)
        memory = src
        for layer in self.encoder:
            memory = layer(memory + pos, src_key_padding_mask=mask)
        query = self.query_embed.weight.unsqueeze(0).expand(src.shape[0], -1, -1)
        tgt, hs = torch.zeros_like(query), []
        for layer in self.decoder:
            tgt = layer(tgt + query, memory + pos, memory_key_padding_mask=mask)
            hs.append(self.dec_norm(tgt))
        hs = torch.stack(hs)
        logits, boxes = self.class_embed(hs), self.bbox_embed(hs).sigmoid()
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])]
        return out


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=1.0, cost_bbox=5.0, cost_giou=2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, nq = outputs["pred_logits"].shape[:2]
        prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)
        out_bbox = outputs["pred_boxes"].flatten(0, 1)
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_bbox = torch.cat([t["boxes"] for t in targets])
        C = (self.cost_bbox * torch.cdist(out_bbox, tgt_bbox, p=1)
             - self.cost_class * prob[:, tgt_ids]
             - self.cost_giou * generalized_box_iou(box_convert(out_bbox, "cxcywh", "xyxy"),
                                                    box_convert(tgt_bbox, "cxcywh", "xyxy")))
        C = C.view(bs, nq, -1).cpu()
        sizes = [len(t["boxes"]) for t in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef=0.1):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, weight_dict
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def single(self, out, targets, num_boxes, suffix):
        indices = self.matcher(out, targets)
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        logits = out["pred_logits"]
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[batch_idx, src_idx] = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)])
        loss_ce = F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight)
        src_boxes = out["pred_boxes"][batch_idx, src_idx]
        tgt_boxes = torch.cat([t["boxes"][J] for t, (_, J) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction="none").sum() / num_boxes
        giou = torch.diag(generalized_box_iou(box_convert(src_boxes, "cxcywh", "xyxy"),
                                              box_convert(tgt_boxes, "cxcywh", "xyxy")))
        return {f"loss_ce{suffix}": loss_ce, f"loss_bbox{suffix}": loss_bbox,
                f"loss_giou{suffix}": (1 - giou).sum() / num_boxes}

    def forward(self, outputs, targets):
        num_boxes = sum(len(t["labels"]) for t in targets)
        num_boxes = torch.as_tensor([num_boxes], dtype=torch.float)
        if get_world_size() > 1:
            dist.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / get_world_size(), min=1).item()
        losses = self.single(outputs, targets, num_boxes, "")
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            losses.update(self.single(aux, targets, num_boxes, f"_{i}"))
        return losses


@torch.no_grad()
def postprocess(outputs, target_sizes):
    prob = outputs["pred_logits"].softmax(-1)
    scores, labels = prob[..., :-1].max(-1)
    boxes = box_convert(outputs["pred_boxes"], "cxcywh", "xyxy")
    img_h, img_w = target_sizes.unbind(1)
    boxes = boxes * torch.stack([img_w, img_h, img_w, img_h], dim=1)[:, None, :]
    return [{"scores": s, "labels": l, "boxes": b} for s, l, b in zip(scores, labels, boxes)]


def reduce_dict(d):
    ws = get_world_size()
    if ws < 2:
        return d
    with torch.no_grad():
        keys = sorted(d.keys())
        vals = torch.stack([d[k] for k in keys])
        dist.all_reduce(vals)
        vals /= ws
    return dict(zip(keys, vals))


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm):
    model.train()
    wd = criterion.weight_dict
    for it, (samples, targets) in enumerate(loader):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)

        loss_dict_reduced = reduce_dict(loss_dict)
        loss_value = sum(loss_dict_reduced[k] * wd[k] for k in loss_dict_reduced if k in wd).item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        if it % 100 == 0 and is_main_process():
            print(f"epoch {epoch} it {it}/{len(loader)} loss {loss_value:.4f} "
                  f"ce {loss_dict_reduced['loss_ce'].item():.4f}", flush=True)
    return {"loss": loss_value}


def coco_eval(coco_gt, predictions):
    dets = []
    for image_id, p in predictions.items():
        b = p["boxes"].clone()
        b[:, 2:] -= b[:, :2]
        for box, s, l in zip(b.tolist(), p["scores"].tolist(), p["labels"].tolist()):
            dets.append({"image_id": image_id, "category_id": l, "bbox": box, "score": s})
    coco_dt = coco_gt.loadRes(dets)
    E = COCOeval(coco_gt, coco_dt, iouType="bbox")
    E.params.imgIds = sorted(predictions.keys())
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats.tolist()


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    results = {}
    for samples, targets in loader:
        outputs = model(samples.to(device))
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        for t, r in zip(targets, postprocess(outputs, orig)):
            results[int(t["image_id"])] = {k: v.cpu() for k, v in r.items()}
    gathered = [results]
    if get_world_size() > 1:
        gathered = [None] * get_world_size()
        dist.all_gather_object(gathered, results)
    if not is_main_process():
        return None
    merged = {}
    for part in gathered:
        merged.update(part)
    return coco_eval(coco_gt, merged)


def main(args):
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if distributed:
        dist.init_process_group(backend="nccl", init_method="env://")
        dist.barrier()
    device = torch.device("cuda", local_rank)
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model = DETR(num_queries=args.num_queries, lr_backbone=args.lr_backbone).to(device)
    model_without_ddp = model
    if distributed:
        model = DDP(model, device_ids=[local_rank])
        model_without_ddp = model.module
    base = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    weight_dict = dict(base)
    for i in range(5):
        weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
    criterion = SetCriterion(91, HungarianMatcher(), weight_dict, eos_coef=0.1).to(device)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    root = Path(args.coco_path)
    ds_train = CocoDet(root / "train2017", root / "annotations/instances_train2017.json", train=True)
    ds_val = CocoDet(root / "val2017", root / "annotations/instances_val2017.json", train=False)
    if distributed:
        sampler_train = DistributedSampler(ds_train)
        sampler_val = DistributedSampler(ds_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(ds_train)
        sampler_val = torch.utils.data.SequentialSampler(ds_val)
    loader_train = DataLoader(ds_train, batch_sampler=BatchSampler(sampler_train, args.batch_size, drop_last=True),
                              collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(ds_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=collate_fn, num_workers=args.num_workers)

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        if distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        if is_main_process():
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                       output_dir / "checkpoint.pth")
        stats = evaluate(model, loader_val, ds_val.coco, device)
        if is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps({"epoch": epoch, **train_stats, "coco_bbox": stats}) + "\n")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR training")
    parser.add_argument("--coco_path", type=str, required=True)
    parser.add_argument("--output_dir", default="outputs/detr_r50")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr_backbone", type=float, default=1e-5)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--lr_drop", type=int, default=200)
    parser.add_argument("--clip_max_norm", type=float, default=0.1)
    parser.add_argument("--num_queries", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--resume", default="")
    main(parser.parse_args())
