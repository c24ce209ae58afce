"""SeqFormer-style VIS training on YouTube-VIS 2019 (clips of 5 frames, 2 clips per GPU).

Instance queries are shared across frames of a clip; each query predicts one class for
the clip and one box + mask per frame.
"""
import argparse
import json
import logging
import math
import os
import random
from dataclasses import dataclass, asdict

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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("seqformer")


@dataclass
class Config:
    data_root: str = "/mnt/datasets/youtube_vis_2019"
    output_dir: str = "exps/seqformer_r50_ytvis19"
    num_classes: int = 40
    num_queries: int = 300
    num_frames: int = 5
    clips_per_gpu: int = 2
    crop_min: float = 0.6
    epochs: int = 12
    lr: float = 2e-4
    lr_backbone: float = 2e-5
    weight_decay: float = 1e-4
    grad_clip: float = 0.1
    workers: int = 4
    log_every: int = 50


class YTVISClips(Dataset):
    def __init__(self, cfg):
        with open(os.path.join(cfg.data_root, "annotations", "instances_train_sub.json")) as f:
            d = json.load(f)
        self.cfg = cfg
        self.videos = [v for v in d["videos"]]
        self.anns = {}
        for a in d["annotations"]:
            self.anns.setdefault(a["video_id"], []).append(a)
        cats = sorted(c["id"] for c in d["categories"])
        self.cat_to_label = {c: i for i, c in enumerate(cats)}

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, idx):
        v = self.videos[idx]
        n, T = v["length"], self.cfg.num_frames
        ref = random.randrange(n)
        ids = sorted(min(max(ref + random.randint(-3, 3), 0), n - 1) for _ in range(T))
        H, W = v["height"], v["width"]
        s = random.uniform(self.cfg.crop_min, 1.0)
        ch, cw = int(H * s), int(W * s)
        y0, x0 = random.randint(0, H - ch), random.randint(0, W - cw)
        flip = random.random() < 0.5
        frames = []
        for t in ids:
            img = Image.open(os.path.join(self.cfg.data_root, "train", "JPEGImages", v["file_names"][t])).convert("RGB")
            img = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((640, 360))
            x = torchvision.transforms.functional.to_tensor(img)
            frames.append(x.flip(-1) if flip else x)
        frames = torchvision.transforms.functional.normalize(torch.stack(frames), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        masks, labels = [], []
        for a in self.anns.get(v["id"], []):
            per = []
            for t in ids:
                seg = a["segmentations"][t]
                m = np.zeros((H, W), np.uint8) if seg is None else mask_util.decode(mask_util.frPyObjects(seg, H, W) if isinstance(seg["counts"], list) else seg)
                m = torch.from_numpy(m[y0 : y0 + ch, x0 : x0 + cw]).float()
                m = F.interpolate(m[None, None], size=(360, 640), mode="nearest")[0, 0]
                per.append(m.flip(-1) if flip else m)
            per = torch.stack(per)
            if per.sum() > 16:
                masks.append(per)
                labels.append(self.cat_to_label[a["category_id"]])
        masks = torch.stack(masks) if masks else torch.zeros(0, T, 360, 640)
        return frames, {"masks": masks, "labels": torch.tensor(labels, dtype=torch.long)}


def collate(batch):
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


class SeqFormerLite(nn.Module):
    def __init__(self, cfg, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = torchvision.models._utils.IntermediateLayerGetter(r, {"layer2": "res3", "layer4": "res5"})
        self.in_proj = nn.Conv2d(2048, dim, 1)
        self.mask_proj = nn.Conv2d(512, dim // 2, 1)
        self.query = nn.Embedding(cfg.num_queries, dim)
        self.frame_pos = nn.Embedding(cfg.num_frames, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True, norm_first=True), 6)
        self.class_embed = nn.Linear(dim, cfg.num_classes + 1)
        self.frame_adapter = nn.Linear(dim, dim)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim // 2))

    def forward(self, clips):  # B x T x 3 x H x W
        B, T = clips.shape[:2]
        feats = self.backbone(clips.flatten(0, 1))
        src = self.in_proj(feats["res5"])
        mf = self.mask_proj(feats["res3"]).unflatten(0, (B, T))
        mem = src.flatten(2).transpose(1, 2).unflatten(0, (B, T)) + self.frame_pos.weight[None, :T, None]
        hs = self.decoder(self.query.weight[None].expand(B, -1, -1), mem.flatten(1, 2))
        logits = self.class_embed(hs)
        per_frame = hs[:, None] + self.frame_adapter(mem.mean(2))[:, :, None]
        masks = torch.einsum("btqc,btchw->bqthw", self.mask_embed(per_frame), mf)
        return logits, masks


def dice_loss(x, y):
    x = x.sigmoid().flatten(1)
    y = y.flatten(1)
    return (1 - (2 * (x * y).sum(1) + 1) / (x.sum(1) + y.sum(1) + 1)).mean()


def criterion(logits, masks, targets, num_classes):
    loss_ce, loss_mask = 0.0, 0.0
    for b, tgt in enumerate(targets):
        gt = F.interpolate(tgt["masks"], size=masks.shape[-2:], mode="bilinear", align_corners=False)
        prob = logits[b].softmax(-1)
        pm = masks[b].flatten(1).sigmoid()
        g = gt.flatten(1)
        cost = 2 * (-prob[:, tgt["labels"]]) + 5 * (1 - (2 * pm @ g.T + 1) / (pm.sum(1)[:, None] + g.sum(1)[None] + 1))
        r, c = linear_sum_assignment(cost.detach().float().cpu())
        cls_t = torch.full((logits.shape[1],), num_classes, dtype=torch.long, device=logits.device)
        cls_t[r] = tgt["labels"][c]
        w = torch.ones(num_classes + 1, device=logits.device)
        w[-1] = 0.1
        loss_ce = loss_ce + F.cross_entropy(logits[b], cls_t, w)
        if len(r):
            loss_mask = loss_mask + F.binary_cross_entropy_with_logits(masks[b][r], gt[c]) + dice_loss(masks[b][r], gt[c])
    n = len(targets)
    return {"loss_ce": 2 * loss_ce / n, "loss_mask": 5 * loss_mask / n}


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


def main():
    parser = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(parser.parse_args()))
    local_rank, rank, world = setup()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    torch.manual_seed(0)
    dataset = YTVISClips(cfg)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=cfg.clips_per_gpu, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=collate, drop_last=True, pin_memory=True, persistent_workers=True)

    model = DDP(SeqFormerLite(cfg).cuda(local_rank), device_ids=[local_rank])
    groups = [{"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad], "lr": cfg.lr},
              {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad], "lr": cfg.lr_backbone}]
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    total = cfg.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for clips, targets in loader:
            if sum(len(t["labels"]) for t in targets) == 0:
                continue
            clips = clips.cuda(local_rank, non_blocking=True)
            targets = [{k: v.cuda(local_rank, non_blocking=True) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, masks = model(clips)
            losses = criterion(logits.float(), masks.float(), targets, cfg.num_classes)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                vals = torch.stack([v.detach() for v in losses.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                log.info("ep %d step %d/%d %s lr %.2e", epoch, step, total,
                         " ".join(f"{k}={x:.4f}" for k, x in zip(losses, vals.tolist())), scheduler.get_last_lr()[0])
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "cfg": asdict(cfg)},
                       os.path.join(cfg.output_dir, f"checkpoint{epoch:04d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
