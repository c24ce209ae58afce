"""IDOL-style online VIS: frame-level detector with box/mask heads plus contrastive
instance embeddings learned between a key and a reference frame.

Experiment tracking goes to Weights & Biases (project "vis-idol").
"""
import argparse
import json
import math
import os
import random

import numpy as np
import pycocotools.mask as mask_util
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from PIL import Image
from pycocotools.ytvos import YTVOS
from pycocotools.ytvoseval import YTVOSeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, generalized_box_iou, masks_to_boxes

TF = torchvision.transforms.functional


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--ann-train", default="/data/ytvis19/annotations/train_sub.json")
    p.add_argument("--ann-val", default="/data/ytvis19/annotations/valid_sub.json")
    p.add_argument("--img-root", default="/data/ytvis19/train/JPEGImages")
    p.add_argument("--output-dir", default="outputs/idol_r50_ytvis19")
    p.add_argument("--run-name", default="idol_r50")
    p.add_argument("--max-iter", type=int, default=12000)
    p.add_argument("--eval-period", type=int, default=3000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--num-queries", type=int, default=100)
    return p


def img_tensor(path, size=(384, 640)):
    x = TF.to_tensor(Image.open(path).convert("RGB").resize(size[::-1], Image.BILINEAR))
    return TF.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class KeyRefVIS(Dataset):
    def __init__(self, ann, root, size=(384, 640)):
        self.api, self.root, self.size = YTVOS(ann), root, size
        self.cats = sorted(self.api.getCatIds())
        self.samples = [(v, t) for v in sorted(self.api.getVidIds()) for t in range(self.api.loadVids(v)[0]["length"])]

    def __len__(self):
        return len(self.samples)

    def frame(self, vid, t):
        v = self.api.loadVids(vid)[0]
        x = img_tensor(os.path.join(self.root, v["file_names"][t]), self.size)
        ms, labels, ids = [], [], []
        for a in self.api.loadAnns(self.api.getAnnIds(vidIds=[vid])):
            seg = a["segmentations"][t]
            if seg is None:
                continue
            rle = mask_util.frPyObjects(seg, v["height"], v["width"]) if isinstance(seg["counts"], list) else seg
            m = torch.from_numpy(mask_util.decode(rle)).float()
            m = F.interpolate(m[None, None], size=self.size, mode="nearest")[0, 0]
            if m.sum() < 4:
                continue
            ms.append(m)
            labels.append(self.cats.index(a["category_id"]))
            ids.append(a["id"])
        masks = torch.stack(ms) if ms else torch.zeros(0, *self.size)
        H, W = self.size
        boxes = box_convert(masks_to_boxes(masks), "xyxy", "cxcywh") / torch.tensor([W, H, W, H]) if ms else torch.zeros(0, 4)
        return x, {"masks": masks, "boxes": boxes, "labels": torch.tensor(labels, dtype=torch.long), "ids": torch.tensor(ids, dtype=torch.long)}

    def __getitem__(self, i):
        vid, t = self.samples[i]
        n = self.api.loadVids(vid)[0]["length"]
        r = random.randint(max(0, t - 10), min(n - 1, t + 10))
        return self.frame(vid, t), self.frame(vid, r)


class IDOLLite(nn.Module):
    def __init__(self, num_classes, num_queries, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.body = torchvision.models._utils.IntermediateLayerGetter(r, {"layer2": "c3", "layer4": "c5"})
        self.proj5, self.proj3 = nn.Conv2d(2048, dim, 1), nn.Conv2d(512, dim, 1)
        self.pos = nn.Parameter(torch.randn(1, dim, 12, 20) * 0.02)
        self.queries = nn.Embedding(num_queries, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.cls = nn.Linear(dim, num_classes)
        self.box = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))
        self.mask = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.emb = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x):
        f = self.body(x)
        c5 = self.proj5(f["c5"])
        mem = (c5 + F.interpolate(self.pos, size=c5.shape[-2:], mode="bilinear", align_corners=False)).flatten(2).transpose(1, 2)
        hs = self.decoder(self.queries.weight[None].expand(x.shape[0], -1, -1), mem)
        masks = torch.einsum("bqc,bchw->bqhw", self.mask(hs), self.proj3(f["c3"]))
        return {"logits": self.cls(hs), "boxes": self.box(hs).sigmoid(), "masks": masks, "emb": self.emb(hs)}


def hungarian(out, b, tgt):
    if len(tgt["labels"]) == 0:
        return [], []
    prob = out["logits"][b].sigmoid()
    pb, gb = out["boxes"][b], tgt["boxes"]
    cost = -2 * prob[:, tgt["labels"]] + 5 * torch.cdist(pb, gb, p=1) - 2 * generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy"))
    r, c = linear_sum_assignment(cost.detach().cpu())
    return r.tolist(), c.tolist()


