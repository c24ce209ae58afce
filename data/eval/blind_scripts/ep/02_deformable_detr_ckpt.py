"""
Deformable DETR (single-scale queries, no box refinement) with activation
checkpointing in the encoder and bf16 autocast, so that 4 images/GPU fit
at 1333px. Launch with torchrun.
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops import FrozenBatchNorm2d, box_convert, generalized_box_iou


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def ms_deform_attn_core(value, shapes, sampling_locations, attention_weights):
    N, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    value_list = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * sampling_locations - 1
    sampled = []
    for lid, (h, w) in enumerate(shapes):
        v = value_list[lid].flatten(2).transpose(1, 2).reshape(N * M, D, h, w)
        g = grids[:, :, :, lid].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    attention_weights = attention_weights.transpose(1, 2).reshape(N * M, 1, Lq, L * P)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * attention_weights).sum(-1).view(N, M * D, Lq)
    return out.transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.n_levels, self.n_heads, self.n_points = n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        thetas = torch.arange(n_heads, dtype=torch.float32) * (2.0 * math.pi / n_heads)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(n_heads, 1, 1, 2).repeat(1, n_levels, n_points, 1)
        for i in range(n_points):
            grid[:, :, i, :] *= i + 1
        with torch.no_grad():
            self.sampling_offsets.bias = nn.Parameter(grid.view(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)

    def forward(self, query, ref, value, shapes, padding_mask):
        N, Lq, C = query.shape
        value = self.value_proj(value).masked_fill(padding_mask[..., None], 0.0)
        value = value.view(N, value.shape[1], self.n_heads, C // self.n_heads)
        off = self.sampling_offsets(query).view(N, Lq, self.n_heads, self.n_levels, self.n_points, 2)
        attn = self.attention_weights(query).view(N, Lq, self.n_heads, self.n_levels * self.n_points)
        attn = attn.softmax(-1).view(N, Lq, self.n_heads, self.n_levels, self.n_points)
        normalizer = torch.tensor([[w, h] for h, w in shapes], dtype=query.dtype, device=query.device)
        loc = ref[:, :, None, :, None, :] + off / normalizer[None, None, None, :, None, :]
        return self.output_proj(ms_deform_attn_core(value, shapes, loc, attn))


class EncoderLayer(nn.Module):
    def __init__(self, d=256, ff=1024, dropout=0.1):
        super().__init__()
        self.attn = MSDeformAttn(d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, pos, ref, shapes, mask):
        src = self.norm1(src + self.dropout(self.attn(src + pos, ref, src, shapes, mask)))
        return self.norm2(src + self.dropout(self.ffn(src)))


class DecoderLayer(nn.Module):
    def __init__(self, d=256, ff=1024, dropout=0.1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, 8, dropout=dropout, batch_first=True)
        self.cross_attn = MSDeformAttn(d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.dropout = nn.Dropout(dropout)

    def forward(self, tgt, query_pos, ref, memory, shapes, mask):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.dropout(self.self_attn(q, k, tgt)[0]))
        tgt = self.norm2(tgt + self.dropout(self.cross_attn(tgt + query_pos, ref, memory, shapes, mask)))
        return self.norm3(tgt + self.dropout(self.ffn(tgt)))


def sine_pos_embed(mask, num_feats=128, temperature=10000):
    not_mask = ~mask
    y = not_mask.cumsum(1, dtype=torch.float32)
    x = not_mask.cumsum(2, dtype=torch.float32)
    y = (y - 0.5) / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = (x - 0.5) / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    dim_t = temperature ** (2 * (torch.arange(num_feats, device=mask.device) // 2) / num_feats)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), dim=4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((py, px), dim=3)


class DeformableDETR(nn.Module):
    def __init__(self, num_classes=91, num_queries=300, d=256, n_enc=6, n_dec=6, grad_ckpt=False):
        super().__init__()
        body = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        for name, p in body.named_parameters():
            if not any(k in name for k in ("layer2", "layer3", "layer4")):
                p.requires_grad_(False)
        self.backbone = IntermediateLayerGetter(body, {"layer2": "0", "layer3": "1", "layer4": "2"})
        self.input_proj = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(c, d, 1), nn.GroupNorm(32, d)) for c in (512, 1024, 2048)]
            + [nn.Sequential(nn.Conv2d(2048, d, 3, stride=2, padding=1), nn.GroupNorm(32, d))])
        self.level_embed = nn.Parameter(torch.randn(4, d))
        self.encoder = nn.ModuleList(EncoderLayer(d) for _ in range(n_enc))
        self.decoder = nn.ModuleList(DecoderLayer(d) for _ in range(n_dec))
        self.query_embed = nn.Embedding(num_queries, 2 * d)
        self.reference_points = nn.Linear(d, 2)
        self.class_embed = nn.Linear(d, num_classes)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        nn.init.constant_(self.class_embed.bias, -math.log((1 - 0.01) / 0.01))
        self.num_queries, self.d, self.grad_ckpt = num_queries, d, grad_ckpt

    def forward(self, images, pad_mask):
        feats = list(self.backbone(images).values())
        srcs = [proj(f) for proj, f in zip(self.input_proj, feats)] + [self.input_proj[3](feats[-1])]
        masks = [F.interpolate(pad_mask[None].float(), size=s.shape[-2:]).to(torch.bool)[0] for s in srcs]
        shapes = [tuple(s.shape[-2:]) for s in srcs]
        valid = torch.stack([torch.stack([(~m[:, 0, :]).sum(1) / m.shape[2], (~m[:, :, 0]).sum(1) / m.shape[1]], -1)
                             for m in masks], 1).to(srcs[0].dtype)
        src = torch.cat([s.flatten(2).transpose(1, 2) for s in srcs], 1)
        pos = torch.cat([sine_pos_embed(m).flatten(1, 2) + self.level_embed[l] for l, m in enumerate(masks)], 1)
        mask = torch.cat([m.flatten(1) for m in masks], 1)

        refs = []
        for lvl, (h, w) in enumerate(shapes):
            ry, rx = torch.meshgrid(torch.linspace(0.5, h - 0.5, h, device=src.device),
                                    torch.linspace(0.5, w - 0.5, w, device=src.device), indexing="ij")
            refs.append(torch.stack((rx.reshape(-1)[None] / (valid[:, None, lvl, 0] * w),
                                     ry.reshape(-1)[None] / (valid[:, None, lvl, 1] * h)), -1))
        enc_ref = torch.cat(refs, 1)[:, :, None] * valid[:, None]

        memory = src
        for layer in self.encoder:
            if self.grad_ckpt and self.training:
                memory = checkpoint(layer, memory, pos, enc_ref, shapes, mask, use_reentrant=False)
            else:
                memory = layer(memory, pos, enc_ref, shapes, mask)

        query_pos, tgt = self.query_embed.weight.split(self.d, dim=1)
        query_pos = query_pos.unsqueeze(0).expand(src.shape[0], -1, -1)
        tgt = tgt.unsqueeze(0).expand(src.shape[0], -1, -1)
        ref_pts = self.reference_points(query_pos).sigmoid()
        hs = []
        for layer in self.decoder:
            tgt = layer(tgt, query_pos, ref_pts[:, :, None] * valid[:, None], memory, shapes, mask)
            hs.append(tgt)
        hs = torch.stack(hs)
        logits = self.class_embed(hs)
        delta = self.bbox_embed(hs)
        boxes = torch.cat([delta[..., :2] + inverse_sigmoid(ref_pts), delta[..., 2:]], -1).sigmoid()
        return [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits, boxes)]


class FocalMatcherCriterion(nn.Module):
    """Hungarian matching + focal / L1 / GIoU, applied to every decoder layer."""

    def __init__(self, num_classes, w_cls=2.0, w_l1=5.0, w_giou=2.0, alpha=0.25, gamma=2.0):
        super().__init__()
        self.num_classes, self.alpha, self.gamma = num_classes, alpha, gamma
        self.w_cls, self.w_l1, self.w_giou = w_cls, w_l1, w_giou

    @torch.no_grad()
    def match(self, logits, boxes, targets):
        bs, nq = logits.shape[:2]
        prob = logits.flatten(0, 1).sigmoid()
        out_bbox = boxes.flatten(0, 1)
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_bbox = torch.cat([t["boxes"] for t in targets])
        neg = (1 - self.alpha) * prob ** self.gamma * -(1 - prob + 1e-8).log()
        pos = self.alpha * (1 - prob) ** self.gamma * -(prob + 1e-8).log()
        C = (self.w_cls * (pos[:, tgt_ids] - neg[:, tgt_ids]) + self.w_l1 * torch.cdist(out_bbox, tgt_bbox, p=1)
             - self.w_giou * generalized_box_iou(box_convert(out_bbox, "cxcywh", "xyxy"),
                                                 box_convert(tgt_bbox, "cxcywh", "xyxy")))
        C = C.view(bs, nq, -1).cpu()
        sizes = [len(t["boxes"]) for t in targets]
        return [tuple(torch.as_tensor(x, dtype=torch.int64) for x in linear_sum_assignment(c[i]))
                for i, c in enumerate(C.split(sizes, -1))]

    def forward(self, layer_outputs, targets):
        num_boxes = torch.tensor([sum(len(t["labels"]) for t in targets)], dtype=torch.float,
                                 device=layer_outputs[-1]["pred_logits"].device)
        if dist.is_initialized():
            dist.all_reduce(num_boxes)
            num_boxes /= dist.get_world_size()
        num_boxes = num_boxes.clamp(min=1).item()
        total, last = 0.0, {}
        for out in layer_outputs:
            logits, boxes = out["pred_logits"].float(), out["pred_boxes"].float()
            indices = self.match(logits, boxes, targets)
            b_idx = torch.cat([torch.full_like(s, i) for i, (s, _) in enumerate(indices)])
            s_idx = torch.cat([s for s, _ in indices])
            onehot = torch.zeros(logits.shape[0], logits.shape[1], self.num_classes + 1, device=logits.device)
            onehot[b_idx, s_idx, torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])] = 1
            onehot = onehot[..., :-1]
            p = logits.sigmoid()
            ce = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")
            p_t = p * onehot + (1 - p) * (1 - onehot)
            a_t = self.alpha * onehot + (1 - self.alpha) * (1 - onehot)
            l_cls = (a_t * ce * (1 - p_t) ** self.gamma).mean(1).sum() / num_boxes * logits.shape[1]
            src = boxes[b_idx, s_idx]
            tgt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)])
            l_l1 = F.l1_loss(src, tgt, reduction="sum") / num_boxes
            l_giou = (1 - torch.diag(generalized_box_iou(box_convert(src, "cxcywh", "xyxy"),
                                                         box_convert(tgt, "cxcywh", "xyxy")))).sum() / num_boxes
            total = total + self.w_cls * l_cls + self.w_l1 * l_l1 + self.w_giou * l_giou
            last = {"cls": l_cls.detach(), "l1": l_l1.detach(), "giou": l_giou.detach()}
        return total, last


class CocoDet(torchvision.datasets.CocoDetection):
    scales = [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800]

    def __init__(self, root, ann, train):
        super().__init__(root, ann)
        self.train = train

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(0, w)
        boxes[:, 1::2].clamp_(0, h)
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes, labels = boxes[keep], labels[keep]
        if self.train and random.random() < 0.5:
            img = TF.hflip(img)
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1.0, 1, -1, 1]) + torch.tensor([w, 0.0, w, 0])
        size = random.choice(self.scales) if self.train else 800
        scale = min(size / min(w, h), 1333 / max(w, h))
        nw, nh = int(round(w * scale)), int(round(h * scale))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [nh, nw])), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        boxes = box_convert(boxes * scale, "xyxy", "cxcywh") / torch.tensor([nw, nh, nw, nh], dtype=torch.float32)
        return img, {"boxes": boxes, "labels": labels, "image_id": self.ids[idx], "orig_size": torch.tensor([h, w])}


def collate(batch):
    imgs, targets = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    out = imgs[0].new_zeros(len(imgs), 3, H, W)
    mask = torch.ones(len(imgs), H, W, dtype=torch.bool)
    for k, im in enumerate(imgs):
        out[k, :, : im.shape[1], : im.shape[2]] = im
        mask[k, : im.shape[1], : im.shape[2]] = False
    return out, mask, list(targets)


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, amp_dtype):
    model.eval()
    dets = {}
    for images, mask, targets in loader:
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(images.to(device, non_blocking=True), mask.to(device, non_blocking=True))[-1]
        prob = out["pred_logits"].float().sigmoid()
        scores, topk = prob.flatten(1).topk(100, dim=1)
        labels = topk % prob.shape[2]
        boxes = torch.gather(box_convert(out["pred_boxes"].float(), "cxcywh", "xywh"), 1,
                             (topk // prob.shape[2]).unsqueeze(-1).repeat(1, 1, 4))
        for t, s, l, b in zip(targets, scores, labels, boxes):
            h, w = t["orig_size"].tolist()
            b = (b * torch.tensor([w, h, w, h], device=b.device)).cpu()
            dets[t["image_id"]] = [{"image_id": t["image_id"], "category_id": int(c), "bbox": bb, "score": float(sc)}
                                   for c, bb, sc in zip(l.tolist(), b.tolist(), s.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for p in parts:
        merged.update(p)  # DistributedSampler pads with repeated images; keep one copy per image id
    E = COCOeval(coco_gt, coco_gt.loadRes([d for v in merged.values() for d in v]), "bbox")
    E.params.imgIds = list(merged.keys())
    E.evaluate(), E.accumulate(), E.summarize()
    return E.stats.tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco_path", required=True)
    ap.add_argument("--output_dir", default="work_dirs/deformable_detr_ckpt")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr_drop", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lr_backbone", type=float, default=2e-5)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--resume", default="")
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)
    random.seed(1234 + rank)
    amp_dtype = torch.bfloat16 if args.bf16 else None

    model = DeformableDETR(grad_ckpt=args.grad_ckpt).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank])
    criterion = FocalMatcherCriterion(num_classes=91)
    groups = [{"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("backbone")]},
              {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("backbone")],
               "lr": args.lr_backbone}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    root = Path(args.coco_path)
    train_set = CocoDet(root / "train2017", root / "annotations/instances_train2017.json", train=True)
    val_set = CocoDet(root / "val2017", root / "annotations/instances_val2017.json", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=args.workers)

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        for it, (images, mask, targets) in enumerate(train_loader):
            images, mask = images.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                outputs = ddp_model(images, mask)
            loss, parts = criterion(outputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 0.1)
            optimizer.step()
            if it % 50 == 0:
                logged = torch.stack([loss.detach()] + list(parts.values()))
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}][{it}/{len(train_loader)}] loss={logged[0]:.3f} cls={logged[1]:.3f} "
                          f"l1={logged[2]:.3f} giou={logged[3]:.3f} {time.time() - tic:.0f}s", flush=True)
        scheduler.step()

        stats = evaluate(ddp_model, val_loader, val_set.coco, device, amp_dtype)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, out_dir / "checkpoint.pth")
            with open(out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch, "mAP": stats[0], "AP50": stats[1], "queries": model.num_queries}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
