"""Minimal DETR-R50 with auxiliary decoding losses and an EMA of the weights.

    torchrun --nnodes=1 --nproc_per_node=8 detr_coco_ema.py --coco /datasets/coco --bs 4
"""
import argparse
import math
import os
import random
import time
from copy import deepcopy

import torch
import torch.distributed as dist
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

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class CocoSet(torchvision.datasets.CocoDetection):
    def __init__(self, root, ann, train):
        super().__init__(root, ann)
        self.train = train

    def __getitem__(self, i):
        img, anns = super().__getitem__(i)
        w, h = img.size
        anns = [a for a in anns if not a.get("iscrowd", 0)]
        xyxy = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        xyxy[:, 2:] += xyxy[:, :2]
        cls = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        ok = (xyxy[:, 2] > xyxy[:, 0] + 1) & (xyxy[:, 3] > xyxy[:, 1] + 1)
        xyxy, cls = xyxy[ok], cls[ok]
        if self.train and random.random() < 0.5:
            img = TF.hflip(img)
            xyxy = torch.stack([w - xyxy[:, 2], xyxy[:, 1], w - xyxy[:, 0], xyxy[:, 3]], 1)
        short = random.choice(range(480, 801, 32)) if self.train else 800
        s = min(short / min(w, h), 1333 / max(w, h))
        nw, nh = round(w * s), round(h * s)
        img = TF.normalize(TF.to_tensor(TF.resize(img, [nh, nw], antialias=True)), MEAN, STD)
        boxes = box_convert(xyxy * s, "xyxy", "cxcywh") / torch.tensor([nw, nh, nw, nh])
        return img, {"labels": cls, "boxes": boxes, "image_id": self.ids[i], "orig_size": (h, w)}


def pad_collate(batch):
    imgs, tgts = zip(*batch)
    H, W = max(im.shape[1] for im in imgs), max(im.shape[2] for im in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    m = torch.ones(len(imgs), H, W, dtype=torch.bool)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
        m[k, : im.shape[1], : im.shape[2]] = False
    return x, m, list(tgts)


def sine_pos(mask, d=128, temp=10000.0):
    nm = (~mask).float()
    y = nm.cumsum(1) / (nm.cumsum(1)[:, -1:, :] + 1e-6) * 2 * math.pi
    x = nm.cumsum(2) / (nm.cumsum(2)[:, :, -1:] + 1e-6) * 2 * math.pi
    dim_t = temp ** (2 * (torch.arange(d, device=mask.device) // 2) / d)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), 4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), 4).flatten(3)
    return torch.cat((py, px), 3)


class DETR(nn.Module):
    def __init__(self, num_classes=91, nq=100, d=256, enc=6, dec=6):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.body = torchvision.models._utils.IntermediateLayerGetter(r50, {"layer4": "0"})
        for n, p in self.body.named_parameters():
            if not n.startswith(("layer2", "layer3", "layer4")):
                p.requires_grad_(False)
        self.proj = nn.Conv2d(2048, d, 1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), enc)
        self.dec_layers = nn.ModuleList(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True)
                                        for _ in range(dec))
        self.dec_norm = nn.LayerNorm(d)
        self.query_pos = nn.Embedding(nq, d)
        self.cls_head = nn.Linear(d, num_classes + 1)
        self.box_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, mask):
        f = self.body(x)["0"]
        mask = F.interpolate(mask[None].float(), size=f.shape[-2:])[0].bool()
        pos = sine_pos(mask).flatten(1, 2)
        src = self.proj(f).flatten(2).transpose(1, 2)
        kpm = mask.flatten(1)
        mem = self.encoder(src + pos, src_key_padding_mask=kpm)
        qpos = self.query_pos.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        tgt = torch.zeros_like(qpos)
        outs = []
        for layer in self.dec_layers:
            tgt = layer(tgt + qpos, mem + pos, memory_key_padding_mask=kpm)
            outs.append(self.dec_norm(tgt))
        hs = torch.stack(outs)  # [L, B, Q, d]
        logits, boxes = self.cls_head(hs), self.box_head(hs).sigmoid()
        return [{"logits": l, "boxes": b} for l, b in zip(logits, boxes)]  # last entry is the final layer


