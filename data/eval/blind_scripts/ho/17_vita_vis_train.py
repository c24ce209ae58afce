"""VITA-style offline VIS: a frame-level query decoder produces object tokens per frame,
and a video-level decoder aggregates them into video queries that predict one class and
a mask tube per object.

    torchrun --nproc_per_node=8 17_vita_vis_train.py --cfg configs/vita_r50_ovis.json
    torchrun --nproc_per_node=8 17_vita_vis_train.py --cfg configs/vita_r50_ovis.json --eval-only --weights out/vita/model_best.pth
"""
import argparse
import json
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
from pycocotools.ytvos import YTVOS
from pycocotools.ytvoseval import YTVOSeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_img(path, short=320):
    im = Image.open(path).convert("RGB")
    s = short / min(im.size)
    im = im.resize((round(im.width * s / 32) * 32, round(im.height * s / 32) * 32))
    x = torchvision.transforms.functional.to_tensor(im)
    return torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class Clips(Dataset):
    def __init__(self, ann, root, T):
        self.api, self.root, self.T = YTVOS(ann), root, T
        self.cats = sorted(self.api.getCatIds())
        self.vids = [v for v in sorted(self.api.getVidIds()) if self.api.getAnnIds(vidIds=[v])]

    def __len__(self):
        return len(self.vids) * 4

    def __getitem__(self, i):
        vid = self.vids[i % len(self.vids)]
        info = self.api.loadVids(vid)[0]
        n = info["length"]
        s = random.randint(0, max(0, n - self.T))
        idx = [min(s + k, n - 1) for k in range(self.T)]
        frames = torch.stack([load_img(os.path.join(self.root, info["file_names"][t])) for t in idx])
        tubes, labels = [], []
        for a in self.api.loadAnns(self.api.getAnnIds(vidIds=[vid])):
            tube = []
            for t in idx:
                seg = a["segmentations"][t]
                if seg is None:
                    tube.append(torch.zeros(info["height"], info["width"]))
                else:
                    rle = mask_util.frPyObjects(seg, info["height"], info["width"]) if isinstance(seg["counts"], list) else seg
                    tube.append(torch.from_numpy(mask_util.decode(rle)).float())
            tube = F.interpolate(torch.stack(tube)[None], size=frames.shape[-2:], mode="nearest")[0]
            if tube.sum() > 0:
                tubes.append(tube)
                labels.append(self.cats.index(a["category_id"]))
        tubes = torch.stack(tubes) if tubes else torch.zeros(0, self.T, *frames.shape[-2:])
        return frames, {"masks": tubes, "labels": torch.tensor(labels, dtype=torch.long)}


class VITA(nn.Module):
    def __init__(self, num_classes, frame_queries=100, video_queries=100, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.body = torchvision.models._utils.IntermediateLayerGetter(r, {"layer2": "p3", "layer4": "p5"})
        self.p5, self.p3 = nn.Conv2d(2048, dim, 1), nn.Conv2d(512, dim, 1)
        self.fq = nn.Embedding(frame_queries, dim)
        self.frame_dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.0, batch_first=True), 6)
        self.obj_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 1024, 0.0, batch_first=True), 3)
        self.vq = nn.Embedding(video_queries, dim)
        self.video_dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.0, batch_first=True), 3)
        self.cls = nn.Linear(dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, frames):  # T x 3 x H x W
        f = self.body(frames)
        mem = self.p5(f["p5"]).flatten(2).transpose(1, 2)
        tokens = self.frame_dec(self.fq.weight[None].expand(len(frames), -1, -1), mem)  # T x Qf x C
        tokens = self.obj_enc(tokens.reshape(1, -1, tokens.shape[-1]))
        vq = self.video_dec(self.vq.weight[None], tokens)[0]
        masks = torch.einsum("qc,tchw->qthw", self.mask_embed(vq), self.p3(f["p3"]))
        return self.cls(vq), masks


