"""
Small DETR (ResNet-18, trainable BN) on PASCAL VOC converted to COCO json.
One process per GPU via torch.multiprocessing.spawn:

    python 10_detr_r18_voc_spawn.py --data /data/voc_coco --gpus 4
"""
import argparse
import json
import math
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, generalized_box_iou

NUM_CLASSES = 20


class VOCCoco(torchvision.datasets.CocoDetection):
    def __init__(self, root, split, train):
        super().__init__(os.path.join(root, "JPEGImages"), os.path.join(root, f"voc_{split}.json"))
        self.train = train
        self.cat2label = {c: i for i, c in enumerate(sorted(self.coco.getCatIds()))}

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([self.cat2label[a["category_id"]] for a in anns], dtype=torch.int64)
        if self.train and random.random() < 0.5:
            img = TF.hflip(img)
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        short = random.choice([320, 352, 384, 416, 448, 480, 512]) if self.train else 512
        s = min(short / min(w, h), 853 / max(w, h))
        nw, nh = round(w * s), round(h * s)
        img = TF.normalize(TF.to_tensor(TF.resize(img, [nh, nw])), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        boxes = box_convert(boxes * s, "xyxy", "cxcywh") / torch.tensor([nw, nh, nw, nh])
        return img, {"boxes": boxes, "labels": labels, "image_id": self.ids[idx], "orig_size": (h, w)}


def pad_collate(batch):
    imgs, targets = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    mask = torch.ones(len(imgs), H, W, dtype=torch.bool)
    for i, im in enumerate(imgs):
        x[i, :, : im.shape[1], : im.shape[2]] = im
        mask[i, : im.shape[1], : im.shape[2]] = False
    return x, mask, list(targets)


class SmallDETR(nn.Module):
    def __init__(self, num_classes, num_queries=100, d=256):
        super().__init__()
        r18 = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r18.children())[:-2])
        self.neck = nn.Sequential(nn.Conv2d(512, d, 1, bias=False), nn.BatchNorm2d(d), nn.ReLU(inplace=True))
        self.pos = nn.Parameter(torch.randn(1, d, 50, 50) * 0.02)
        self.transformer = nn.Transformer(d, 8, 4, 4, 1024, 0.1, batch_first=True)
        self.query = nn.Embedding(num_queries, d)
        self.class_embed = nn.Linear(d, num_classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, mask):
        f = self.neck(self.backbone(x))
        m = F.interpolate(mask[None].float(), size=f.shape[-2:])[0].bool()
        pos = F.interpolate(self.pos, size=f.shape[-2:], mode="bilinear", align_corners=False)
        src = (f + pos).flatten(2).transpose(1, 2)
        q = self.query.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        hs = self.transformer(src, q, src_key_padding_mask=m.flatten(1), memory_key_padding_mask=m.flatten(1))
        return self.class_embed(hs), self.bbox_embed(hs).sigmoid()


@torch.no_grad()
def hungarian(logits, boxes, targets):
    prob = logits.softmax(-1)
    out = []
    for p, b, t in zip(prob, boxes, targets):
        if len(t["labels"]) == 0:
            out.append((torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)))
            continue
        giou = generalized_box_iou(box_convert(b, "cxcywh", "xyxy"), box_convert(t["boxes"], "cxcywh", "xyxy"))
        C = 5 * torch.cdist(b, t["boxes"], p=1) - p[:, t["labels"]] - 2 * giou
        i, j = linear_sum_assignment(C.cpu().numpy())
        out.append((torch.as_tensor(i, dtype=torch.long), torch.as_tensor(j, dtype=torch.long)))
    return out


def detr_loss(logits, boxes, targets, eos_coef=0.1):
    device = logits.device
    idx = hungarian(logits, boxes, targets)
    n = torch.tensor([sum(len(t["labels"]) for t in targets)], dtype=torch.float32, device=device)
    dist.all_reduce(n)
    num_boxes = torch.clamp(n / dist.get_world_size(), min=1).item()
    weight = torch.ones(NUM_CLASSES + 1, device=device)
    weight[-1] = eos_coef
    tgt_cls = torch.full(logits.shape[:2], NUM_CLASSES, dtype=torch.long, device=device)
    b_idx = torch.cat([torch.full_like(s, k) for k, (s, _) in enumerate(idx)])
    s_idx = torch.cat([s for s, _ in idx])
    tgt_cls[b_idx, s_idx] = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, idx)])
    loss_ce = F.cross_entropy(logits.transpose(1, 2), tgt_cls, weight)
    src_b = boxes[b_idx, s_idx]
    tgt_b = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, idx)])
    loss_l1 = F.l1_loss(src_b, tgt_b, reduction="sum") / num_boxes
    loss_giou = (1 - generalized_box_iou(box_convert(src_b, "cxcywh", "xyxy"),
                                         box_convert(tgt_b, "cxcywh", "xyxy")).diag()).sum() / num_boxes
    return loss_ce + 5 * loss_l1 + 2 * loss_giou


@torch.no_grad()
def evaluate(model, loader, coco_gt, label2cat, device):
    model.eval()
    preds = {}
    for x, mask, targets in loader:
        logits, boxes = model(x.to(device), mask.to(device))
        scores, labels = logits.softmax(-1)[..., :-1].max(-1)
        for t, s, l, b in zip(targets, scores.cpu(), labels.cpu(), boxes.cpu()):
            h, w = t["orig_size"]
            b = box_convert(b, "cxcywh", "xywh") * torch.tensor([w, h, w, h])
            preds[t["image_id"]] = [{"image_id": t["image_id"], "category_id": label2cat[int(c)],
                                     "bbox": bb, "score": float(sc)} for sc, c, bb in zip(s, l, b.tolist())]
    all_preds = [None] * dist.get_world_size()
    dist.all_gather_object(all_preds, preds)
    merged = {}
    for p in all_preds:
        merged.update(p)
    E = COCOeval(coco_gt, coco_gt.loadRes([d for v in merged.values() for d in v]), "bbox")
    E.params.imgIds = sorted(merged)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats[1]  # AP50 is the usual VOC number


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = SmallDETR(NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])
    optim = torch.optim.AdamW([
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]},
        {"params": model.module.backbone.parameters(), "lr": args.lr * 0.1},
    ], lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs)

    train_set, val_set = VOCCoco(args.data, "trainval", True), VOCCoco(args.data, "test", False)
    label2cat = {v: k for k, v in val_set.cat2label.items()}
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=pad_collate,
                              num_workers=args.workers, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, collate_fn=pad_collate,
                            num_workers=args.workers)

    ckpt_path = Path(args.out) / "last.pth"
    start = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{gpu}"})
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start = ckpt["epoch"] + 1

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (x, mask, targets) in enumerate(train_loader):
            x, mask = x.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
            logits, boxes = model(x, mask)
            loss = detr_loss(logits, boxes, targets)
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optim.step()
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item() / world_size:.4f}", flush=True)
        sched.step()
        ap50 = evaluate(model, val_loader, val_set.coco, label2cat, device)
        if rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
            with open(Path(args.out) / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP50": float(ap50)}) + "\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/detr_r18_voc")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--node_rank", type=int, default=0)
    ap.add_argument("--dist_url", default="tcp://127.0.0.1:23456")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args))
