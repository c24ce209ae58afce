"""Dense (FCOS/ATSS-like) GLIP head trained on Objects365 prompts, with gradient
accumulation.  Each feature location predicts token-alignment logits, an ltrb box
and a centerness score; the head's conv towers use BatchNorm, synchronised across
GPUs because only 2 images fit per GPU.

    torchrun --nproc_per_node=8 20_glip_accum_empty.py --accum 4
"""
import argparse
import itertools
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
import torchvision.transforms.functional as TF
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.models.feature_extraction import create_feature_extractor
from torchvision.ops import FeaturePyramidNetwork, generalized_box_iou_loss, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import AutoModel, AutoTokenizer

STRIDES = (8, 16, 32)
MAX_LEN = 256


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/objects365")
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--out", default="runs/glip_dense_r50")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--base-lr", type=float, default=1e-3, help="SGD lr for 64 images per optimizer step")
    p.add_argument("--resume", default="")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class O365Prompts(Dataset):
    def __init__(self, root, tok, n_cats=50):
        with open(os.path.join(root, "annotations/zhiyuan_objv2_train.json")) as f:
            d = json.load(f)
        self.names = {c["id"]: c["name"].lower() for c in d["categories"]}
        self.anns = defaultdict(list)
        for a in d["annotations"]:
            self.anns[a["image_id"]].append(a)
        self.images = d["images"]  # keep images without boxes: they are pure negatives
        self.root, self.tok, self.n = root, tok, n_cats

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        info = self.images[i]
        img = Image.open(os.path.join(self.root, "images/train", info["file_name"])).convert("RGB")
        w, h = img.size
        anns = self.anns.get(info["id"], [])
        pos = list({a["category_id"] for a in anns})[: self.n]
        cats = pos + random.sample([c for c in self.names if c not in pos], self.n - len(pos))
        random.shuffle(cats)
        text, span = "", {}
        for c in cats:
            span[c] = (len(text), len(text) + len(self.names[c]))
            text += self.names[c] + ". "
        enc = self.tok(text, truncation=True, max_length=MAX_LEN)
        anns = [a for a in anns if a["category_id"] in span]
        s = min(800 / min(w, h), 1333 / max(w, h))
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4) * s
        boxes[:, 2:] += boxes[:, :2]  # xyxy in resized pixels
        pm = torch.zeros(len(anns), MAX_LEN)
        for k, a in enumerate(anns):
            cs, ce = span[a["category_id"]]
            ts, te = enc.char_to_token(cs), enc.char_to_token(ce - 1)
            if ts is not None and te is not None:
                pm[k, ts: te + 1] = 1
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, text, {"boxes": boxes, "positive_map": pm}


