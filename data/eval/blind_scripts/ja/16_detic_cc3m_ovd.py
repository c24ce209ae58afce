"""Detic-style open-vocabulary detector: LVIS base boxes + CC3M image-level labels.

Box batches train the usual set-prediction losses on LVIS base classes.  Image-label
batches (class names parsed from CC3M captions) only supervise the classifier of
the largest predicted box ("max-size" loss).  The classifier is the frozen CLIP
text embedding of each class name, so novel LVIS classes are detected at test time.

    torchrun --nproc_per_node=8 16_detic_cc3m_ovd.py --wandb-project detic-repro
"""
import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import wandb
from lvis import LVIS, LVISEval, LVISResults
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d
import open_clip

TF = T.Compose([T.Resize(640, max_size=1000), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--lvis", default="/data/lvis")
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--cc3m", default="/data/cc3m")
    p.add_argument("--out", default="output/detic_r50")
    p.add_argument("--iters", type=int, default=90000)
    p.add_argument("--det-bs", type=int, default=4)
    p.add_argument("--cls-bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-period", type=int, default=15000)
    p.add_argument("--wandb-project", default="detic")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


class LVISBase(Dataset):
    def __init__(self, ann, coco_root, cat_ids, train=True):
        self.api = LVIS(ann)
        self.ids = sorted(self.api.get_img_ids())
        self.label = {c: i for i, c in enumerate(cat_ids)}
        self.root, self.train = coco_root, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.api.load_imgs([self.ids[i]])[0]
        img = Image.open(os.path.join(self.root, *info["coco_url"].split("/")[-2:])).convert("RGB")
        w, h = img.size
        anns = [a for a in self.api.load_anns(self.api.get_ann_ids(img_ids=[info["id"]])) if a["category_id"] in self.label]
        b = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        return TF(img), {"boxes": box_convert(b, "xywh", "cxcywh") / torch.tensor([w, h, w, h]),
                         "labels": torch.tensor([self.label[a["category_id"]] for a in anns], dtype=torch.long),
                         "image_id": info["id"], "size": (w, h)}


class CC3MTags(Dataset):
    def __init__(self, root, cat_ids):
        with open(os.path.join(root, "cc3m_train_image_info_tags.json")) as f:
            d = json.load(f)
        label = {c: i for i, c in enumerate(cat_ids)}
        self.items = [(im["file_name"], [label[c] for c in im["pos_category_ids"] if c in label]) for im in d["images"]]
        self.items = [it for it in self.items if it[1]]
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, labels = self.items[i]
        return TF(Image.open(os.path.join(self.root, "images", f)).convert("RGB")), torch.tensor(labels)


def pad(imgs):
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x


def collate(batch):
    a, b = zip(*batch)
    return pad(a), list(b)


class Detector(nn.Module):
    def __init__(self, d=256, nq=300, clip_dim=512):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(2048, d, 1)
        self.transformer = nn.Transformer(d, 8, 6, 6, 1024, batch_first=True)
        self.query = nn.Embedding(nq, d)
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.cls_proj = nn.Linear(d, clip_dim)
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.bias = nn.Parameter(torch.tensor(-4.0))

    def forward(self, x, classifier):
        f = self.proj(self.backbone(x)).flatten(2).transpose(1, 2)
        hs = self.transformer(f, self.query.weight.expand(x.shape[0], -1, -1))
        logits = F.normalize(self.cls_proj(hs), dim=-1) @ classifier.T * self.scale.exp() + self.bias
        return logits, self.box(hs).sigmoid()


def box_loss(logits, boxes, tgts, device):
    n = torch.tensor(float(sum(len(t["labels"]) for t in tgts)), device=device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tcls, lb = torch.zeros_like(logits), logits.new_zeros(())
    for b, t in enumerate(tgts):
        if len(t["labels"]) == 0:
            continue
        tb, tl = t["boxes"].to(device), t["labels"].to(device)
        with torch.no_grad():
            C = -logits[b].sigmoid()[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) - 2 * generalized_box_iou(
                box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tcls[b, r, tl[c]] = 1
        lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tcls, reduction="sum") + lb) / n


def max_size_loss(logits, boxes, labels):
    # image labels supervise only the largest predicted box
    area = boxes[..., 2] * boxes[..., 3]
    idx = area.argmax(1)
    sel = logits[torch.arange(len(labels)), idx]
    tgt = torch.zeros_like(sel)
    for b, l in enumerate(labels):
        tgt[b, l.to(sel.device)] = 1
    return F.binary_cross_entropy_with_logits(sel, tgt, reduction="sum") / len(labels)


@torch.no_grad()
def clip_classifier(names, device):
    model, _, _ = open_clip.create_model_and_transforms("ViT-B-32", pretrained="openai", device=device)
    tok = open_clip.get_tokenizer("ViT-B-32")
    emb = model.encode_text(tok([f"a {n}" for n in names]).to(device))
    del model
    return F.normalize(emb.float(), dim=-1)


@torch.no_grad()
def evaluate(model, loader, classifier, cat_ids, ann, device):
    model.eval()
    res = []
    for x, tgts in loader:
        logits, boxes = model(x.to(device), classifier)
        p = logits.sigmoid()
        for b, t in enumerate(tgts):
            s, idx = p[b].flatten().topk(300)
            q, c = idx // p.shape[-1], idx % p.shape[-1]
            w, h = t["size"]
            xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            res += [{"image_id": t["image_id"], "category_id": cat_ids[ci], "bbox": bb, "score": sc}
                    for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, res)
    model.train()
    if dist.get_rank() != 0:
        return None
    uniq = list({(r["image_id"], r["category_id"], tuple(r["bbox"])): r for r in itertools.chain(*parts)}.values())
    gt = LVIS(ann)
    ev = LVISEval(gt, LVISResults(gt, uniq, max_dets=300), "bbox")
    ev.run()
    return ev.get_results()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    val_ann = os.path.join(args.lvis, "lvis_v1_val.json")
    cats = LVIS(val_ann).load_cats(None)
    all_ids = sorted(c["id"] for c in cats)
    base_ids = sorted(c["id"] for c in cats if c["frequency"] != "r")
    names = {c["id"]: c["synonyms"][0].replace("_", " ") for c in cats}
    base_cls = clip_classifier([names[c] for c in base_ids], device)
    all_cls = clip_classifier([names[c] for c in all_ids], device)

    det_set = LVISBase(os.path.join(args.lvis, "lvis_v1_train.json"), args.coco, base_ids)
    tag_set = CC3MTags(args.cc3m, base_ids)
    val_set = LVISBase(val_ann, args.coco, all_ids, train=False)
    det_sampler, tag_sampler = DistributedSampler(det_set), DistributedSampler(tag_set)
    det_loader = DataLoader(det_set, args.det_bs, sampler=det_sampler, collate_fn=collate, num_workers=6, drop_last=True)
    tag_loader = DataLoader(tag_set, args.cls_bs, sampler=tag_sampler, collate_fn=collate, num_workers=6, drop_last=True)
    val_loader = DataLoader(val_set, 4, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate, num_workers=4)

    model = Detector().to(device)
    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.det_bs * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, i / 1000) * 0.5 * (1 + math.cos(math.pi * i / args.iters)))

    def cycle(loader, sampler):
        ep = 0
        while True:
            sampler.set_epoch(ep)
            yield from loader
            ep += 1

    det_iter, tag_iter = cycle(det_loader, det_sampler), cycle(tag_loader, tag_sampler)
    t0 = time.time()
    for it in range(1, args.iters + 1):
        # 1:4 ratio of box batches to image-label batches, as in Detic
        use_tags = it % 5 != 0
        if use_tags:
            x, labels = next(tag_iter)
            logits, boxes = ddp(x.to(device, non_blocking=True), base_cls)
            loss = 0.1 * max_size_loss(logits, boxes, labels) + 0 * boxes.sum()
        else:
            x, tgts = next(det_iter)
            logits, boxes = ddp(x.to(device, non_blocking=True), base_cls)
            loss = box_loss(logits, boxes, tgts, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if it % 50 < 2:  # one box step and one image-label step
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            log = {"loss/" + ("tags" if use_tags else "box"): avg.item(), "lr": sched.get_last_lr()[0]}
            if it % 50 == 0:
                log["sec_per_iter"] = (time.time() - t0) / 50
                t0 = time.time()
            wandb.log(log, step=it)
        if it % args.eval_period == 0 or it == args.iters:
            r = evaluate(model, val_loader, all_cls, all_ids, val_ann, device)
            if rank == 0:
                wandb.log({"val/AP": r["AP"], "val/APr": r["APr"], "val/APc": r["APc"], "val/APf": r["APf"]}, step=it)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "iter": it},
                           os.path.join(args.out, f"model_{it:07d}.pth"))
            dist.barrier()
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
