#!/usr/bin/env python3
"""SAM2-style memory fine-tuning for semi-supervised video object segmentation.

Trains image encoder + memory encoder + memory attention + mask decoder on
YouTube-VOS clips and evaluates on DAVIS-2017 val (full-length videos).

    torchrun --nproc_per_node=8 01_sam2_memattn_finetune.py --data-root /data/ytvos/train --davis-root /data/DAVIS
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("sam2ft")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser(description="SAM2-style VOS fine-tuning")
    p.add_argument("--data-root", default="/data/ytvos/train")
    p.add_argument("--davis-root", default="/data/DAVIS")
    p.add_argument("--output", default="checkpoints/sam2_ft")
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--resolution", type=int, default=480)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--max-skip", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=2, help="clips per GPU")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--encoder-lr-mult", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mem-layers", type=int, default=4)
    p.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--mem-every", type=int, default=5, help="eval: add a memory frame every N frames")
    p.add_argument("--max-mem", type=int, default=7, help="eval: memory frames kept, first frame included")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class YTVOSClips(Dataset):
    def __init__(self, root, num_frames, max_objects, max_skip, resolution):
        self.img_dir = os.path.join(root, "JPEGImages")
        self.ann_dir = os.path.join(root, "Annotations")
        self.num_frames, self.max_objects = num_frames, max_objects
        self.max_skip, self.res = max_skip, resolution
        self.videos, self.frames = [], {}
        for vid in sorted(os.listdir(self.img_dir)):
            names = sorted(os.listdir(os.path.join(self.img_dir, vid)))
            if len(names) >= num_frames:
                self.videos.append(vid)
                self.frames[vid] = names

    def __len__(self):
        return len(self.videos)

    def _sample(self, n):
        idx = [random.randint(0, n - self.num_frames)]
        for _ in range(self.num_frames - 1):
            idx.append(min(n - 1, idx[-1] + random.randint(1, self.max_skip)))
        return idx

    def _transform(self, imgs, anns):
        w, h = imgs[0].size
        r = self.res
        s = r / min(w, h) * random.uniform(1.0, 1.3)
        nw, nh = max(r, round(w * s)), max(r, round(h * s))
        x0, y0 = random.randint(0, nw - r), random.randint(0, nh - r)
        flip = random.random() < 0.5
        fs, ms = [], []
        for img, ann in zip(imgs, anns):
            img = img.resize((nw, nh), Image.BILINEAR).crop((x0, y0, x0 + r, y0 + r))
            ann = ann.resize((nw, nh), Image.NEAREST).crop((x0, y0, x0 + r, y0 + r))
            f = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
            m = torch.from_numpy(np.asarray(ann, dtype=np.int64))
            if flip:
                f, m = f.flip(-1), m.flip(-1)
            fs.append((f - MEAN) / STD)
            ms.append(m)
        return torch.stack(fs), torch.stack(ms)

    def __getitem__(self, i):
        vid = self.videos[i]
        names = self.frames[vid]
        for _ in range(10):
            idx = self._sample(len(names))
            imgs = [Image.open(os.path.join(self.img_dir, vid, names[j])).convert("RGB") for j in idx]
            anns = [Image.open(os.path.join(self.ann_dir, vid, names[j][:-4] + ".png")) for j in idx]
            frames, masks = self._transform(imgs, anns)
            labels = [l for l in masks[0].unique().tolist() if l not in (0, 255)]
            if labels:
                break
        random.shuffle(labels)
        labels = labels[: self.max_objects]
        obj = torch.zeros(self.num_frames, self.max_objects, self.res, self.res)
        valid = torch.zeros(self.max_objects, dtype=torch.bool)
        for k, l in enumerate(labels):
            obj[:, k] = (masks == l).float()
            valid[k] = True
        return frames, obj, valid


# ----------------------------------------------------------------------------- model
def sine_pos(h, w, dim, device):
    y, x = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                          torch.arange(w, device=device, dtype=torch.float32), indexing="ij")
    npf = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(npf, device=device, dtype=torch.float32) / npf)
    y, x = y.flatten()[:, None] * omega, x.flatten()[:, None] * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)


class ImageEncoder(nn.Module):
    def __init__(self, name, dim):
        super().__init__()
        self.trunk = timm.create_model(name, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        self.neck = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in self.trunk.feature_info.channels()])

    def forward(self, x):
        return [n(f) for n, f in zip(self.neck, self.trunk(x))]  # strides 4, 8, 16


class MemoryEncoder(nn.Module):
    def __init__(self, dim, mem_dim):
        super().__init__()
        self.mask_down = nn.Sequential(
            nn.Conv2d(1, 16, 3, 2, 1), nn.GELU(), nn.Conv2d(16, 64, 3, 2, 1), nn.GELU(),
            nn.Conv2d(64, 256, 3, 2, 1), nn.GELU(), nn.Conv2d(256, dim, 3, 2, 1))
        self.pix_proj = nn.Conv2d(dim, dim, 1)
        self.fuser = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(),
                                   nn.Conv2d(dim, dim, 3, padding=1))
        self.out_proj = nn.Conv2d(dim, mem_dim, 1)

    def forward(self, pix, mask_logits):
        x = self.pix_proj(pix) + self.mask_down(torch.sigmoid(mask_logits))
        return self.out_proj(x + self.fuser(x))


class MemAttnLayer(nn.Module):
    def __init__(self, dim, mem_dim, heads=8):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, kdim=mem_dim, vdim=mem_dim, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pos, mem, mem_pos):
        q = self.norm1(x)
        x = x + self.self_attn(q + pos, q + pos, q, need_weights=False)[0]
        q = self.norm2(x)
        x = x + self.cross_attn(q + pos, mem + mem_pos, mem, need_weights=False)[0]
        return x + self.mlp(self.norm3(x))


class MemoryAttention(nn.Module):
    def __init__(self, dim, mem_dim, layers):
        super().__init__()
        self.layers = nn.ModuleList([MemAttnLayer(dim, mem_dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, pos, mem, mem_pos):
        for layer in self.layers:
            x = layer(x, pos, mem, mem_pos)
        return self.norm(x)


class MaskDecoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up1 = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU())
        self.up2 = nn.Sequential(nn.Conv2d(dim, dim // 2, 3, padding=1), nn.GroupNorm(16, dim // 2), nn.GELU())
        self.head = nn.Conv2d(dim // 2, 1, 1)

    def forward(self, x, f8, f4, size):
        x = self.up1(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f8)
        x = self.up2(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f4)
        return F.interpolate(self.head(x), size=size, mode="bilinear", align_corners=False)


class SAM2Lite(nn.Module):
    def __init__(self, backbone, num_frames, mem_layers, grad_ckpt, dim=256, mem_dim=64):
        super().__init__()
        self.dim, self.mem_dim = dim, mem_dim
        self.image_encoder = ImageEncoder(backbone, dim)
        self.memory_encoder = MemoryEncoder(dim, mem_dim)
        self.memory_attention = MemoryAttention(dim, mem_dim, mem_layers)
        self.mask_decoder = MaskDecoder(dim)
        self.mem_tpos = nn.Parameter(torch.zeros(num_frames, 1, mem_dim, 1, 1))
        self.grad_ckpt = grad_ckpt

    def _read_memory(self, f16, mem_list):
        n, c, h, w = f16.shape
        pos = sine_pos(h, w, c, f16.device).unsqueeze(0)
        mem = torch.stack(mem_list, 0)
        t = mem.shape[0]
        mem = mem + self.mem_tpos[:t]
        mem = mem.permute(1, 0, 3, 4, 2).reshape(n, t * h * w, self.mem_dim)
        mem_pos = sine_pos(h, w, self.mem_dim, f16.device).repeat(t, 1).unsqueeze(0)
        x = f16.flatten(2).transpose(1, 2)
        if self.grad_ckpt and self.training:
            x = checkpoint(self.memory_attention, x, pos, mem, mem_pos, use_reentrant=True)
        else:
            x = self.memory_attention(x, pos, mem, mem_pos)
        return x.transpose(1, 2).reshape(n, c, h, w)

    def track_step(self, f4, f8, f16, mem_list, size):
        x = self._read_memory(f16, mem_list)
        return self.mask_decoder(x, f8, f4, size)

    def forward(self, frames, first_masks):
        B, T, _, H, W = frames.shape
        K = first_masks.shape[1]

        def per_obj(f):
            f = f.view(B, T, *f.shape[1:]).unsqueeze(2).expand(-1, -1, K, -1, -1, -1)
            return f.transpose(0, 1).reshape(T, B * K, *f.shape[3:])

        f4, f8, f16 = (per_obj(f) for f in self.image_encoder(frames.flatten(0, 1)))
        m0 = first_masks.flatten(0, 1).unsqueeze(1)
        mem_list = [self.memory_encoder(f16[0], m0 * 20.0 - 10.0)]
        outs = []
        for t in range(1, T):
            logit = self.track_step(f4[t], f8[t], f16[t], mem_list, (H, W))
            outs.append(logit)
            if t < T - 1:
                mem_list.append(self.memory_encoder(f16[t], logit))
        return torch.stack(outs, 1).view(B, K, T - 1, H, W)


def vos_loss(logits, gt, valid):
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean(dim=(-1, -2))
    p, g = logits.sigmoid().flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    per_obj = (bce + dice).mean(-1)
    w = valid.float()
    return (per_obj * w).sum() / w.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- eval
def load_davis_video(root, vid, size=(480, 864)):
    fdir = os.path.join(root, "JPEGImages", "480p", vid)
    adir = os.path.join(root, "Annotations", "480p", vid)
    names = sorted(os.listdir(fdir))
    frames, gts = [], []
    for n in names:
        img = Image.open(os.path.join(fdir, n)).convert("RGB").resize(size[::-1], Image.BILINEAR)
        frames.append((torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD)
        ann = Image.open(os.path.join(adir, n[:-4] + ".png")).resize(size[::-1], Image.NEAREST)
        gts.append(torch.from_numpy(np.asarray(ann, dtype=np.int64)))
    return torch.stack(frames), torch.stack(gts)


@torch.no_grad()
def segment_video(net, frames, first, num_obj, mem_every, max_mem):
    T, _, H, W = frames.shape
    obj = torch.stack([(first == k + 1).float() for k in range(num_obj)]).unsqueeze(1)
    f4, f8, f16 = net.image_encoder(frames[:1])
    first_mem = net.memory_encoder(f16.expand(num_obj, -1, -1, -1), obj * 20.0 - 10.0)
    recent, preds = [], [first]
    for t in range(1, T):
        f4, f8, f16 = (f.expand(num_obj, -1, -1, -1) for f in net.image_encoder(frames[t:t + 1]))
        logit = net.track_step(f4, f8, f16, [first_mem] + recent, (H, W))
        prob = logit.sigmoid()[:, 0]
        preds.append(torch.where(prob.max(0).values > 0.5, prob.argmax(0) + 1, torch.zeros_like(first)))
        if t % mem_every == 0:
            recent = (recent + [net.memory_encoder(f16, logit)])[-(max_mem - 1):]
    return torch.stack(preds)


def evaluate(net, args, device, rank, world):
    with open(os.path.join(args.davis_root, "ImageSets", "2017", "val.txt")) as f:
        videos = [l.strip() for l in f if l.strip()]
    net.eval()
    j_sum, n_obj = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for vid in videos[rank::world]:
        frames, gts = (x.to(device) for x in load_davis_video(args.davis_root, vid))
        num_obj = int(gts[0].max())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = segment_video(net, frames, gts[0], num_obj, args.mem_every, args.max_mem)
        for k in range(1, num_obj + 1):
            g, p = gts[1:-1] == k, pred[1:-1] == k
            inter = (g & p).flatten(1).sum(1).float()
            union = (g | p).flatten(1).sum(1).float()
            j_sum += torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union)).mean()
            n_obj += 1
    dist.all_reduce(j_sum)
    dist.all_reduce(n_obj)
    net.train()
    return (j_sum / n_obj).item()


# ----------------------------------------------------------------------------- main
def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = SAM2Lite(args.backbone, args.num_frames, args.mem_layers, args.grad_ckpt).to(device)
    enc_params = list(model.image_encoder.parameters())
    enc_ids = {id(p) for p in enc_params}
    rest = [p for p in model.parameters() if id(p) not in enc_ids]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": args.lr * args.encoder_lr_mult},
        {"params": rest, "lr": args.lr}], weight_decay=args.weight_decay)

    dataset = YTVOSClips(args.data_root, args.num_frames, args.max_objects, args.max_skip, args.resolution)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[args.lr * args.encoder_lr_mult, args.lr], total_steps=total_steps, pct_start=0.05)

    start_epoch, best_j = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        for name in ("image_encoder", "memory_encoder", "memory_attention", "mask_decoder"):
            getattr(model, name).load_state_dict(ckpt[name])
        model.mem_tpos.data.copy_(ckpt["mem_tpos"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_j = ckpt["epoch"] + 1, ckpt.get("best_j", 0.0)

    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        log.info("%d training videos, %d steps/epoch, world size %d", len(dataset), len(loader), world)

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for frames, masks, valid in loader:
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(frames, masks[:, 0])
            gt = masks[:, 1:].transpose(1, 2)
            loss = vos_loss(logits.float(), gt, valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[-1], step)
                log.info("ep %d step %d loss %.4f (%.1fs)", epoch, step, loss.item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            j = evaluate(model, args, device, rank, world)
            if rank == 0:
                writer.add_scalar("val/J", j, step)
                log.info("epoch %d DAVIS17 val J %.4f", epoch, j)
                state = {name: getattr(model, name).state_dict() for name in
                         ("image_encoder", "memory_encoder", "memory_attention", "mask_decoder")}
                state.update(mem_tpos=model.mem_tpos.detach().cpu(), optimizer=optimizer.state_dict(),
                             scheduler=scheduler.state_dict(), epoch=epoch, best_j=max(best_j, j))
                torch.save(state, os.path.join(args.output, "last.pth"))
                if j > best_j:
                    torch.save(state, os.path.join(args.output, "best.pth"))
            best_j = max(best_j, j)
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
