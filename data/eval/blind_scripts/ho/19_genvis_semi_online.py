"""Semi-online VIS (GenVIS-like): a video is processed as consecutive short clips, and
the instance queries at the end of one clip initialise the queries of the next clip, so
identities propagate without any heuristic matching.

Training mirrors inference: each GPU walks through its videos clip after clip in order
and carries the (detached) queries from one clip to the next.
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import pycocotools.mask as mask_util
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", default="/data/ytvis_2021/train/instances.json")
    p.add_argument("--img-root", default="/data/ytvis_2021/train/JPEGImages")
    p.add_argument("--out", default="runs/genvis_r50")
    p.add_argument("--clip-len", type=int, default=3)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class SequentialClips(Dataset):
    """Item i is clip k of video v; clips of one video are contiguous in the index."""

    def __init__(self, ann, img_root, clip_len):
        with open(ann) as f:
            d = json.load(f)
        self.img_root, self.clip_len = img_root, clip_len
        self.videos = {v["id"]: v for v in d["videos"]}
        self.cats = sorted(c["id"] for c in d["categories"])
        self.anns = {}
        for a in d["annotations"]:
            self.anns.setdefault(a["video_id"], []).append(a)
        self.index = []
        for vid in sorted(self.videos):
            n = self.videos[vid]["length"]
            self.index += [(vid, s) for s in range(0, n - clip_len + 1, clip_len)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        vid, s = self.index[i]
        v = self.videos[vid]
        frames, masks, labels, ids = [], [], [], []
        for t in range(s, s + self.clip_len):
            im = Image.open(os.path.join(self.img_root, v["file_names"][t])).convert("RGB").resize((640, 360))
            frames.append(torchvision.transforms.functional.to_tensor(im))
        for a in self.anns.get(vid, []):
            tube = []
            for t in range(s, s + self.clip_len):
                seg = a["segmentations"][t]
                m = np.zeros((v["height"], v["width"]), np.uint8) if seg is None else mask_util.decode(
                    mask_util.frPyObjects(seg, v["height"], v["width"]) if isinstance(seg["counts"], list) else seg)
                tube.append(torch.from_numpy(m).float())
            tube = F.interpolate(torch.stack(tube)[None], size=(360, 640), mode="nearest")[0]
            masks.append(tube)
            labels.append(self.cats.index(a["category_id"]))
            ids.append(a["id"])
        x = torchvision.transforms.functional.normalize(torch.stack(frames), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, {"masks": torch.stack(masks) if masks else torch.zeros(0, self.clip_len, 360, 640),
                   "labels": torch.tensor(labels, dtype=torch.long), "ids": torch.tensor(ids, dtype=torch.long)}, vid


class VideoShardSampler(Sampler):
    """Each rank gets whole videos; video order is shuffled per epoch, clips stay in temporal order."""

    def __init__(self, dataset, rank, world, seed=0):
        self.seed, self.epoch = seed, 0
        by_video = {}
        for i, (vid, _) in enumerate(dataset.index):
            by_video.setdefault(vid, []).append(i)
        vids = sorted(by_video)
        self.mine = {v: by_video[v] for v in vids[rank::world]}

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        order = sorted(self.mine)
        rng.shuffle(order)
        for v in order:
            yield from self.mine[v]

    def __len__(self):
        return sum(len(c) for c in self.mine.values())


class GenVISLite(nn.Module):
    def __init__(self, num_classes, num_queries, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.body = torchvision.models._utils.IntermediateLayerGetter(r, {"layer2": "c3", "layer4": "c5"})
        self.proj5, self.proj3 = nn.Conv2d(2048, dim, 1), nn.Conv2d(512, dim, 1)
        self.init_queries = nn.Embedding(num_queries, dim)
        self.query_prop = nn.Linear(dim, dim)
        self.frame_pos = nn.Embedding(8, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.0, batch_first=True), 6)
        self.cls = nn.Linear(dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, clip, prev_q=None):
        f = self.body(clip)
        T = clip.shape[0]
        mem = self.proj5(f["c5"]).flatten(2).transpose(1, 2) + self.frame_pos.weight[:T, None]
        if prev_q is None:  # first clip of a video
            prev_q = torch.zeros_like(self.init_queries.weight)
        q = self.init_queries.weight + self.query_prop(prev_q)
        hs = self.decoder(q[None], mem.reshape(1, -1, mem.shape[-1]))[0]
        masks = torch.einsum("qc,tchw->qthw", self.mask_embed(hs), self.proj3(f["c3"]))
        return self.cls(hs), masks, hs


def clip_loss(logits, masks, tgt, prev_assign, num_classes):
    """Queries that held an identity in the previous clip keep it; the rest is Hungarian-matched."""
    gt_ids = tgt["ids"].tolist()
    fixed = {q: gt_ids.index(i) for q, i in prev_assign.items() if i in gt_ids}
    gt = F.interpolate(tgt["masks"], size=masks.shape[-2:], mode="nearest").flatten(1) if gt_ids else None
    pairs = dict(fixed)
    free_q = [q for q in range(len(logits)) if q not in fixed]
    free_g = [g for g in range(len(gt_ids)) if g not in fixed.values() and gt[g].sum() > 0]
    if free_g:
        pm = masks.flatten(1)[free_q].sigmoid()
        dice = 1 - (2 * pm @ gt[free_g].T + 1) / (pm.sum(1)[:, None] + gt[free_g].sum(1)[None] + 1)
        r, c = linear_sum_assignment((5 * dice - 2 * logits[free_q].softmax(-1)[:, tgt["labels"][free_g]]).detach().cpu())
        pairs.update({free_q[i]: free_g[j] for i, j in zip(r, c)})
    cls_t = torch.full((len(logits),), num_classes, device=logits.device)
    loss = masks.sum() * 0
    if pairs:
        q = torch.tensor(list(pairs), device=logits.device)
        g = torch.tensor(list(pairs.values()), device=logits.device)
        cls_t[q] = tgt["labels"][g]
        loss = loss + 5 * F.binary_cross_entropy_with_logits(masks.flatten(1)[q], gt[g])
    w = torch.ones(num_classes + 1, device=logits.device)
    w[-1] = 0.1
    loss = loss + 2 * F.cross_entropy(logits, cls_t, w)
    return loss, {q: gt_ids[g] for q, g in pairs.items()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    dataset = SequentialClips(args.ann, args.img_root, args.clip_len)
    sampler = VideoShardSampler(dataset, rank, world, seed=args.seed)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=4, collate_fn=lambda b: b[0], pin_memory=True)
    num_classes = len(dataset.cats)

    model = DDP(GenVISLite(num_classes, args.num_queries).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        cur_vid, prev_q, prev_assign = None, None, {}
        tic, running = time.time(), []
        for step, (clip, tgt, vid) in enumerate(loader):
            if vid != cur_vid:
                cur_vid, prev_q, prev_assign = vid, None, {}
            clip = clip.cuda(non_blocking=True)
            tgt = {k: v.cuda(non_blocking=True) for k, v in tgt.items()}
            logits, masks, hs = model(clip, prev_q)
            loss, assign = clip_loss(logits, masks, tgt, prev_assign, num_classes)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            scheduler.step()
            prev_q, prev_assign = hs.detach(), assign
            running.append(loss.item())
            if step % 100 == 0 and rank == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {np.mean(running[-100:]):.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        mean_loss = torch.tensor([np.mean(running)], device="cuda")
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} done, mean loss {mean_loss.item():.4f}, {time.time() - tic:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
