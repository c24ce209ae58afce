#!/usr/bin/env python
# Open-vocabulary detection on LVIS (base/novel split): a DETR-style box predictor
# whose classifier is a frozen matrix of CLIP text embeddings, one row per class
# name.  Training uses base classes only; evaluation swaps in all 1203 classes.
import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from lvis import LVIS, LVISEval, LVISResults
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import convnext_tiny, ConvNeXt_Tiny_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import CLIPModel, CLIPTokenizer

TEMPLATES = ["a photo of a {}.", "a photo of the {}.", "a photo of a small {}.", "a photo of a large {}.",
             "a close-up photo of a {}.", "there is a {} in the scene."]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lvis-root", default="/mnt/data/lvis")
    ap.add_argument("--coco-images", default="/mnt/data/coco")
    ap.add_argument("--clip-model", default="openai/clip-vit-base-patch32")
    ap.add_argument("--output", default="work_dirs/ovd_lvis_base")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


@torch.no_grad()
def build_text_classifier(class_names, clip_name, device="cuda:0"):
    clip = CLIPModel.from_pretrained(clip_name).to(device).eval()
    tok = CLIPTokenizer.from_pretrained(clip_name)
    weights = []
    for name in class_names:
        name = name.replace("_", " ")
        enc = tok([t.format(name) for t in TEMPLATES], padding=True, return_tensors="pt").to(device)
        emb = F.normalize(clip.get_text_features(**enc), dim=-1).mean(0)
        weights.append(F.normalize(emb, dim=0))
    del clip
    return torch.stack(weights)  # C x 512


class LVISDet(Dataset):
    def __init__(self, lvis_root, img_root, split, keep_cats=None, train=True):
        self.api = LVIS(os.path.join(lvis_root, f"lvis_v1_{split}.json"))
        self.img_ids = sorted(self.api.get_img_ids())
        self.img_root = img_root
        cats = sorted(self.api.get_cat_ids())
        self.cat_ids = [c for c in cats if keep_cats is None or c in keep_cats]
        self.cat2label = {c: i for i, c in enumerate(self.cat_ids)}
        self.train = train
        self.norm = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.img_ids)

    def __getitem__(self, i):
        img_id = self.img_ids[i]
        info = self.api.load_imgs([img_id])[0]
        path = os.path.join(self.img_root, info["coco_url"].split("/")[-2], info["coco_url"].split("/")[-1])
        img = Image.open(path).convert("RGB")
        w, h = img.size
        scale = 800 / max(w, h)
        img = img.resize((int(w * scale), int(h * scale)))
        anns = [a for a in self.api.load_anns(self.api.get_ann_ids(img_ids=[img_id]))
                if a["category_id"] in self.cat2label]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes = box_convert(boxes, "xywh", "cxcywh") / torch.tensor([w, h, w, h])
        labels = torch.tensor([self.cat2label[a["category_id"]] for a in anns], dtype=torch.long)
        if self.train and torch.rand(1).item() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
            boxes[:, 0] = 1 - boxes[:, 0]
        return self.norm(img), {"boxes": boxes, "labels": labels, "image_id": img_id, "orig_size": (w, h)}


def collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(tgts)