@torch.no_grad()
def match(out, tgts):
    B, Q = out["logits"].shape[:2]
    prob = out["logits"].flatten(0, 1).softmax(-1)
    ob = out["boxes"].flatten(0, 1)
    tl = torch.cat([t["labels"] for t in tgts])
    tb = torch.cat([t["boxes"] for t in tgts])
    if len(tl) == 0:
        e = torch.empty(0, dtype=torch.long)
        return [(e, e) for _ in tgts]
    C = 5 * torch.cdist(ob, tb, p=1) - prob[:, tl] - 2 * generalized_box_iou(
        box_convert(ob, "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
    C = C.view(B, Q, -1).cpu()
    sizes = [len(t["boxes"]) for t in tgts]
    return [tuple(torch.as_tensor(a, dtype=torch.long) for a in linear_sum_assignment(c[k]))
            for k, c in enumerate(C.split(sizes, -1))]


def set_loss(out, tgts, num_boxes, eos=0.1):
    idx = match(out, tgts)
    bi = torch.cat([torch.full_like(s, k) for k, (s, _) in enumerate(idx)])
    si = torch.cat([s for s, _ in idx])
    logits = out["logits"]
    nc = logits.shape[-1] - 1
    tc = torch.full(logits.shape[:2], nc, dtype=torch.long, device=logits.device)
    tc[bi, si] = torch.cat([t["labels"][j] for t, (_, j) in zip(tgts, idx)])
    w = torch.ones(nc + 1, device=logits.device)
    w[-1] = eos
    l_ce = F.cross_entropy(logits.transpose(1, 2), tc, w)
    sb = out["boxes"][bi, si]
    tb = torch.cat([t["boxes"][j] for t, (_, j) in zip(tgts, idx)])
    l_l1 = F.l1_loss(sb, tb, reduction="sum") / num_boxes
    l_giou = (1 - torch.diag(generalized_box_iou(box_convert(sb, "cxcywh", "xyxy"),
                                                 box_convert(tb, "cxcywh", "xyxy")))).sum() / num_boxes
    return l_ce + 5 * l_l1 + 2 * l_giou


class EMA:
    def __init__(self, model, decay=0.9997):
        self.model = deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.model.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.lerp_(p, 1 - self.decay)


@torch.no_grad()
def coco_eval(model, loader, coco, device):
    model.eval()
    preds = {}
    for x, m, tgts in loader:
        out = model(x.to(device), m.to(device))[-1]
        scores, labels = out["logits"].softmax(-1)[..., :-1].max(-1)
        for k, t in enumerate(tgts):
            h, w = t["orig_size"]
            b = box_convert(out["boxes"][k], "cxcywh", "xywh") * torch.tensor([w, h, w, h], device=device)
            preds[t["image_id"]] = [{"image_id": t["image_id"], "category_id": int(c), "bbox": bb, "score": float(s)}
                                    for bb, s, c in zip(b.tolist(), scores[k].tolist(), labels[k].tolist())]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, preds)
    if dist.get_rank() != 0:
        return None
    allp = {}
    for s in shards:
        allp.update(s)  # DistributedSampler pads with repeats; keyed by image id so they collapse
    E = COCOeval(coco, coco.loadRes([d for v in allp.values() for d in v]), "bbox")
    E.params.imgIds = sorted(allp)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco", default="/datasets/coco")
    ap.add_argument("--out", default="out/detr_ema")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr-drop", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-backbone", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)
    # different augmentation streams per rank; model init is synced by DDP anyway
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tr = CocoSet(f"{args.coco}/train2017", f"{args.coco}/annotations/instances_train2017.json", True)
    va = CocoSet(f"{args.coco}/val2017", f"{args.coco}/annotations/instances_val2017.json", False)
    tr_s = DistributedSampler(tr, shuffle=True, seed=args.seed)
    tr_l = DataLoader(tr, args.bs, sampler=tr_s, collate_fn=pad_collate, num_workers=4, drop_last=True,
                      pin_memory=True)
    va_l = DataLoader(va, 2, sampler=DistributedSampler(va, shuffle=False), collate_fn=pad_collate, num_workers=4)

    net = DETR().to(dev)
    model = DDP(net, device_ids=[lr_])  # broadcasts rank 0's initial weights
    ema = EMA(net)
    groups = [{"params": [p for n, p in net.named_parameters() if not n.startswith("body.") and p.requires_grad]},
              {"params": [p for n, p in net.named_parameters() if n.startswith("body.") and p.requires_grad],
               "lr": args.lr_backbone}]
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, args.lr_drop)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        ema.model.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        tr_s.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, m, tgts) in enumerate(tr_l):
            x, m = x.to(dev, non_blocking=True), m.to(dev, non_blocking=True)
            tgts = [{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in t.items()} for t in tgts]
            num_boxes = torch.tensor([float(sum(len(t["labels"]) for t in tgts))], device=dev)
            dist.all_reduce(num_boxes)
            num_boxes = (num_boxes / ws).clamp(min=1).item()

            outs = model(x, m)
            loss = sum(set_loss(o, tgts, num_boxes) for o in outs)  # aux losses on every decoder layer
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            opt.step()
            ema.update(net)
            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{len(tr_l)} loss {l.item():.3f} {time.time() - t0:.0f}s", flush=True)
        sched.step()

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "checkpoint.pth"))
        if (epoch + 1) % 5 == 0:
            ap_ema = coco_eval(ema.model, va_l, va.coco, dev)
            if rank == 0:
                print(f"epoch {epoch}: EMA AP {ap_ema:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
