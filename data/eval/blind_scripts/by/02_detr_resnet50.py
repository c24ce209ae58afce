"""DETR (R50, 6+6 layers) trained on COCO, single file version.

torchrun --nproc_per_node=8 detr_resnet50.py --coco-path /data/coco
"""
import argparse
import datetime
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.ops import generalized_box_iou, box_convert


def parse_args():
    p = argparse.ArgumentParser("DETR training")
    p.add_argument("--coco-path", type=str, required=True)
    p.add_argument("--output-dir", type=str, default="outputs/detr_r50")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-backbone", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr-drop", type=int, default=200)
    p.add_argument("--clip-max-norm", type=float, default=0.1)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--hidden-dim", type=int, default=256)
    p.add_argument("--eos-coef", type=float, default=0.1)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", type=str, default="")
    return p.parse_args()


# ---------------------------------------------------------------- data
class CocoDetr(torchvision.datasets.CocoDetection):
    def __init__(self, root, ann_file, train):
        super().__init__(root, ann_file)
        self.train = train
        scales = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]
        self.scales = scales if train else [800]
        self.normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if a.get("iscrowd", 0) == 0]
        boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(0, w)
        boxes[:, 1::2].clamp_(0, h)
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes, labels = boxes[keep], labels[keep]

        if self.train and random.random() < 0.5:
            img = img.transpose(0)  # PIL.Image.FLIP_LEFT_RIGHT
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1, 1, -1, 1]) + torch.tensor([w, 0, w, 0])
        size = random.choice(self.scales)
        scale = size / min(w, h)
        if max(w, h) * scale > 1333:
            scale = 1333 / max(w, h)
        nw, nh = int(round(w * scale)), int(round(h * scale))
        img = img.resize((nw, nh))
        boxes = boxes * scale

        img = self.normalize(img)
        cxcywh = box_convert(boxes, "xyxy", "cxcywh") / torch.tensor([nw, nh, nw, nh], dtype=torch.float32)
        target = {"boxes": cxcywh, "labels": labels, "image_id": self.ids[idx],
                  "orig_size": torch.tensor([h, w]), "size": torch.tensor([nh, nw])}
        return img, target


def collate_fn(batch):
    imgs, targets = zip(*batch)
    max_h = max(i.shape[1] for i in imgs)
    max_w = max(i.shape[2] for i in imgs)
    tensor = imgs[0].new_zeros(len(imgs), 3, max_h, max_w)
    mask = torch.ones(len(imgs), max_h, max_w, dtype=torch.bool)
    for i, img in enumerate(imgs):
        tensor[i, :, : img.shape[1], : img.shape[2]].copy_(img)
        mask[i, : img.shape[1], : img.shape[2]] = False
    return tensor, mask, list(targets)


# ---------------------------------------------------------------- model
class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000):
        super().__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        eps = 1e-6
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * 2 * math.pi
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * 2 * math.pi
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class DETR(nn.Module):
    def __init__(self, num_classes=91, num_queries=100, hidden_dim=256):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V1",
                                               norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(backbone.children())[:-2])
        for name, p in self.backbone.named_parameters():
            if not name.startswith(("5", "6", "7")):  # layer2..layer4 are trained
                p.requires_grad_(False)
        self.input_proj = nn.Conv2d(2048, hidden_dim, 1)
        self.pos = PositionEmbeddingSine(hidden_dim // 2)
        self.transformer = nn.Transformer(hidden_dim, 8, 6, 6, 2048, 0.1, batch_first=True)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
                                        nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
                                        nn.Linear(hidden_dim, 4))

    def forward(self, images, mask):
        feat = self.backbone(images)
        mask = F.interpolate(mask[None].float(), size=feat.shape[-2:])[0].bool()
        pos = self.pos(mask).flatten(2).transpose(1, 2)
        src = self.input_proj(feat).flatten(2).transpose(1, 2)
        key_mask = mask.flatten(1)
        memory = self.transformer.encoder(src + pos, src_key_padding_mask=key_mask)
        query = self.query_embed.weight.unsqueeze(0).expand(src.shape[0], -1, -1)
        hs = self.transformer.decoder(query, memory + pos, memory_key_padding_mask=key_mask)
        return {"pred_logits": self.class_embed(hs), "pred_boxes": self.bbox_embed(hs).sigmoid()}


