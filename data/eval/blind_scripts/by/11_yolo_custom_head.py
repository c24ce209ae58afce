"""Single-stage anchor-free detector (ResNet-50-FPN + decoupled YOLO-style head).

An auxiliary center-heatmap branch on P3 speeds up early convergence; it is only
supervised during the first few epochs and then switched off.

    torchrun --nproc_per_node=8 yolo_custom_head.py --data-root /data/coco --epochs 36
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.ops import batched_nms, sigmoid_focal_loss, generalized_box_iou_loss

STRIDES = (8, 16, 32)


class LetterboxCoco(Dataset):
    def __init__(self, root, split, size=640, train=False):
        self.coco = COCO(f"{root}/annotations/instances_{split}2017.json")
        self.img_dir = f"{root}/{split}2017"
        self.size, self.train = size, train
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat2idx = {c: i for i, c in enumerate(self.cat_ids)}
        self.ids = sorted(self.coco.imgs)
        if train:
            self.ids = [i for i in self.ids if self.coco.getAnnIds(imgIds=i, iscrowd=False)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        iid = self.ids[k]
        info = self.coco.imgs[iid]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        r = self.size / max(img.size)
        nw, nh = round(img.width * r), round(img.height * r)
        canvas = np.full((self.size, self.size, 3), 114, np.uint8)
        canvas[:nh, :nw] = np.asarray(img.resize((nw, nh), Image.BILINEAR))
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=iid, iscrowd=False))
        boxes = np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4) * r
        boxes[:, 2:] += boxes[:, :2]
        cls = np.array([self.cat2idx[a["category_id"]] for a in anns], np.int64)
        keep = (boxes[:, 2] - boxes[:, 0] > 2) & (boxes[:, 3] - boxes[:, 1] > 2)
        boxes, cls = boxes[keep], cls[keep]
        if self.train and random.random() < 0.5:
            canvas = canvas[:, ::-1].copy()
            boxes[:, [0, 2]] = self.size - boxes[:, [2, 0]]
        x = torch.from_numpy(canvas).permute(2, 0, 1).float().div(255)
        return x, {"boxes": torch.from_numpy(boxes), "labels": torch.from_numpy(cls), "image_id": iid, "ratio": r}


def collate(batch):
    xs, ts = zip(*batch)
    return torch.stack(xs), list(ts)


def conv_gn(cin, cout, k=3):
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.GroupNorm(32, cout), nn.SiLU())


class DecoupledHead(nn.Module):
    def __init__(self, nc, ch=256):
        super().__init__()
        self.cls_tower = nn.Sequential(conv_gn(ch, ch), conv_gn(ch, ch))
        self.reg_tower = nn.Sequential(conv_gn(ch, ch), conv_gn(ch, ch))
        self.cls_pred = nn.Conv2d(ch, nc, 1)
        self.reg_pred = nn.Conv2d(ch, 4, 1)
        nn.init.constant_(self.cls_pred.bias, -4.595)

    def forward(self, x):
        return self.cls_pred(self.cls_tower(x)), self.reg_pred(self.reg_tower(x))


class Detector(nn.Module):
    def __init__(self, nc=80):
        super().__init__()
        self.nc = nc
        self.backbone = resnet_fpn_backbone(backbone_name="resnet50", weights="IMAGENET1K_V1",
                                            trainable_layers=3, returned_layers=[2, 3, 4])
        self.heads = nn.ModuleList(DecoupledHead(nc) for _ in STRIDES)
        self.aux_heatmap = nn.Sequential(conv_gn(256, 128), nn.Conv2d(128, 1, 1))
        self.use_aux = True

    def forward(self, x):
        feats = list(self.backbone(x).values())[:3]  # P3, P4, P5
        outs = [h(f) for h, f in zip(self.heads, feats)]
        aux = self.aux_heatmap(feats[0]) if (self.training and self.use_aux) else None
        return outs, aux


def grid_points(h, w, stride, device):
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([xs, ys], -1).reshape(-1, 2).float().add(0.5).mul(stride)


def decode_level(reg, stride, pts):
    ltrb = F.relu(reg).mul(stride)
    return torch.cat([pts - ltrb[..., :2], pts + ltrb[..., 2:]], -1)


def compute_loss(outs, aux, targets, nc):
    cls_l, box_l, npos = 0.0, 0.0, 0
    ranges = ((0, 64), (64, 128), (128, 1e5))
    for (cls, reg), s, (lo, hi) in zip(outs, STRIDES, ranges):
        B, _, H, W = cls.shape
        pts = grid_points(H, W, s, cls.device)
        cls = cls.permute(0, 2, 3, 1).reshape(B, -1, nc)
        reg = reg.permute(0, 2, 3, 1).reshape(B, -1, 4)
        cls_t = torch.zeros_like(cls)
        for b, t in enumerate(targets):
            bx = t["boxes"]
            if len(bx) == 0:
                continue
            side = (bx[:, 2:] - bx[:, :2]).max(1).values
            m = (side >= lo) & (side < hi)
            if not m.any():
                continue
            bx, lb = bx[m], t["labels"][m]
            ctr = (bx[:, :2] + bx[:, 2:]) / 2
            idx = (ctr[:, 1] / s).long().clamp(0, H - 1) * W + (ctr[:, 0] / s).long().clamp(0, W - 1)
            cls_t[b, idx, lb] = 1.0
            pred = decode_level(reg[b, idx], s, pts[idx])
            box_l = box_l + generalized_box_iou_loss(pred, bx, reduction="sum")
            npos += len(bx)
        cls_l = cls_l + sigmoid_focal_loss(cls, cls_t, reduction="sum")
    npos_t = torch.tensor(float(npos), device=outs[0][0].device)
    dist.all_reduce(npos_t)
    norm = max(npos_t.item() / dist.get_world_size(), 1.0)
    loss = (cls_l + 2.0 * box_l) / norm
    if aux is not None:
        B, _, H, W = aux.shape
        heat = torch.zeros_like(aux)
        for b, t in enumerate(targets):
            if len(t["boxes"]):
                c = ((t["boxes"][:, :2] + t["boxes"][:, 2:]) / 2 / STRIDES[0]).long()
                heat[b, 0, c[:, 1].clamp(0, H - 1), c[:, 0].clamp(0, W - 1)] = 1.0
        loss = loss + 0.5 * sigmoid_focal_loss(aux, heat, reduction="sum") / norm
    return loss


@torch.no_grad()
def evaluate(model, loader, ds, device):
    model.eval()
    dets = {}
    for x, targets in loader:
        outs, _ = model(x.to(device))
        B = x.shape[0]
        all_boxes, all_scores = [], []
        for (cls, reg), s in zip(outs, STRIDES):
            _, _, H, W = cls.shape
            pts = grid_points(H, W, s, device)
            all_scores.append(cls.permute(0, 2, 3, 1).reshape(B, -1, model.nc).sigmoid())
            all_boxes.append(decode_level(reg.permute(0, 2, 3, 1).reshape(B, -1, 4), s, pts))
        scores, boxes = torch.cat(all_scores, 1), torch.cat(all_boxes, 1)
        for b, t in enumerate(targets):
            sc, lb = scores[b].max(1)
            keep = sc > 0.05
            bx, sc, lb = boxes[b][keep], sc[keep], lb[keep]
            k = batched_nms(bx, sc, lb, 0.6)[:100]
            bx = (bx[k] / t["ratio"]).cpu()
            bx[:, 2:] -= bx[:, :2]
            dets[t["image_id"]] = [{"image_id": t["image_id"], "category_id": ds.cat_ids[int(c)], "bbox": bb,
                                    "score": float(v)} for bb, v, c in zip(bx.tolist(), sc[k].tolist(), lb[k].tolist())]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, dets)
    if dist.get_rank() != 0:
        return None
    merged = {k: v for sh in shards for k, v in sh.items()}
    flat = [d for v in merged.values() for d in v]
    if not flat:
        return 0.0
    E = COCOeval(ds.coco, ds.coco.loadRes(flat), "bbox")
    E.params.imgIds = sorted(merged)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/coco")
    ap.add_argument("--epochs", type=int, default=36)
    ap.add_argument("--aux-epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--milestones", type=int, nargs="+", default=[27, 33])
    ap.add_argument("--save", default="runs/anchorfree_r50")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = LetterboxCoco(args.data_root, "train", train=True)
    val_ds = LetterboxCoco(args.data_root, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, 16, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=8,
                        collate_fn=collate)

    net = Detector(nc=len(train_ds.cat_ids)).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=args.lr, momentum=0.9,
                          weight_decay=5e-4, nesterov=True)
    ipe = len(train_dl)

    def lr_at(it):
        w = min(1.0, (it + 1) / args.warmup)
        return w * 0.1 ** sum(it >= m * ipe for m in args.milestones)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.use_aux = epoch < args.aux_epochs
        model.train()
        t0 = time.time()
        for i, (x, targets) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.float16):
                outs, aux = model(x)
            outs = [(c.float(), r.float()) for c, r in outs]
            loss = compute_loss(outs, aux.float() if aux is not None else None, targets, net.nc)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if i % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} {i}/{ipe} loss {l.item():.4f} aux={net.use_aux} "
                          f"lr {sched.get_last_lr()[0]:.5f} {time.time() - t0:.0f}s", flush=True)

        ap50_95 = evaluate(net, val_dl, val_ds, device)
        if rank == 0:
            print(f"epoch {epoch} bbox mAP {ap50_95:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.save, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
