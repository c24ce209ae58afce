"""Object-query memory tracker: fine-tune on YouTube-VOS/MOSE clips, evaluate on long videos (LVOS val).

    torchrun --nproc_per_node=8 04_objquery_tracker_lvos.py --train-roots /data/ytvos/train /data/mose/train \
        --val-root /data/lvos/valid --out runs/oq_tracker
"""
import argparse
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torchvision.models import ConvNeXt_Tiny_Weights, convnext_tiny

logger = logging.getLogger(__name__)
NORM_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
NORM_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@dataclass
class Config:
    train_roots: List[str] = field(default_factory=lambda: ["/data/ytvos/train"])
    val_root: str = "/data/lvos/valid"
    out: str = "runs/oq_tracker"
    crop: int = 448
    clip_len: int = 6
    max_obj: int = 4
    max_gap: int = 12
    batch_size: int = 2
    workers: int = 6
    epochs: int = 30
    lr: float = 1e-4
    backbone_lr: float = 1e-5
    wd: float = 0.05
    num_queries: int = 8
    mem_every: int = 8
    max_mem: int = 8
    eval_every: int = 5


def parse() -> Config:
    p = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        if isinstance(v, list):
            p.add_argument("--" + k.replace("_", "-"), nargs="+", default=v)
        else:
            p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    return Config(**vars(p.parse_args()))


def to_tensor(img):
    return torch.from_numpy(((np.asarray(img, dtype=np.float32) / 255.0 - NORM_MEAN) / NORM_STD).transpose(2, 0, 1))


class ClipDataset(Dataset):
    def __init__(self, root, cfg: Config):
        self.root, self.cfg = root, cfg
        meta_path = os.path.join(root, "meta.json")
        with open(meta_path) as f:
            meta = json.load(f)["videos"]
        self.items = []
        for vid, info in sorted(meta.items()):
            frames = sorted({fr for obj in info["objects"].values() for fr in obj["frames"]})
            if len(frames) >= cfg.clip_len:
                self.items.append((vid, frames))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, frames = self.items[i]
        c = self.cfg
        for _ in range(8):
            s = random.randint(0, len(frames) - c.clip_len)
            sel = [s]
            for _ in range(c.clip_len - 1):
                sel.append(min(len(frames) - 1, sel[-1] + random.randint(1, c.max_gap)))
            sel = sorted(set(sel))
            while len(sel) < c.clip_len:
                sel.append(random.choice([j for j in range(len(frames)) if j not in sel]))
                sel.sort()
            imgs = [Image.open(os.path.join(self.root, "JPEGImages", vid, frames[j] + ".jpg")).convert("RGB") for j in sel]
            anns = [Image.open(os.path.join(self.root, "Annotations", vid, frames[j] + ".png")) for j in sel]
            w, h = imgs[0].size
            sc = c.crop / min(w, h) * random.uniform(1.0, 1.5)
            nw, nh = max(c.crop, int(w * sc)), max(c.crop, int(h * sc))
            x, y = random.randint(0, nw - c.crop), random.randint(0, nh - c.crop)
            box = (x, y, x + c.crop, y + c.crop)
            imgs = [im.resize((nw, nh), Image.BILINEAR).crop(box) for im in imgs]
            anns = [np.asarray(a.resize((nw, nh), Image.NEAREST).crop(box)) for a in anns]
            ids = [o for o in np.unique(anns[0]) if o not in (0, 255) and (anns[0] == o).sum() > 64]
            if ids:
                break
        ids = random.sample(ids, min(len(ids), c.max_obj))
        rgb = torch.stack([to_tensor(im) for im in imgs])
        masks = torch.zeros(c.clip_len, c.max_obj, c.crop, c.crop)
        valid = torch.zeros(c.max_obj, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = torch.from_numpy(np.stack(anns) == o).float()
            valid[k] = True
        return rgb, masks, valid


class PixelEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        feats = convnext_tiny(weights=ConvNeXt_Tiny_Weights.IMAGENET1K_V1).features
        self.s4, self.s8, self.s16 = feats[:2], feats[2:4], feats[4:6]

    def forward(self, x):
        f4 = self.s4(x)
        f8 = self.s8(f4)
        return self.s16(f8), f8, f4  # 384, 192, 96 channels


class ObjectTransformer(nn.Module):
    def __init__(self, dim=256, num_queries=8, layers=2, heads=8):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * 0.02)
        self.q2p = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])
        self.p2q = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                nn.Linear(4 * dim, dim)) for _ in range(layers)])
        self.norm_q = nn.ModuleList([nn.LayerNorm(dim) for _ in range(layers)])
        self.norm_p = nn.ModuleList([nn.LayerNorm(dim) for _ in range(layers)])

    def forward(self, pix, summary):
        # pix: N, HW, C ; summary: N, C (masked-pooled object memory)
        q = self.queries.unsqueeze(0) + summary.unsqueeze(1)
        for a, b, ffn, nq, npx in zip(self.q2p, self.p2q, self.ffn, self.norm_q, self.norm_p):
            q = q + a(nq(q), pix, pix, need_weights=False)[0]
            q = q + ffn(q)
            pix = pix + b(npx(pix), q, q, need_weights=False)[0]
        return pix