# ---------------------------------------------------------------- loss
@torch.no_grad()
def hungarian_match(outputs, targets, cost_class=1.0, cost_bbox=5.0, cost_giou=2.0):
    bs, nq = outputs["pred_logits"].shape[:2]
    prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)
    out_bbox = outputs["pred_boxes"].flatten(0, 1)
    tgt_ids = torch.cat([t["labels"] for t in targets])
    tgt_bbox = torch.cat([t["boxes"] for t in targets])
    if tgt_ids.numel() == 0:
        return [(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)) for _ in targets]
    c = (cost_bbox * torch.cdist(out_bbox, tgt_bbox, p=1) - cost_class * prob[:, tgt_ids]
         - cost_giou * generalized_box_iou(box_convert(out_bbox, "cxcywh", "xyxy"),
                                           box_convert(tgt_bbox, "cxcywh", "xyxy")))
    c = c.view(bs, nq, -1).cpu()
    sizes = [len(t["boxes"]) for t in targets]
    idx = [linear_sum_assignment(ci[i]) for i, ci in enumerate(c.split(sizes, -1))]
    return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in idx]


class SetCriterion(nn.Module):
    def __init__(self, num_classes, eos_coef):
        super().__init__()
        self.num_classes = num_classes
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)
        self.weights = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}

    def forward(self, outputs, targets):
        indices = hungarian_match(outputs, targets)
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])

        num_boxes = sum(len(t["labels"]) for t in targets)
        num_boxes = torch.as_tensor([num_boxes], dtype=torch.float)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / dist.get_world_size(), min=1).item()

        logits = outputs["pred_logits"]
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes_o = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
        target_classes[batch_idx, src_idx] = target_classes_o
        loss_ce = F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight)

        src_boxes = outputs["pred_boxes"][batch_idx, src_idx]
        tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction="none").sum() / num_boxes
        loss_giou = (1 - torch.diag(generalized_box_iou(box_convert(src_boxes, "cxcywh", "xyxy"),
                                                        box_convert(tgt_boxes, "cxcywh", "xyxy")))).sum() / num_boxes
        losses = {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}
        total = sum(self.weights[k] * v for k, v in losses.items())
        return total, losses


# ---------------------------------------------------------------- train / eval
def train_one_epoch(model, criterion, loader, optimizer, device, epoch, max_norm, rank):
    model.train()
    criterion.train()
    t0 = time.time()
    for it, (images, masks, targets) in enumerate(loader):
        images, masks = images.to(device, non_blocking=True), masks.to(device, non_blocking=True)
        targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
        outputs = model(images, masks)
        loss, loss_dict = criterion(outputs, targets)
        optimizer.zero_grad()
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

        if it % 50 == 0:
            logged = torch.stack([loss.detach()] + [v.detach() for v in loss_dict.values()])
            dist.all_reduce(logged)
            logged /= dist.get_world_size()
            if rank == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {logged[0]:.4f} ce {logged[1]:.4f} "
                      f"l1 {logged[2]:.4f} giou {logged[3]:.4f} ({time.time() - t0:.0f}s)", flush=True)


@torch.no_grad()
def evaluate(model, loader, device, coco_gt, rank):
    from pycocotools.cocoeval import COCOeval
    model.eval()
    results = {}
    for images, masks, targets in loader:
        outputs = model(images.to(device), masks.to(device))
        prob = outputs["pred_logits"].softmax(-1)[..., :-1]
        scores, labels = prob.max(-1)
        for b, t in enumerate(targets):
            h, w = t["orig_size"].tolist()
            boxes = box_convert(outputs["pred_boxes"][b], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            results[t["image_id"]] = [{"image_id": t["image_id"], "category_id": int(l), "bbox": bx, "score": float(s)}
                                      for bx, s, l in zip(boxes.tolist(), scores[b].tolist(), labels[b].tolist())]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank != 0:
        return
    merged = {}
    for r in gathered:
        merged.update(r)
    dets = [d for v in merged.values() for d in v]
    coco_eval = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    coco_eval.params.imgIds = list(merged.keys())
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval.stats.tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    root = Path(args.coco_path)
    train_set = CocoDetr(root / "train2017", root / "annotations/instances_train2017.json", train=True)
    val_set = CocoDetr(root / "val2017", root / "annotations/instances_val2017.json", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=2, sampler=val_sampler, collate_fn=collate_fn,
                            num_workers=args.num_workers)

    model = DETR(num_queries=args.num_queries, hidden_dim=args.hidden_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    criterion = SetCriterion(91, args.eos_coef).to(device)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    start_epoch = 0
    out_dir = Path(args.output_dir)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"world_size={world_size}  trainable params={n_params}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, train_loader, optimizer, device, epoch, args.clip_max_norm, rank)
        lr_scheduler.step()
        if rank == 0:
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": vars(args)},
                       out_dir / "checkpoint.pth")
        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            stats = evaluate(model_without_ddp, val_loader, device, val_set.coco, rank)
            if rank == 0:
                with (out_dir / "log.txt").open("a") as f:
                    f.write(json.dumps({"epoch": epoch, "coco_eval_bbox": stats}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