def idol_loss(out, key_t, ref_t, B):
    total = {"cls": 0.0, "box": out["boxes"].sum() * 0, "mask": out["masks"].sum() * 0, "emb": out["emb"].sum() * 0}
    for b in range(B):
        kt, rt = key_t[b], ref_t[b]
        r, c = hungarian(out, b, kt)
        onehot = torch.zeros_like(out["logits"][b])
        if r:
            onehot[r, kt["labels"][c]] = 1
            total["box"] = total["box"] + F.l1_loss(out["boxes"][b][r], kt["boxes"][c]) * 5
            gm = F.interpolate(kt["masks"][c][None], size=out["masks"].shape[-2:], mode="bilinear", align_corners=False)[0]
            total["mask"] = total["mask"] + F.binary_cross_entropy_with_logits(out["masks"][b][r], gm) * 2
        total["cls"] = total["cls"] + torchvision.ops.sigmoid_focal_loss(out["logits"][b], onehot, reduction="sum") / max(len(r), 1) * 2
        rr, rc = hungarian(out, B + b, rt)
        ref_of_id = {int(rt["ids"][j]): q for q, j in zip(rr, rc)}
        for q, j in zip(r, c):
            tid = int(kt["ids"][j])
            if tid not in ref_of_id:
                continue
            sim = out["emb"][b, q] @ out["emb"][B + b].T
            pos = ref_of_id[tid]
            neg = torch.cat([sim[:pos], sim[pos + 1 :]])
            total["emb"] = total["emb"] + torch.logsumexp(F.pad(neg - sim[pos], (0, 1)), 0) / max(len(r), 1)
    return {k: v / B for k, v in total.items()}


@torch.no_grad()
def infer(model, api, root, vids):
    results = []
    for vid in vids:
        v = api.loadVids(vid)[0]
        memory, tracks = None, {}
        for t, fn in enumerate(v["file_names"]):
            out = model(img_tensor(os.path.join(root, fn))[None].cuda())
            scores, labels = out["logits"][0].sigmoid().max(1)
            keep = (scores > 0.3).nonzero().flatten()
            emb = F.normalize(out["emb"][0, keep], dim=1)
            masks = F.interpolate(out["masks"][0, keep][None], size=(v["height"], v["width"]), mode="bilinear", align_corners=False)[0] > 0
            for k in range(len(keep)):
                tid = None
                if tracks:
                    tids = list(tracks)
                    sims = torch.stack([tracks[i]["emb"] for i in tids]) @ emb[k]
                    if sims.max() > 0.5:
                        tid = tids[int(sims.argmax())]
                if tid is None:
                    tid = len(tracks)
                    tracks[tid] = {"segs": [None] * v["length"], "scores": [], "labels": []}
                tracks[tid]["emb"] = emb[k]
                tracks[tid]["scores"].append(float(scores[keep[k]]))
                tracks[tid]["labels"].append(int(labels[keep[k]]))
                rle = mask_util.encode(np.asfortranarray(masks[k].cpu().numpy().astype(np.uint8)))
                rle["counts"] = rle["counts"].decode()
                tracks[tid]["segs"][t] = rle
        cats = sorted(api.getCatIds())
        for tr in tracks.values():
            results.append({"video_id": vid, "score": float(np.mean(tr["scores"])),
                            "category_id": cats[max(set(tr["labels"]), key=tr["labels"].count)], "segmentations": tr["segs"]})
    return results


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.output_dir, exist_ok=True)
    wandb.init(project="vis-idol", name=args.run_name, config=vars(args), dir=args.output_dir)

    train_set = KeyRefVIS(args.ann_train, args.img_root)
    val_api = YTVOS(args.ann_val)
    sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        collate_fn=lambda b: b, drop_last=True, pin_memory=True)

    torch.manual_seed(42)
    model = DDP(IDOLLite(len(train_set.cats), args.num_queries).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / args.max_iter)))

    it, epoch = 0, 0
    while it < args.max_iter:
        sampler.set_epoch(epoch)
        for batch in loader:
            B = len(batch)
            x = torch.stack([k[0] for k, _ in batch] + [r[0] for _, r in batch]).cuda(non_blocking=True)
            key_t = [{n: v.cuda() for n, v in k[1].items()} for k, _ in batch]
            ref_t = [{n: v.cuda() for n, v in r[1].items()} for _, r in batch]
            out = model(x)
            losses = idol_loss(out, key_t, ref_t, B)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 20 == 0:
                vals = torch.stack([torch.as_tensor(v, device="cuda", dtype=torch.float32).detach() for v in losses.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                wandb.log({f"train/{k}": v for k, v in zip(losses, vals.tolist())} | {"lr": scheduler.get_last_lr()[0]}, step=it)
            if it % args.eval_period == 0 or it == args.max_iter:
                model.eval()
                mine = infer(model.module, val_api, args.img_root, sorted(val_api.getVidIds())[rank::world])
                model.train()
                parts = [None] * world
                dist.all_gather_object(parts, mine)
                if rank == 0:
                    res = [r for p in parts for r in p]
                    with open(os.path.join(args.output_dir, f"results_{it}.json"), "w") as f:
                        json.dump(res, f)
                    ev = YTVOSeval(val_api, val_api.loadRes(res), "segm")
                    ev.evaluate()
                    ev.accumulate()
                    ev.summarize()
                    wandb.log({"val/AP": ev.stats[0], "val/AP50": ev.stats[1]}, step=it)
                    torch.save({"model": model.module.state_dict(), "iter": it}, os.path.join(args.output_dir, f"model_{it:06d}.pth"))
                dist.barrier()
            if it >= args.max_iter:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