class CocoVal(Dataset):
    def __init__(self, root):
        self.coco = COCO(os.path.join(root, "annotations/instances_val2017.json"))
        self.ids = sorted(self.coco.getImgIds())
        self.cat_ids = sorted(self.coco.getCatIds())
        names = [self.coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        self.prompt, self.spans = "", []
        for n in names:
            self.spans.append((len(self.prompt), len(self.prompt) + len(n)))
            self.prompt += n + ". "
        self.root = root

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.root, "val2017", info["file_name"])).convert("RGB")
        w, h = img.size
        s = min(800 / min(w, h), 1333 / max(w, h))
        img = TF.normalize(TF.to_tensor(TF.resize(img, [int(h * s), int(w * s)])),
                           [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, self.prompt, {"image_id": info["id"], "scale": s}


def collate(batch):
    imgs, texts, tgts = zip(*batch)
    H = math.ceil(max(i.shape[1] for i in imgs) / 32) * 32
    W = math.ceil(max(i.shape[2] for i in imgs) / 32) * 32
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(texts), list(tgts)


def tower(d, n=4):
    layers = []
    for _ in range(n):
        layers += [nn.Conv2d(d, d, 3, padding=1, bias=False), nn.BatchNorm2d(d), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class DenseGLIP(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.body = create_feature_extractor(r, {"layer2": "c3", "layer3": "c4", "layer4": "c5"})
        self.fpn = FeaturePyramidNetwork([512, 1024, 2048], d)
        self.lang = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.lang_proj = nn.Linear(768, d)
        self.cls_tower, self.box_tower = tower(d), tower(d)
        self.token_proj = nn.Conv2d(d, d, 1)
        self.box_pred = nn.Conv2d(d, 4, 3, padding=1)
        self.ctr_pred = nn.Conv2d(d, 1, 3, padding=1)
        self.scales = nn.Parameter(torch.ones(len(STRIDES)))
        self.bias = nn.Parameter(torch.tensor(-math.log((1 - 0.01) / 0.01)))

    def forward(self, x, ids, am):
        feats = list(self.fpn(self.body(x)).values())
        t = F.normalize(self.lang_proj(self.lang(input_ids=ids, attention_mask=am).last_hidden_state), dim=-1)
        logits, ltrb, ctr = [], [], []
        for lvl, f in enumerate(feats):
            c, b = self.cls_tower(f), self.box_tower(f)
            emb = F.normalize(self.token_proj(c).flatten(2).transpose(1, 2), dim=-1)  # B x HW x d
            logits.append((emb @ t.transpose(1, 2)) * 10.0 + self.bias)
            ltrb.append(F.relu(self.box_pred(b) * self.scales[lvl]).flatten(2).transpose(1, 2) * STRIDES[lvl])
            ctr.append(self.ctr_pred(b).flatten(2).transpose(1, 2)[..., 0])
        logits = torch.cat(logits, 1).masked_fill(~am.bool()[:, None], -1e4)
        return logits, torch.cat(ltrb, 1), torch.cat(ctr, 1), [f.shape[-2:] for f in feats]


def locations(shapes, device):
    pts = []
    for (h, w), s in zip(shapes, STRIDES):
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        pts.append(torch.stack([xs.flatten(), ys.flatten()], -1).float() * s + s // 2)
    return torch.cat(pts)


def dense_loss(logits, ltrb, ctr, shapes, targets):
    pts = locations(shapes, logits.device)
    tgt_tok = torch.zeros_like(logits)
    pos_pred, pos_tgt, pos_ctr, pos_ctr_tgt = [], [], [], []
    for b, t in enumerate(targets):
        boxes = t["boxes"]
        if len(boxes) == 0:
            continue  # every location of this image stays a negative for the focal loss
        l = pts[:, None, 0] - boxes[None, :, 0]
        tt = pts[:, None, 1] - boxes[None, :, 1]
        r = boxes[None, :, 2] - pts[:, None, 0]
        bt = boxes[None, :, 3] - pts[:, None, 1]
        reg = torch.stack([l, tt, r, bt], -1)  # P x G x 4
        inside = reg.min(-1).values > 0
        area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].expand_as(inside).clone()
        area[~inside] = float("inf")
        best_area, gi = area.min(1)
        pos = torch.isfinite(best_area)
        tgt_tok[b, pos] = t["positive_map"][gi[pos]]
        r_pos = reg[pos, gi[pos]]
        pos_tgt.append(torch.cat([pts[pos] - r_pos[:, :2], pts[pos] + r_pos[:, 2:]], -1))
        p = ltrb[b, pos]
        pos_pred.append(torch.cat([pts[pos] - p[:, :2], pts[pos] + p[:, 2:]], -1))
        lr_, tb_ = r_pos[:, [0, 2]], r_pos[:, [1, 3]]
        pos_ctr_tgt.append(torch.sqrt((lr_.min(-1).values / lr_.max(-1).values) * (tb_.min(-1).values / tb_.max(-1).values)))
        pos_ctr.append(ctr[b, pos])
    num_pos = torch.tensor(float(sum(len(p) for p in pos_pred)), device=logits.device)
    dist.all_reduce(num_pos)
    num_pos = (num_pos / dist.get_world_size()).clamp(min=1.0)
    loss_cls = sigmoid_focal_loss(logits, tgt_tok, reduction="sum") / num_pos
    if pos_pred:
        pp, pt = torch.cat(pos_pred), torch.cat(pos_tgt)
        loss_box = generalized_box_iou_loss(pp, pt, reduction="sum") / num_pos
        loss_ctr = F.binary_cross_entropy_with_logits(torch.cat(pos_ctr), torch.cat(pos_ctr_tgt), reduction="sum") / num_pos
    else:
        # keep the box / centerness branches in the graph so every rank reduces the same gradients
        loss_box = ltrb.sum() * 0.0
        loss_ctr = ctr.sum() * 0.0
    return loss_cls + 2 * loss_box + loss_ctr


@torch.no_grad()
def evaluate(model, loader, val_set, tok, device, topk=100):
    model.eval()
    enc = tok(val_set.prompt, truncation=True, max_length=MAX_LEN, padding="max_length", return_tensors="pt")
    cmap = torch.zeros(len(val_set.spans), MAX_LEN)
    for i, (cs, ce) in enumerate(val_set.spans):
        cmap[i, enc.char_to_token(cs): enc.char_to_token(ce - 1) + 1] = 1
    cmap = (cmap / cmap.sum(-1, keepdim=True)).to(device)
    ids, am = enc.input_ids.to(device), enc.attention_mask.to(device)
    dets = []
    for x, _, metas in loader:
        B = x.shape[0]
        logits, ltrb, ctr, shapes = model(x.to(device), ids.expand(B, -1), am.expand(B, -1))
        pts = locations(shapes, device)
        cls = (logits.sigmoid() @ cmap.T) * ctr.sigmoid()[..., None]  # B x P x C
        for b, m in enumerate(metas):
            sc, idx = cls[b].flatten().topk(topk)
            p, c = idx // cls.shape[-1], idx % cls.shape[-1]
            xyxy = torch.cat([pts[p] - ltrb[b, p, :2], pts[p] + ltrb[b, p, 2:]], -1) / m["scale"]
            xywh = torch.cat([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], -1)
            dets += [{"image_id": m["image_id"], "category_id": val_set.cat_ids[ci], "bbox": bb, "score": v}
                     for v, ci, bb in zip(sc.sqrt().tolist(), c.tolist(), xywh.tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    uniq = {(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}
    ev = COCOeval(val_set.coco, val_set.coco.loadRes(list(uniq.values())), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained("bert-base-uncased")
    ds = O365Prompts(args.data, tok)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    val_set = CocoVal(args.coco)
    val_loader = DataLoader(val_set, 2, sampler=DistributedSampler(val_set, shuffle=False), collate_fn=collate,
                            num_workers=args.workers)

    model = DenseGLIP()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * args.accum * world / 64
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 500) * (
        0.1 ** sum(s >= m for m in (int(total * 0.67), int(total * 0.89)))))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, texts, tgts) in enumerate(loader):
            if it >= steps_per_epoch * args.accum:
                break  # same number of micro-batches on every rank
            enc = tok(texts, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt").to(device)
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            last_micro = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, ltrb, ctr, shapes = model(x.to(device, non_blocking=True), enc.input_ids, enc.attention_mask)
                loss = dense_loss(logits.float(), ltrb.float(), ctr.float(), shapes, tgts) / args.accum
                scaler.scale(loss).backward()
            if last_micro:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step = (it + 1) // args.accum
                if step % 50 == 0:
                    l = loss.detach() * args.accum
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} step {step}/{steps_per_epoch} loss {l.item():.4f} "
                              f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / step:.2f}s/step", flush=True)
        # SyncBatchNorm in eval mode uses running stats, so the unwrapped module can run on uneven work
        ap = evaluate(model.module, val_loader, val_set, tok, device)
        if rank == 0:
            print(f"epoch {epoch} COCO zero-shot AP {ap:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
