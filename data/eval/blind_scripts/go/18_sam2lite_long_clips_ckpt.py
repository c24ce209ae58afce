#!/usr/bin/env python3
"""SAM2-style memory fine-tuning on MOSE with activation checkpointing of the memory attention.

Memory attention runs once per tracked frame, so checkpointing it saves most of the activation memory
for long training clips (16 frames at 480p).

    torchrun --nproc_per_node=8 18_sam2lite_long_clips_ckpt.py --mose /data/MOSE/train --init sam2lite_ytvos.pth
"""
import argparse
import json
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mose", default="/data/MOSE/train")
    p.add_argument("--davis-root", default="/data/DAVIS/2017/trainval")
    p.add_argument("--cache", default="/shared/cache/mose_index.json")
    p.add_argument("--init", default="")
    p.add_argument("--output", default="/shared/runs/sam2lite_mose_long")
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--resolution", type=int, default=480)
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--mem-layers", type=int, default=4)
    p.add_argument("--mem-every", type=int, default=5)
    p.add_argument("--max-mem", type=int, default=7)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    return p.parse_args()


def build_index(root, min_frames):
    ann = os.path.join(root, "Annotations")
    index = {}
    for v in sorted(os.listdir(ann)):
        names = sorted(n[:-4] for n in os.listdir(os.path.join(ann, v)))
        if len(names) >= min_frames:
            first = np.asarray(Image.open(os.path.join(ann, v, names[0] + ".png")))
            index[v] = {"frames": names, "objects": [int(o) for o in np.unique(first) if o not in (0, 255)]}
    return index


class MOSEClips(Dataset):
    def __init__(self, root, index, args):
        self.root, self.a = root, args
        self.items = [(v, d["frames"]) for v, d in sorted(index.items()) if d["objects"]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        v, names = self.items[i]
        a, r = self.a, self.a.resolution
        for _ in range(8):
            s = random.randint(0, len(names) - a.num_frames)
            idx = sorted(random.sample(range(s, min(len(names), s + 2 * a.num_frames)), a.num_frames))
            imgs = [Image.open(os.path.join(self.root, "JPEGImages", v, names[j] + ".jpg")).convert("RGB") for j in idx]
            anns = [Image.open(os.path.join(self.root, "Annotations", v, names[j] + ".png")) for j in idx]
            w, h = imgs[0].size
            sc = r / min(w, h) * random.uniform(1.0, 1.25)
            nw, nh = max(r, round(w * sc)), max(r, round(h * sc))
            x0, y0 = random.randint(0, nw - r), random.randint(0, nh - r)
            box = (x0, y0, x0 + r, y0 + r)
            lab = np.stack([np.asarray(m.resize((nw, nh), Image.NEAREST).crop(box)) for m in anns])
            ids = [o for o in np.unique(lab[0]) if o not in (0, 255)]
            if ids:
                break
        frames = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32)
                                                / 255.0).permute(2, 0, 1) - MEAN) / STD for im in imgs])
        ids = random.sample(ids, min(len(ids), a.max_objects))
        obj = torch.zeros(a.num_frames, a.max_objects, r, r)
        valid = torch.zeros(a.max_objects, dtype=torch.bool)
        for k, o in enumerate(ids):
            obj[:, k] = torch.from_numpy(lab == o).float()
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
    local = {}
    for vid in videos[rank::world]:
        frames, gts = (x.to(device) for x in load_davis_video(args.davis_root, vid))
        num_obj = int(gts[0].max())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = segment_video(net, frames, gts[0], num_obj, args.mem_every, args.max_mem)
        per_obj = []
        for k in range(1, num_obj + 1):
            g, p = gts[1:-1] == k, pred[1:-1] == k
            inter, union = (g & p).flatten(1).sum(1).float(), (g | p).flatten(1).sum(1).float()
            per_obj.append(torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union)).mean().item())
        local[vid] = per_obj
    net.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return float(np.mean([j for v in merged.values() for j in v])), merged


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    # annotation index: built once by rank 0, written atomically, read by everyone after the barrier
    if rank == 0 and not os.path.exists(args.cache):
        os.makedirs(os.path.dirname(args.cache), exist_ok=True)
        tmp = f"{args.cache}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(build_index(args.mose, args.num_frames), f)
        os.replace(tmp, args.cache)
    dist.barrier()
    with open(args.cache) as f:
        index = json.load(f)

    model = SAM2Lite(args.backbone, args.num_frames, args.mem_layers, args.grad_ckpt).to(device)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("model", sd)
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()})
    # fixed clip length -> the same modules run the same number of times every step
    ddp = DDP(model, device_ids=[local_rank], static_graph=args.grad_ckpt)
    enc = {id(p) for p in model.image_encoder.parameters()}
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if id(p) in enc], "lr": args.lr * 0.1},
                                   {"params": [p for p in model.parameters() if id(p) not in enc]}],
                                  lr=args.lr, weight_decay=0.05)
    dataset = MOSEClips(args.mose, index, args)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        wandb.init(project="sam2lite-mose", config=vars(args), dir=args.output)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for frames, masks, valid in loader:
            frames, masks, valid = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(frames, masks[:, 0])
            loss = vos_loss(logits.float(), masks[:, 1:].transpose(1, 2), valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[-1],
                           "train/it_per_s": 50 / (time.time() - t0)}, step=step)
                t0 = time.time()

        j, per_video = evaluate(model, args, device, rank, world)
        if rank == 0:
            wandb.log({"val/J": j, "val/worst_video_J": min(np.mean(v) for v in per_video.values())}, step=step)
            state = {"image_encoder": model.image_encoder.state_dict(),
                     "memory": {k: v for k, v in model.state_dict().items() if not k.startswith("image_encoder.")},
                     "optimizer": optimizer.state_dict(), "epoch": epoch, "J": j}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if j > best:
                torch.save(state, os.path.join(args.output, "best.pth"))
                with open(os.path.join(args.output, "best_per_video.json"), "w") as f:
                    json.dump(per_video, f, indent=1)
        best = max(best, j)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