class Tracker(nn.Module):
    def __init__(self, num_queries=8, dim=256, key_dim=64):
        super().__init__()
        self.pixel_encoder = PixelEncoder()
        self.key_proj = nn.Conv2d(384, key_dim, 1)
        self.pix_proj = nn.Conv2d(384, dim, 1)
        self.mask_encoder = nn.Sequential(nn.Conv2d(dim + 2, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU(),
                                          nn.Conv2d(dim, dim, 3, padding=1))
        self.object_transformer = ObjectTransformer(dim, num_queries)
        self.fuse = nn.Conv2d(2 * dim, dim, 1)
        self.up8 = nn.Sequential(nn.Conv2d(dim + 192, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.GELU())
        self.up4 = nn.Sequential(nn.Conv2d(128 + 96, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.head = nn.Conv2d(64, 1, 1)

    def encode(self, img):
        f16, f8, f4 = self.pixel_encoder(img)
        return self.key_proj(f16), self.pix_proj(f16), f8, f4

    def encode_memory(self, pix, masks):
        # pix: B,C,h,w ; masks: B,K,H,W (probabilities) -> values B,K,C,h,w and summaries B,K,C
        B, K = masks.shape[:2]
        m = F.interpolate(masks, size=pix.shape[-2:], mode="area")
        others = m.sum(1, keepdim=True) - m
        x = torch.cat([pix.unsqueeze(1).expand(-1, K, -1, -1, -1), m.unsqueeze(2), others.unsqueeze(2)], 2)
        v = self.mask_encoder(x.flatten(0, 1)).view(B, K, -1, *pix.shape[-2:])
        summary = (v * m.unsqueeze(2)).sum((-1, -2)) / m.sum((-1, -2)).unsqueeze(-1).clamp(min=1e-4)
        return v, summary

    def decode(self, key, pix, f8, f4, mem_key, mem_val, mem_sum, out_size):
        # mem_key: B,Ck,N ; mem_val: B,K,C,N ; mem_sum: B,K,C
        B, K, C, _ = mem_val.shape
        h, w = key.shape[-2:]
        aff = torch.softmax(mem_key.transpose(1, 2) @ key.flatten(2) / mem_key.shape[1] ** 0.5, dim=1)
        read = (mem_val.flatten(1, 2) @ aff).view(B * K, C, h * w).transpose(1, 2)
        x = self.object_transformer(read, mem_sum.flatten(0, 1)).transpose(1, 2).reshape(B * K, C, h, w)
        x = self.fuse(torch.cat([x, pix.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1)], 1))
        rep = lambda f: f.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1)
        x = self.up8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), rep(f8)], 1))
        x = self.up4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), rep(f4)], 1))
        logits = F.interpolate(self.head(x), size=out_size, mode="bilinear", align_corners=False)
        return logits.view(B, K, *out_size)

    def forward(self, rgb, masks, valid):
        B, T, _, H, W = rgb.shape
        key, pix, f8, f4 = (x.view(B, T, *x.shape[1:]) for x in self.encode(rgb.flatten(0, 1)))
        vm = valid[:, :, None, None].float()
        v, s = self.encode_memory(pix[:, 0], masks[:, 0] * vm)
        keys, vals, sums, outs = [key[:, 0].flatten(2)], [v.flatten(3)], [s], []
        for t in range(1, T):
            logits = self.decode(key[:, t], pix[:, t], f8[:, t], f4[:, t], torch.cat(keys, 2), torch.cat(vals, 3),
                                 torch.stack(sums, 0).mean(0), (H, W))
            outs.append(logits)
            if t < T - 1:
                v, s = self.encode_memory(pix[:, t], torch.sigmoid(logits) * vm)
                keys.append(key[:, t].flatten(2))
                vals.append(v.flatten(3))
                sums.append(s)
        return torch.stack(outs, 1)


