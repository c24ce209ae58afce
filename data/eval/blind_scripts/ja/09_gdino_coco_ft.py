#!/usr/bin/env python3
"""Closed-set COCO fine-tuning of a Grounding-DINO style detector.

The 80 COCO class names form one fixed prompt.  Validation decodes the token
scores back to classes, keeps detections above a score threshold, collects
them from all GPUs and runs COCOeval on rank 0.
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import tv_tensors
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models import swin_s, Swin_S_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer


def get_parser():
    p = argparse.ArgumentParser("gdino-coco")
    p.add_argument("--coco-path", default="/datasets/coco2017")
    p.add_argument("--init", default="weights/groundingdino_swins_pretrain.pth")
    p.add_argument("--output-dir", default="logs/gdino_coco_ft")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-backbone", type=float, default=1e-5)
    p.add_argument("--score-thr", type=float, default=0.05)
    p.add_argument("--max-dets", type=int, default=100)
    p.add_argument("--workers", type=int, default=8)
    return p


def make_transforms(train):
    ops = [T.RandomHorizontalFlip()] if train else []
    ops += [T.Resize(800, max_size=1333), T.ToImage(), T.ToDtype(torch.float32, scale=True),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), T.SanitizeBoundingBoxes()]
    return T.Compose(ops)


def build_dataset(root, split, train):
    ds = CocoDetection(os.path.join(root, f"{split}2017"),
                       os.path.join(root, "annotations", f"instances_{split}2017.json"),
                       transforms=make_transforms(train))
    return wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(i.shape[-2] for i in imgs), max(i.shape[-1] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    out_t = []
    for k, (im, t) in enumerate(zip(imgs, tgts)):
        x[k, :, : im.shape[-2], : im.shape[-1]] = im
        h, w = im.shape[-2:]
        boxes = t.get("boxes", torch.zeros(0, 4))
        boxes = box_convert(torch.as_tensor(boxes, dtype=torch.float32), "xyxy", "cxcywh") / torch.tensor([w, h, w, h])
        out_t.append({"boxes": boxes, "labels": t.get("labels", torch.zeros(0, dtype=torch.long)),
                      "image_id": t["image_id"], "size": (h, w)})
    return x, out_t


class CocoPrompt:
    def __init__(self, coco, tokenizer, max_len=256):
        self.cat_ids = sorted(coco.getCatIds())
        names = [coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        self.caption = " . ".join(names) + " ."
        enc = tokenizer(self.caption, return_tensors="pt", max_length=max_len, padding="max_length")
        self.input_ids, self.attention_mask = enc.input_ids, enc.attention_mask
        self.token_map = torch.zeros(len(names), max_len)
        pos = 0
        for i, n in enumerate(names):
            s = self.caption.index(n, pos)
            e = s + len(n)
            pos = e
            self.token_map[i, enc.char_to_token(s): enc.char_to_token(e - 1) + 1] = 1
        self.label_of_cat = {c: i for i, c in enumerate(self.cat_ids)}


class GDino(nn.Module):
    def __init__(self, d=256, nq=900):
        super().__init__()
        self.backbone = swin_s(weights=Swin_S_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(768, d)
        self.bert = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.tproj = nn.Linear(768, d)
        self.enhancer = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True) for _ in range(6))
        self.text_enhancer = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True) for _ in range(6))
        self.query_selector = nn.Linear(d, 4)
        self.tgt = nn.Embedding(nq, d)
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True) for _ in range(6))
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.nq = nq

    def forward(self, images, ids, am):
        v = self.vproj(self.backbone(images).flatten(1, 2))
        t = self.tproj(self.bert(input_ids=ids, attention_mask=am).last_hidden_state)
        pad = ~am.bool()
        for lv, lt in zip(self.enhancer, self.text_enhancer):
            v, t = lv(v, t, memory_key_padding_mask=pad), lt(t, v, tgt_key_padding_mask=pad)
        # language-guided query selection: top-nq image tokens by max text similarity
        sim = (v @ t.transpose(1, 2)).masked_fill(pad[:, None], -1e4).max(-1).values
        topk = sim.topk(min(self.nq, v.shape[1]), dim=1).indices
        q = torch.gather(v, 1, topk[..., None].expand(-1, -1, v.shape[-1])).detach() + self.tgt.weight[: topk.shape[1]]
        ref = self.query_selector(torch.gather(v, 1, topk[..., None].expand(-1, -1, v.shape[-1]))).sigmoid()
        for layer in self.decoder:
            q = layer(q, v)
        boxes = (self.bbox(q) + torch.logit(ref, eps=1e-4)).sigmoid()
        logits = (q @ t.transpose(1, 2)) / math.sqrt(q.shape[-1])
        return logits.masked_fill(pad[:, None], -1e4), boxes


def set_loss(logits, boxes, targets, token_map):
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tgt_tok = torch.zeros_like(logits)
    l_box = logits.new_zeros(())
    norm_map = token_map / token_map.sum(-1, keepdim=True)
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"], t["labels"]
        with torch.no_grad():
            C = -2 * (logits[b].sigmoid() @ norm_map.T)[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            qi, ti = linear_sum_assignment(C.cpu())
        tgt_tok[b, qi] = token_map[tl[ti]]
        l_box = l_box + 5 * F.l1_loss(boxes[b, qi], tb[ti], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, qi], "cxcywh", "xyxy"), box_convert(tb[ti], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tgt_tok, alpha=0.25, reduction="sum") + l_box) / n


@torch.no_grad()
def evaluate(model, loader, prompt, coco_gt, device, score_thr, max_dets):
    model.eval()
    ids, am = prompt.input_ids.to(device), prompt.attention_mask.to(device)
    norm_map = (prompt.token_map / prompt.token_map.sum(-1, keepdim=True)).to(device)
    rows = []
    for images, tgts in loader:
        B = images.shape[0]
        logits, boxes = model(images.to(device), ids.expand(B, -1), am.expand(B, -1))
        cls_prob = logits.sigmoid() @ norm_map.T
        for b, t in enumerate(tgts):
            info = coco_gt.loadImgs(t["image_id"])[0]
            W, H = info["width"], info["height"]
            s, idx = cls_prob[b].flatten().topk(max_dets)
            q, c = idx // cls_prob.shape[-1], idx % cls_prob.shape[-1]
            keep = s > score_thr
            xywh = box_convert(boxes[b, q[keep]], "cxcywh", "xywh") * torch.tensor([W, H, W, H], device=device)
            cat = torch.tensor(prompt.cat_ids, device=device)[c[keep]]
            img = torch.full_like(s[keep], t["image_id"], dtype=torch.float64)
            rows.append(torch.cat([img[:, None], xywh.double(), s[keep, None].double(), cat[:, None].double()], 1))
    local = torch.cat(rows) if rows else torch.zeros(0, 7, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    dets = torch.cat(gathered).cpu().numpy()
    dets = np.unique(dets, axis=0)  # drop the duplicated images DistributedSampler pads with
    if len(dets) == 0:
        return 0.0
    ev = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = build_dataset(args.coco_path, "train", True)
    val_set = build_dataset(args.coco_path, "val", False)
    coco_val = val_set.coco if hasattr(val_set, "coco") else COCO(os.path.join(args.coco_path, "annotations/instances_val2017.json"))
    prompt = CocoPrompt(coco_val, AutoTokenizer.from_pretrained("bert-base-uncased"))
    label_of_cat = torch.zeros(max(prompt.cat_ids) + 1, dtype=torch.long)
    for c, i in prompt.label_of_cat.items():
        label_of_cat[c] = i

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, drop_last=True, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 2, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate,
                            num_workers=args.workers)

    model = GDino().to(device)
    if os.path.exists(args.init):
        model.load_state_dict(torch.load(args.init, map_location="cpu")["model"], strict=False)
    model = DDP(model, device_ids=[local_rank])
    param_groups = [
        {"params": [p for n, p in model.module.named_parameters() if n.startswith("backbone")], "lr": args.lr_backbone},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("backbone")], "lr": args.lr},
    ]
    opt = torch.optim.AdamW(param_groups, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [11])
    ids, am = prompt.input_ids.to(device), prompt.attention_mask.to(device)
    token_map = prompt.token_map.to(device)

    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, tgts) in enumerate(train_loader):
            tgts = [{"boxes": t["boxes"].to(device), "labels": label_of_cat[t["labels"]].to(device)} for t in tgts]
            B = images.shape[0]
            logits, boxes = model(images.to(device, non_blocking=True), ids.expand(B, -1), am.expand(B, -1))
            loss = set_loss(logits, boxes, tgts, token_map)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            if it % 50 == 0:
                stat = loss.detach().clone()
                dist.all_reduce(stat)
                if rank == 0:
                    print(f"Epoch [{epoch}][{it}/{len(train_loader)}] loss: {stat.item() / world:.4f} "
                          f"time: {(time.time() - t0) / (it + 1):.3f}", flush=True)
        sched.step()
        ap = evaluate(model.module, val_loader, prompt, coco_val, device, args.score_thr, args.max_dets)
        if rank == 0:
            print(f"Epoch {epoch} bbox mAP {ap:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "lr_scheduler": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, f"checkpoint{epoch:04d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
