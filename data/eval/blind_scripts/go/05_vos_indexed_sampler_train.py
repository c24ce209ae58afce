"""Memory-attention VOS fine-tuning with a visibility-aware clip sampler.

Clips are drawn so that the sampled objects stay visible (area >= min_area) in the
reference frame; per-frame object areas come from a one-off annotation index.

    torchrun --nproc_per_node=8 05_vos_indexed_sampler_train.py --config configs/ft_mose.yaml
"""
import argparse
import logging
import os
import pickle
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

log = logging.getLogger("train")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

DEFAULT_CFG = """
data:
  root: /data/MOSE/train
  cache_dir: /data/cache/vos_index
  val_root: /data/DAVIS/2017/trainval
  min_area: 100
  clip_len: 8
  max_objects: 3
  max_stride: 8
  size: 512
train:
  batch_size: 2
  workers: 8
  epochs: 25
  lr: 6.0e-5
  backbone_lr_scale: 0.1
  weight_decay: 0.05
  out_dir: outputs/mose_ft
eval:
  every: 5
  mem_every: 5
  max_mem: 6
model:
  backbone: convnext_tiny.fb_in22k
  dim: 256
  mem_dim: 64
  layers: 4
"""


def build_index(root, cache_dir, min_area):
    """{video: [(frame_name, {obj_id: area})...]} for every annotated frame."""
    cache = os.path.join(cache_dir, f"index_{os.path.basename(root.rstrip('/'))}_{min_area}.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    ann_root = os.path.join(root, "Annotations")
    index = {}
    for vid in tqdm(sorted(os.listdir(ann_root)), desc="indexing annotations"):
        frames = []
        for name in sorted(os.listdir(os.path.join(ann_root, vid))):
            ann = np.asarray(Image.open(os.path.join(ann_root, vid, name)))
            ids, counts = np.unique(ann, return_counts=True)
            areas = {int(i): int(c) for i, c in zip(ids, counts) if i not in (0, 255) and c >= min_area}
            frames.append((name[:-4], areas))
        index[vid] = frames
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(index, f)
    return index


class IndexedClips(Dataset):
    def __init__(self, cfg):
        self.cfg = cfg
        self.root = cfg.root
        index = build_index(cfg.root, cfg.cache_dir, cfg.min_area)
        self.videos = [(v, fr) for v, fr in sorted(index.items()) if len(fr) >= cfg.clip_len]

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vid, frames = self.videos[i]
        c = self.cfg
        starts = [j for j in range(len(frames) - c.clip_len + 1) if frames[j][1]] or [0]
        s = random.choice(starts)
        idx = [s]
        for _ in range(c.clip_len - 1):
            idx.append(min(len(frames) - 1, idx[-1] + random.randint(1, c.max_stride)))
        ids = list(frames[s][1].keys())
        random.shuffle(ids)
        ids = ids[: c.max_objects]
        S = c.size
        imgs, anns = [], []
        for j in idx:
            name = frames[j][0]
            imgs.append(Image.open(os.path.join(self.root, "JPEGImages", vid, name + ".jpg")).convert("RGB"))
            anns.append(Image.open(os.path.join(self.root, "Annotations", vid, name + ".png")))
        w, h = imgs[0].size
        sc = S / min(w, h) * random.uniform(1.0, 1.3)
        nw, nh = max(S, round(w * sc)), max(S, round(h * sc))
        x0, y0 = random.randint(0, nw - S), random.randint(0, nh - S)
        box = (x0, y0, x0 + S, y0 + S)
        rgb = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32)
                                             / 255.0).permute(2, 0, 1) - MEAN) / STD for im in imgs])
        lab = np.stack([np.asarray(a.resize((nw, nh), Image.NEAREST).crop(box)) for a in anns])
        masks = torch.zeros(c.clip_len, c.max_objects, S, S)
        valid = torch.zeros(c.max_objects, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = torch.from_numpy(lab == o).float()
            valid[k] = bool(masks[0, k].sum() > 0)
        return rgb, masks, valid


def sine_pos(h, w, dim, device):
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    freq = 1.0 / 10000 ** (torch.arange(dim // 4, device=device).float() / (dim // 4))
    ys, xs = ys.flatten().float()[:, None] * freq, xs.flatten().float()[:, None] * freq
    return torch.cat([xs.sin(), xs.cos(), ys.sin(), ys.cos()], 1)


class MemLayer(nn.Module):
    def __init__(self, dim, mem_dim):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.sa = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.ca = nn.MultiheadAttention(dim, 8, kdim=mem_dim, vdim=mem_dim, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 1024), nn.GELU(), nn.Linear(1024, dim))

    def forward(self, x, pos, mem, mpos):
        q = self.n1(x) + pos
        x = x + self.sa(q, q, self.n1(x), need_weights=False)[0]
        x = x + self.ca(self.n2(x) + pos, mem + mpos, mem, need_weights=False)[0]
        return x + self.ff(self.n3(x))


class MemTracker(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.backbone = timm.create_model(m.backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        chs = self.backbone.feature_info.channels()
        self.lat = nn.ModuleList([nn.Conv2d(c, m.dim, 1) for c in chs])
        self.mask_enc = nn.Sequential(nn.Conv2d(1, 32, 4, 4), nn.GELU(), nn.Conv2d(32, m.dim, 4, 4))
        self.mem_out = nn.Sequential(nn.Conv2d(m.dim, m.dim, 3, padding=1), nn.GELU(), nn.Conv2d(m.dim, m.mem_dim, 1))
        self.layers = nn.ModuleList([MemLayer(m.dim, m.mem_dim) for _ in range(m.layers)])
        self.norm = nn.LayerNorm(m.dim)
        self.dec8 = nn.Sequential(nn.Conv2d(m.dim, m.dim, 3, padding=1), nn.GroupNorm(32, m.dim), nn.GELU())
        self.dec4 = nn.Sequential(nn.Conv2d(m.dim, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.Conv2d(64, 1, 1))
        self.mem_dim = m.mem_dim

    def features(self, x):
        return [l(f) for l, f in zip(self.lat, self.backbone(x))]

    def memorize(self, f16, mask_prob):
        return self.mem_out(f16 + self.mask_enc(mask_prob))

    def predict(self, f4, f8, f16, mems, size):
        n, c, h, w = f16.shape
        pos = sine_pos(h, w, c, f16.device)[None]
        mem = torch.stack(mems, 1).permute(0, 1, 3, 4, 2).reshape(n, -1, self.mem_dim)
        mpos = sine_pos(h, w, self.mem_dim, f16.device).repeat(len(mems), 1)[None]
        x = f16.flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pos, mem, mpos)
        x = self.norm(x).transpose(1, 2).reshape(n, c, h, w)
        x = self.dec8(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f8)
        x = self.dec4(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f4)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, masks):
        B, T, _, H, W = rgb.shape
        K = masks.shape[2]
        feats = self.features(rgb.flatten(0, 1))
        # every object of a clip shares the clip's frame features
        f4, f8, f16 = (f.view(B, 1, T, *f.shape[1:]).expand(-1, K, -1, -1, -1, -1).reshape(B * K, T, *f.shape[1:])
                       for f in feats)
        mems = [self.memorize(f16[:, 0], masks[:, 0].reshape(B * K, 1, H, W))]
        out = []
        for t in range(1, T):
            logit = self.predict(f4[:, t], f8[:, t], f16[:, t], mems, (H, W))
            out.append(logit)
            if t < T - 1:
                mems.append(self.memorize(f16[:, t], torch.sigmoid(logit)))
        return torch.cat(out, 1).view(B, K, T - 1, H, W)


def seg_loss(logits, gt, valid):
    w = valid.float()[:, :, None]
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2))
    p, g = logits.sigmoid().flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    return ((bce + dice) * w).sum() / (w.sum() * logits.shape[2]).clamp(min=1)


@torch.no_grad()
def evaluate(net, cfg, device, rank, world):
    root = cfg.data.val_root
    vids = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    net.eval()
    for vid in vids[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", vid)))
        gts = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", vid, n[:-4] + ".png")))
                                         for n in names]).astype(np.int64)).to(device)
        K = int(gts[0].max())
        H, W = gts.shape[-2:]
        mems, preds = [], [gts[0]]
        for t, n in enumerate(names):
            im = Image.open(os.path.join(root, "JPEGImages/480p", vid, n)).convert("RGB").resize((864, 480), Image.BILINEAR)
            x = ((torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD)[None].to(device)
            f4, f8, f16 = (f.expand(K, -1, -1, -1) for f in net.features(x))
            if t == 0:
                prob = F.interpolate(torch.stack([(gts[0] == k + 1).float() for k in range(K)])[:, None], size=(480, 864))
            else:
                prob = torch.sigmoid(net.predict(f4, f8, f16, mems, (480, 864)))
                up = F.interpolate(prob, size=(H, W), mode="bilinear", align_corners=False)[:, 0]
                preds.append(torch.where(up.max(0).values > 0.5, up.argmax(0) + 1, 0))
            if t % cfg.eval.mem_every == 0:
                mems = (mems[:1] + mems[1:][-(cfg.eval.max_mem - 2):] if mems else []) + [net.memorize(f16, prob)]
        pred = torch.stack(preds)
        for k in range(1, K + 1):
            i = ((pred[1:-1] == k) & (gts[1:-1] == k)).flatten(1).sum(1).double()
            u = ((pred[1:-1] == k) | (gts[1:-1] == k)).flatten(1).sum(1).double()
            acc[0] += torch.where(u > 0, i / u.clamp(min=1), torch.ones_like(u)).mean()
            acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = OmegaConf.create(DEFAULT_CFG)
    if a.config:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(a.config))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(rank + 7)
    torch.manual_seed(7)

    dataset = IndexedClips(cfg.data)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, sampler=sampler, num_workers=cfg.train.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = MemTracker(cfg.model).to(device)
    model = DDP(net, device_ids=[local_rank])
    bb = list(net.backbone.parameters())
    bb_ids = set(map(id, bb))
    opt = torch.optim.AdamW([{"params": bb, "lr": cfg.train.lr * cfg.train.backbone_lr_scale},
                             {"params": [p for p in net.parameters() if id(p) not in bb_ids]}],
                            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.train.epochs * len(loader))
    tb = SummaryWriter(cfg.train.out_dir) if rank == 0 else None
    log.info("videos: %d  iters/epoch: %d", len(dataset), len(loader))

    step = 0
    for epoch in range(cfg.train.epochs):
        sampler.set_epoch(epoch)
        for rgb, masks, valid in loader:
            rgb, masks, valid = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, masks)
            loss = seg_loss(logits.float(), masks[:, 1:].transpose(1, 2), valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 20 == 0:
                tb.add_scalar("loss/train", loss.item(), step)
        if (epoch + 1) % cfg.eval.every == 0:
            j = evaluate(net, cfg, device, rank, world)
            if rank == 0:
                tb.add_scalar("val/J", j, step)
                log.info("epoch %d  DAVIS17 J %.4f", epoch, j)
        if rank == 0:
            torch.save({"backbone": net.backbone.state_dict(),
                        "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("backbone.")},
                        "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg.train.out_dir, f"epoch_{epoch:03d}.pth"))
    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