def object_losses(logits, gt, valid):
    w = valid[:, None, :].float().expand(-1, logits.shape[1], -1)
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2))
    p = torch.sigmoid(logits).flatten(-2)
    g = gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    n = w.sum().clamp(min=1)
    return ((bce * w).sum() + (dice * w).sum()) / n


@torch.no_grad()
def eval_long_videos(net, cfg: Config, device, rank, world):
    videos = sorted(os.listdir(os.path.join(cfg.val_root, "JPEGImages")))
    local = []
    net.eval()
    for vid in videos[rank::world]:
        names = sorted(f[:-4] for f in os.listdir(os.path.join(cfg.val_root, "JPEGImages", vid)))
        first = np.asarray(Image.open(os.path.join(cfg.val_root, "Annotations", vid, names[0] + ".png")))
        ids = [o for o in np.unique(first) if o not in (0, 255)]
        init = torch.stack([torch.from_numpy(first == o).float() for o in ids])[None].to(device)
        hits = {o: [] for o in ids}
        mem = None
        for t, name in enumerate(names):
            img = to_tensor(Image.open(os.path.join(cfg.val_root, "JPEGImages", vid, name + ".jpg")).convert("RGB"))
            H, W = img.shape[-2:]
            img = F.pad(img[None].to(device), (0, (-W) % 32, 0, (-H) % 32))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                key, pix, f8, f4 = net.encode(img)
                if t == 0:
                    prob = F.pad(init, (0, (-W) % 32, 0, (-H) % 32))
                else:
                    logits = net.decode(key, pix, f8, f4, torch.cat(mem[0], 2), torch.cat(mem[1], 3),
                                        torch.stack(mem[2], 0).mean(0), img.shape[-2:])
                    prob = torch.sigmoid(logits.float())
                if t == 0 or t % cfg.mem_every == 0:
                    v, s = net.encode_memory(pix, prob)
                    if mem is None:
                        mem = ([key.flatten(2)], [v.flatten(3)], [s])
                    else:
                        for lst, x in zip(mem, (key.flatten(2), v.flatten(3), s)):
                            lst.append(x)
                            del lst[1:-(cfg.max_mem - 1)]
            gt_path = os.path.join(cfg.val_root, "Annotations", vid, name + ".png")
            if t == 0 or not os.path.exists(gt_path):
                continue
            gt = np.asarray(Image.open(gt_path))
            pred_ids = prob[0, :, :H, :W].float()
            pred = torch.where(pred_ids.max(0).values > 0.5, pred_ids.argmax(0) + 1, 0).cpu().numpy()
            for k, o in enumerate(ids):
                pm, gm = pred == k + 1, gt == o
                union = (pm | gm).sum()
                hits[o].append(1.0 if union == 0 else (pm & gm).sum() / union)
        local.extend(float(np.mean(v)) for v in hits.values() if v)
    net.train()
    local = torch.tensor(local, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered)


def main():
    cfg = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    net = Tracker(cfg.num_queries).to(device)
    model = DDP(net, device_ids=[local_rank])
    backbone = [p for n, p in net.named_parameters() if n.startswith("pixel_encoder.")]
    others = [p for n, p in net.named_parameters() if not n.startswith("pixel_encoder.")]
    opt = torch.optim.AdamW([{"params": backbone, "lr": cfg.backbone_lr}, {"params": others, "lr": cfg.lr}],
                            weight_decay=cfg.wd)
    data = ConcatDataset([ClipDataset(r, cfg) for r in cfg.train_roots])
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(loader), eta_min=1e-7)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
    logger.info("train clips: %d, iters/epoch: %d", len(data), len(loader))

    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (rgb, masks, valid) in enumerate(loader):
            rgb, masks, valid = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, masks, valid)
            loss = object_losses(logits.float(), masks[:, 1:], valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 50 == 0:
                logger.info("epoch %d it %d/%d loss %.4f %.2fs/it", epoch, it, len(loader), loss.item(),
                            (time.time() - tic) / (it + 1))

        if (epoch + 1) % cfg.eval_every == 0 or epoch == cfg.epochs - 1:
            scores = eval_long_videos(net, cfg, device, rank, world)
            j = scores.mean().item()
            logger.info("epoch %d LVOS val J %.4f over %d objects", epoch, j, scores.numel())
            if rank == 0:
                state = {"pixel_encoder": net.pixel_encoder.state_dict(),
                         "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("pixel_encoder.")},
                         "optimizer": opt.state_dict(), "epoch": epoch, "J": j}
                torch.save(state, os.path.join(cfg.out, "last.pt"))
                if j > best:
                    torch.save(state, os.path.join(cfg.out, "best.pt"))
            best = max(best, j)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