def vita_loss(logits, masks, tgt, num_classes):
    cls_t = torch.full((len(logits),), num_classes, device=logits.device)
    l_mask = masks.sum() * 0
    if len(tgt["labels"]):
        gt = F.interpolate(tgt["masks"], size=masks.shape[-2:], mode="nearest").flatten(1)
        pm = masks.flatten(1).sigmoid()
        dice = 1 - (2 * pm @ gt.T + 1) / (pm.sum(1)[:, None] + gt.sum(1)[None] + 1)
        r, c = linear_sum_assignment((5 * dice - 2 * logits.softmax(-1)[:, tgt["labels"]]).detach().cpu())
        cls_t[r] = tgt["labels"][c]
        l_mask = 5 * F.binary_cross_entropy_with_logits(masks.flatten(1)[r], gt[c]) + 5 * dice[r, c].mean()
    w = torch.ones(num_classes + 1, device=logits.device)
    w[-1] = 0.1
    return 2 * F.cross_entropy(logits, cls_t, w) + l_mask


@torch.no_grad()
def inference(net, api, root, vids, window=20, topk=10):
    out = []
    cats = sorted(api.getCatIds())
    for vid in vids:
        info = api.loadVids(vid)[0]
        names = info["file_names"]
        scores, masks = [], []
        for s in range(0, len(names), window):
            frames = torch.stack([load_img(os.path.join(root, n)) for n in names[s : s + window]]).cuda()
            logits, m = net(frames)
            scores.append(logits.softmax(-1)[:, :-1])
            masks.append((F.interpolate(m, size=(info["height"], info["width"]), mode="bilinear", align_corners=False) > 0).cpu())
        score = torch.stack(scores).mean(0)
        masks = torch.cat(masks, 1)
        top = score.flatten().topk(topk)
        for sc, ix in zip(top.values.tolist(), top.indices.tolist()):
            q, c = divmod(ix, score.shape[1])
            segs = []
            for m in masks[q].numpy():
                rle = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
                rle["counts"] = rle["counts"].decode()
                segs.append(rle)
            out.append({"video_id": vid, "category_id": cats[c], "score": sc, "segmentations": segs})
    return out


def evaluate(net, api, root, rank, world, out_dir, tag):
    net.eval()
    mine = inference(net, api, root, sorted(api.getVidIds())[rank::world])
    net.train()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    ap = 0.0
    if rank == 0:
        res = [r for p in parts for r in p]
        with open(os.path.join(out_dir, f"results_{tag}.json"), "w") as f:
            json.dump(res, f)
        ev = YTVOSeval(api, api.loadRes(res), "segm")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        ap = float(ev.stats[0])
    return ap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--weights", default="")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = json.load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = cfg["output_dir"]
    os.makedirs(out_dir, exist_ok=True)

    train_set = Clips(cfg["train_ann"], cfg["img_root"], cfg["num_frames"])
    val_api = YTVOS(cfg["val_ann"])
    num_classes = len(train_set.cats)

    net = VITA(num_classes).cuda()
    start_epoch, best = 0, 0.0
    if args.weights:
        ckpt = torch.load(args.weights, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        if args.resume:
            start_epoch, best = ckpt["epoch"] + 1, ckpt.get("ap", 0.0)
    model = DDP(net, device_ids=[local_rank])

    if args.eval_only:
        ap_val = evaluate(net, val_api, cfg["img_root"], rank, world, out_dir, "eval")
        if rank == 0:
            print(f"AP {ap_val:.4f}")
        dist.destroy_process_group()
        return

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=cfg.get("workers", 4), collate_fn=lambda b: b[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], 0.1, last_epoch=-1)
    for _ in range(start_epoch):
        scheduler.step()

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        tic, tot = time.time(), torch.zeros(2, device="cuda")
        for frames, tgt in loader:
            frames = frames.cuda(non_blocking=True)
            tgt = {k: v.cuda(non_blocking=True) for k, v in tgt.items()}
            logits, masks = model(frames)
            loss = vita_loss(logits, masks, tgt, num_classes)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            tot += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        scheduler.step()
        dist.all_reduce(tot)
        ap_val = evaluate(net, val_api, cfg["img_root"], rank, world, out_dir, f"ep{epoch}")
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} AP {ap_val:.4f} {time.time() - tic:.0f}s", flush=True)
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "ap": ap_val}
            torch.save(ckpt, os.path.join(out_dir, "model_last.pth"))
            if ap_val > best:
                best = ap_val
                torch.save(ckpt, os.path.join(out_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
