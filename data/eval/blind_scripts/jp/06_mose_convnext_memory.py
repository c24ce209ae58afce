"""
Memory-based VOS on MOSE (+ YouTube-VOS), ConvNeXt-T backbone.
Clips are sampled so that every target object is visible in the first frame, which needs
the per-frame object ids of each video; those are indexed once and cached next to the data.

    torchrun --nproc_per_node=8 train_mose.py --mose /datasets/MOSE/train --ytvos /datasets/ytvos2019/train \
        --davis /datasets/DAVIS2017 --out work_dirs/mose_cnxt
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
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

logger = logging.getLogger(__name__)


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--mose", required=True)
    p.add_argument("--ytvos", required=True)
    p.add_argument("--davis", required=True)
    p.add_argument("--out", default="work_dirs/mose_cnxt")
    p.add_argument("--clip_len", type=int, default=6)
    p.add_argument("--max_objects", type=int, default=4)
    p.add_argument("--size", type=int, default=480)
    p.add_argument("--batch", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="for the full 8-GPU batch")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val_every", type=int, default=3)
    return p


def read_img(p, size):
    im = Image.open(p).convert("RGB").resize((size, size), Image.BICUBIC)
    x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0
    return (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]


class IndexedVOS(Dataset):
    """Frames + which object ids appear in each frame, cached to <root>/obj_index.pkl."""

    def __init__(self, root, clip_len, max_objects, size):
        self.root, self.clip_len, self.max_objects, self.size = root, clip_len, max_objects, size
        cache = os.path.join(root, "obj_index.pkl")
        if os.path.exists(cache):
            with open(cache, "rb") as f:
                self.index = pickle.load(f)
        else:
            self.index = self._build_index()
            with open(cache, "wb") as f:
                pickle.dump(self.index, f)
        self.videos = [v for v, frames in self.index.items() if len(frames) >= clip_len]

    def _build_index(self):
        index = {}
        ann_root = os.path.join(self.root, "Annotations")
        for vid in tqdm(sorted(os.listdir(ann_root)), desc=f"indexing {self.root}"):
            frames = []
            for name in sorted(os.listdir(os.path.join(ann_root, vid))):
                ids = np.unique(np.asarray(Image.open(os.path.join(ann_root, vid, name))))
                frames.append((name[:-4], [int(i) for i in ids if i != 0]))
            index[vid] = frames
        return index

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vid = self.videos[i]
        frames = self.index[vid]
        starts = [k for k in range(len(frames) - self.clip_len + 1) if frames[k][1]] or [0]
        s = random.choice(starts)
        gap = random.randint(1, max(1, (len(frames) - s - 1) // (self.clip_len - 1)))
        gap = min(gap, 3)
        ids = [min(s + k * gap, len(frames) - 1) for k in range(self.clip_len)]
        objs = frames[s][1][:]
        random.shuffle(objs)
        objs = objs[: self.max_objects]
        imgs = torch.stack([read_img(os.path.join(self.root, "JPEGImages", vid, frames[k][0] + ".jpg"), self.size) for k in ids])
        lbl = np.zeros((self.clip_len, self.size, self.size), np.int64)
        for t, k in enumerate(ids):
            m = np.asarray(Image.open(os.path.join(self.root, "Annotations", vid, frames[k][0] + ".png")).resize((self.size, self.size), Image.NEAREST))
            for j, o in enumerate(objs, start=1):
                lbl[t][m == o] = j
        return imgs, torch.from_numpy(lbl), len(objs)


class MemoryVOS(nn.Module):
    def __init__(self, max_objects=4, dim=256, key_dim=64):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, features_only=True, out_indices=(0, 1, 2))
        chs = self.backbone.feature_info.channels()   # 96, 192, 384 at strides 4, 8, 16
        self.key = nn.Conv2d(chs[2], key_dim, 1)
        self.mask_enc = nn.Sequential(nn.Conv2d(max_objects + 1, 64, 4, 4), nn.GELU(), nn.Conv2d(64, dim, 4, 4))
        self.value = nn.Conv2d(chs[2] + dim, dim, 3, padding=1)
        self.fuse = nn.Sequential(nn.Conv2d(chs[2] + dim, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU())
        self.up8 = nn.Sequential(nn.Conv2d(dim + chs[1], 128, 3, padding=1), nn.GroupNorm(16, 128), nn.GELU())
        self.up4 = nn.Sequential(nn.Conv2d(128 + chs[0], 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.cls = nn.Conv2d(64, max_objects + 1, 1)
        self.max_objects = max_objects

    def encode(self, x):
        f4, f8, f16 = self.backbone(x)
        return self.key(f16), f16, f8, f4

    def write(self, f16, label_or_prob):
        if label_or_prob.dim() == 3:
            label_or_prob = F.one_hot(label_or_prob, self.max_objects + 1).permute(0, 3, 1, 2).float()
        m = F.interpolate(self.mask_enc(label_or_prob), size=f16.shape[-2:], mode="bilinear", align_corners=False)
        return self.value(torch.cat([f16, m], 1))

    def read(self, qk, mem_k, mem_v):
        b, c, h, w = qk.shape
        aff = torch.einsum("bcn,bcm->bnm", mem_k, qk.flatten(2)) / c ** 0.5
        return torch.einsum("bcn,bnm->bcm", mem_v, aff.softmax(1)).view(b, -1, h, w)

    def decode(self, f16, f8, f4, readout, size):
        x = self.fuse(torch.cat([f16, readout], 1))
        x = self.up8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.up4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(self.cls(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, clip, first_label):
        B, T = clip.shape[:2]
        k, f16, f8, f4 = self.encode(clip.flatten(0, 1))
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in (k, f16, f8, f4)]
        mem_k, mem_v = [k[:, 0].flatten(2)], [self.write(f16[:, 0], first_label).flatten(2)]
        outs = []
        for t in range(1, T):
            ro = self.read(k[:, t], torch.cat(mem_k, 2), torch.cat(mem_v, 2))
            logit = self.decode(f16[:, t], f8[:, t], f4[:, t], ro, clip.shape[-2:])
            outs.append(logit)
            mem_k.append(k[:, t].flatten(2))
            mem_v.append(self.write(f16[:, t], logit.softmax(1)).flatten(2))
        return torch.stack(outs, 1)


def jf_single(pred, gt):
    u = np.logical_or(pred, gt).sum()
    j = 1.0 if u == 0 else np.logical_and(pred, gt).sum() / u
    tp = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    edge = tp - (-F.max_pool2d(-tp, 3, 1, 1))
    dil = F.max_pool2d(edge, 9, 1, 4)
    pb, gb = edge[0, 0] > 0, edge[1, 0] > 0
    if pb.sum() + gb.sum() == 0:
        return j, 1.0
    prec = (pb & (dil[1, 0] > 0)).sum().item() / max(pb.sum().item(), 1)
    rec = (gb & (dil[0, 0] > 0)).sum().item() / max(gb.sum().item(), 1)
    return j, (2 * prec * rec / (prec + rec)) if prec + rec > 0 else 0.0


@torch.no_grad()
def validate(net, davis_root, size, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    seqs = sorted(open(os.path.join(davis_root, "ImageSets/2017/val.txt")).read().split())
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(davis_root, "JPEGImages/480p", seq)))
        gts = [np.asarray(Image.open(os.path.join(davis_root, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names]
        objs = [o for o in np.unique(gts[0]) if o != 0][: net.max_objects]
        lab0 = np.zeros_like(gts[0], dtype=np.int64)
        for j, o in enumerate(objs, start=1):
            lab0[gts[0] == o] = j
        clip = torch.stack([read_img(os.path.join(davis_root, "JPEGImages/480p", seq, n), size) for n in names]).to(device)
        k, f16, f8, f4 = net.encode(clip)
        mem_k, mem_v = [k[:1].flatten(2)], [net.write(f16[:1], torch.from_numpy(lab0)[None].to(device)).flatten(2)]
        scores = []
        for t in range(1, len(names)):
            logit = net.decode(f16[t:t + 1], f8[t:t + 1], f4[t:t + 1], net.read(k[t:t + 1], torch.cat(mem_k, 2), torch.cat(mem_v, 2)), (size, size))
            pred = logit.argmax(1)[0].cpu().numpy()
            scores += [jf_single(pred == j, gts[t] == o) for j, o in enumerate(objs, start=1)]
            if t % 5 == 0:
                mem_k.append(k[t:t + 1].flatten(2))
                mem_v.append(net.write(f16[t:t + 1], logit.softmax(1)).flatten(2))
        js, fs = zip(*scores)
        acc += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")
    random.seed(rank)
    np.random.seed(rank)

    train_set = ConcatDataset([IndexedVOS(args.mose, args.clip_len, args.max_objects, args.size),
                               IndexedVOS(args.ytvos, args.clip_len, args.max_objects, args.size)])
    logger.info("training clips: %d", len(train_set))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(MemoryVOS(args.max_objects).to(device), device_ids=[local_rank])
    lr = args.lr * (world * args.batch) / 16
    optim = torch.optim.AdamW([
        {"params": model.module.backbone.parameters(), "lr": lr * 0.1},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]},
    ], lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs * len(loader))
    writer = SummaryWriter(args.out) if rank == 0 else None
    os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for clip, lbl, _ in loader:
            clip, lbl = clip.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(clip, lbl[:, 0])
            loss = F.cross_entropy(logits.float().flatten(0, 1), lbl[:, 1:].flatten(0, 1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        logger.info("epoch %d finished, last loss %.4f", epoch, loss.item())

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            j, f = validate(model.module, args.davis, args.size, device)
            if rank == 0:
                writer.add_scalars("val", {"J": j, "F": f, "JF": (j + f) / 2}, epoch)
                logger.info("epoch %d DAVIS17-val J %.3f F %.3f J&F %.3f", epoch, j, f, (j + f) / 2)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "latest.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