class OVDetector(nn.Module):
    def __init__(self, num_queries, embed_dim=512, d=256):
        super().__init__()
        self.backbone = convnext_tiny(weights=ConvNeXt_Tiny_Weights.IMAGENET1K_V1).features
        self.proj = nn.Conv2d(768, d, 1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 1024, batch_first=True), 4)
        self.queries = nn.Embedding(num_queries, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.to_clip = nn.Linear(d, embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(4.6))
        self.bias = nn.Parameter(torch.tensor(-4.0))

    def forward(self, images, text_classifier):
        f = self.proj(self.backbone(images)).flatten(2).transpose(1, 2)
        mem = self.encoder(f)
        hs = self.decoder(self.queries.weight.expand(images.shape[0], -1, -1), mem)
        emb = F.normalize(self.to_clip(hs), dim=-1)
        logits = emb @ text_classifier.t() * self.logit_scale.exp() + self.bias
        return logits, self.box(hs).sigmoid()


def set_criterion(logits, boxes, targets):
    device = logits.device
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
    dist.all_reduce(n)
    n = max(n.item() / dist.get_world_size(), 1.0)
    tgt_cls = torch.zeros_like(logits)
    l1, giou = logits.new_zeros(()), logits.new_zeros(())
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"].to(device), t["labels"].to(device)
        with torch.no_grad():
            C = -logits[b].sigmoid()[:, tl] * 2 + torch.cdist(boxes[b], tb, p=1) * 5 \
                - generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy")) * 2
            qi, ti = linear_sum_assignment(C.cpu())
        tgt_cls[b, qi, tl[ti]] = 1
        pb, gb = boxes[b, qi], tb[ti]
        l1 = l1 + F.l1_loss(pb, gb, reduction="sum")
        giou = giou + (1 - generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"),
                                               box_convert(gb, "cxcywh", "xyxy")).diag()).sum()
    cls = sigmoid_focal_loss(logits, tgt_cls, alpha=0.25, gamma=2.0, reduction="sum")
    return (cls + 5 * l1 + 2 * giou) / n


@torch.no_grad()
def evaluate(model, loader, classifier, cat_ids, device, ann_file, topk=300):
    model.eval()
    results = []
    for images, targets in loader:
        logits, boxes = model(images.to(device), classifier)
        prob = logits.sigmoid()
        for b, t in enumerate(targets):
            scores, idx = prob[b].flatten().topk(topk)
            q, c = idx // prob.shape[-1], idx % prob.shape[-1]
            w, h = t["orig_size"]
            bx = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            for s, cl, bb in zip(scores.tolist(), c.tolist(), bx.tolist()):
                results.append({"image_id": t["image_id"], "category_id": cat_ids[cl], "bbox": bb, "score": s})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    model.train()
    if dist.get_rank() != 0:
        return None
    seen, merged = set(), []
    for r in itertools.chain(*gathered):
        key = (r["image_id"], r["category_id"], tuple(r["bbox"]))
        if key not in seen:
            seen.add(key)
            merged.append(r)
    gt = LVIS(ann_file)
    ev = LVISEval(gt, LVISResults(gt, merged, max_dets=300), "bbox")
    ev.run()
    ev.print_results()
    return ev.get_results()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    val_ann = os.path.join(args.lvis_root, "lvis_v1_val.json")
    all_cats = LVIS(val_ann).load_cats(None)
    base_ids = {c["id"] for c in all_cats if c["frequency"] in ("c", "f")}  # rare classes held out as novel
    train_set = LVISDet(args.lvis_root, args.coco_images, "train", keep_cats=base_ids, train=True)
    val_set = LVISDet(args.lvis_root, args.coco_images, "val", train=False)
    id2name = {c["id"]: c["synonyms"][0] for c in all_cats}

    base_classifier = build_text_classifier([id2name[c] for c in train_set.cat_ids], args.clip_model)
    full_classifier = build_text_classifier([id2name[c] for c in val_set.cat_ids], args.clip_model)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 2, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=args.workers)

    model = OVDetector(args.queries).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.bs * world / 16
    optim = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n.startswith("backbone")], "lr": lr * 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("backbone")]},
    ], lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, args.epochs * len(train_loader))
    os.makedirs(args.output, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        for it, (images, targets) in enumerate(train_loader):
            logits, boxes = ddp(images.to(device, non_blocking=True), base_classifier)
            loss = set_criterion(logits, boxes, targets)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
            optim.step()
            sched.step()
            if it % 50 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss {avg.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": epoch},
                       os.path.join(args.output, "latest.pth"))
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(model, val_loader, full_classifier, val_set.cat_ids, device, val_ann)
            if rank == 0:
                print(f"epoch {epoch}: AP {res['AP']:.3f} APr {res['APr']:.3f} "
                      f"APc {res['APc']:.3f} APf {res['APf']:.3f}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
