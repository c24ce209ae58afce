"""ViT (MAE-pretrained) memory tracker: SAM-like mask decoder + memory cross-attention.

Fine-tunes on YouTube-VOS-style clips with up to --max-objects objects per clip.

    torchrun --nnodes=1 --nproc_per_node=8 09_vit_memory_tracker.py --train /data/ytvos/train \
        --val /data/DAVIS/2017/trainval --out /ckpt/vit_tracker
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
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PIX_MEAN = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
PIX_STD = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="/data/ytvos/train")
    ap.add_argument("--val", default="/data/DAVIS/2017/trainval")
    ap.add_argument("--out", default="/ckpt/vit_tracker")
    ap.add_argument("--encoder", default="vit_base_patch16_224.mae")
    ap.add_argument("--img-size", type=int, default=512)
    ap.add_argument("--clip-len", type=int, default=6)
    ap.add_argument("--max-objects", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--encoder-lr", type=float, default=1e-5)
    ap.add_argument("--layer-decay", type=float, default=0.8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-interval", type=int, default=4)
    return ap.parse_args()


class ClipSet(Dataset):
    def __init__(self, root, clip_len, max_objects, img_size):
        self.root, self.L, self.K, self.S = root, clip_len, max_objects, img_size
        self.vids = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            frames = sorted(f[:-4] for f in os.listdir(os.path.join(root, "Annotations", v)))
            if len(frames) >= clip_len:
                self.vids.append((v, frames))

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        vid, frames = self.vids[i]
        start = random.randint(0, len(frames) - self.L)
        idx = sorted(random.sample(range(start, min(len(frames), start + 2 * self.L)), self.L))
        ims = [Image.open(os.path.join(self.root, "JPEGImages", vid, frames[j] + ".jpg")).convert("RGB") for j in idx]
        ans = [Image.open(os.path.join(self.root, "Annotations", vid, frames[j] + ".png")) for j in idx]
        S = self.S
        w, h = ims[0].size
        s = S / min(w, h) * random.uniform(1.0, 1.6)
        nw, nh = max(S, int(w * s)), max(S, int(h * s))
        x, y = random.randint(0, nw - S), random.randint(0, nh - S)
        rgb = torch.stack([torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR), dtype=np.float32)[y:y + S, x:x + S])
                           .permute(2, 0, 1) for im in ims])
        rgb = (rgb - PIX_MEAN) / PIX_STD
        lab = torch.from_numpy(np.stack([np.asarray(a.resize((nw, nh), Image.NEAREST))[y:y + S, x:x + S] for a in ans]).astype(np.int64))
        full0 = np.unique(np.asarray(ans[0]))
        ids = [int(o) for o in full0 if o not in (0, 255)]
        random.shuffle(ids)
        ids = ids[: self.K]
        masks = torch.zeros(self.L, self.K, S, S)
        valid = torch.zeros(self.K, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = (lab == o).float()
            valid[k] = masks[0, k].sum() >= 16
        return rgb, masks, valid


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CrossAttnBlock(nn.Module):
    def __init__(self, dim, mem_dim, heads=8):
        super().__init__()
        self.norm_q, self.norm_ff = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, kdim=mem_dim, vdim=mem_dim, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x, mem):
        x = x + self.attn(self.norm_q(x), mem, mem, need_weights=False)[0]
        return x + self.ff(self.norm_ff(x))


class ViTTracker(nn.Module):
    def __init__(self, encoder_name, img_size, dim=256, mem_dim=64, n_mem_layers=2):
        super().__init__()
        self.encoder = timm.create_model(encoder_name, pretrained=True, img_size=img_size, dynamic_img_size=True,
                                         num_classes=0, global_pool="")
        self.neck = nn.Sequential(nn.Conv2d(self.encoder.embed_dim, dim, 1, bias=False), LayerNorm2d(dim),
                                  nn.Conv2d(dim, dim, 3, padding=1, bias=False), LayerNorm2d(dim))
        self.mask_down = nn.Sequential(nn.Conv2d(1, 16, 4, 4), LayerNorm2d(16), nn.GELU(), nn.Conv2d(16, dim, 4, 4))
        self.mem_proj = nn.Conv2d(dim, mem_dim, 1)
        self.mem_pos = nn.Parameter(torch.zeros(1, 32 * 32, mem_dim))
        self.mem_layers = nn.ModuleList([CrossAttnBlock(dim, mem_dim) for _ in range(n_mem_layers)])
        self.upscale = nn.Sequential(nn.ConvTranspose2d(dim, 64, 2, 2), LayerNorm2d(64), nn.GELU(),
                                     nn.ConvTranspose2d(64, 32, 2, 2), nn.GELU(), nn.Conv2d(32, 1, 1))
        nn.init.trunc_normal_(self.mem_pos, std=0.02)

    def embed(self, x):
        tok = self.encoder.forward_features(x)[:, self.encoder.num_prefix_tokens:]
        h, w = x.shape[-2] // 16, x.shape[-1] // 16
        return self.neck(tok.transpose(1, 2).reshape(x.shape[0], -1, h, w))

    def memorize(self, feat, prob):
        m = self.mem_proj(feat + self.mask_down(prob))
        pos = self.mem_pos if m.shape[-2] * m.shape[-1] == self.mem_pos.shape[1] else F.interpolate(
            self.mem_pos.transpose(1, 2).reshape(1, -1, 32, 32), size=m.shape[-2:], mode="bilinear").flatten(2).transpose(1, 2)
        return m.flatten(2).transpose(1, 2) + pos

    def decode(self, feat, memory, size):
        n, c, h, w = feat.shape
        x = feat.flatten(2).transpose(1, 2)
        for blk in self.mem_layers:
            x = blk(x, memory)
        x = x.transpose(1, 2).reshape(n, c, h, w)
        return F.interpolate(self.upscale(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, masks):
        B, T, _, H, W = rgb.shape
        K = masks.shape[2]
        feat = self.embed(rgb.flatten(0, 1))
        feat = feat.view(B, 1, T, *feat.shape[1:]).expand(-1, K, -1, -1, -1, -1).reshape(B * K, T, *feat.shape[1:])
        memory = [self.memorize(feat[:, 0], masks[:, 0].reshape(B * K, 1, H, W))]
        outs = []
        for t in range(1, T):
            logit = self.decode(feat[:, t], torch.cat(memory, 1), (H, W))
            outs.append(logit)
            if t < T - 1:
                memory.append(self.memorize(feat[:, t], torch.sigmoid(logit)))
        return torch.cat(outs, 1).view(B, K, T - 1, H, W)


def per_object_loss(logits, gt, valid):
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2)).mean(-1)
    p, g = torch.sigmoid(logits).flatten(2), gt.flatten(2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    per_obj = bce + dice
    return per_obj[valid].mean()


def param_groups(net, args):
    depth = len(net.encoder.blocks)
    groups = {}
    for n, p in net.named_parameters():
        if n.startswith("encoder."):
            layer = int(n.split(".")[2]) + 1 if n.startswith("encoder.blocks.") else (0 if "embed" in n or "cls" in n else depth)
            lr = args.encoder_lr * args.layer_decay ** (depth - layer)
        else:
            lr = args.lr
        wd = 0.0 if p.ndim == 1 or "pos" in n else 0.05
        groups.setdefault((lr, wd), []).append(p)
    return [{"params": ps, "lr": lr, "weight_decay": wd, "initial_lr": lr} for (lr, wd), ps in groups.items()]


@torch.no_grad()
def evaluate(net, args, device, rank, world):
    root = args.val
    vids = open(os.path.join(root, "ImageSets", "2017", "val.txt")).read().split()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    net.eval()
    for v in vids[rank::world]:
        names = sorted(f[:-4] for f in os.listdir(os.path.join(root, "JPEGImages", "480p", v)))
        gts = np.stack([np.asarray(Image.open(os.path.join(root, "Annotations", "480p", v, n + ".png"))) for n in names])
        K, (H, W) = int(gts[0].max()), gts.shape[1:]
        memory, preds = None, [gts[0]]
        for t, n in enumerate(names):
            im = Image.open(os.path.join(root, "JPEGImages", "480p", v, n + ".jpg")).convert("RGB").resize((896, 512))
            x = ((torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1) - PIX_MEAN) / PIX_STD)[None].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                feat = net.embed(x).expand(K, -1, -1, -1)
                if t == 0:
                    m0 = torch.from_numpy(np.stack([gts[0] == k + 1 for k in range(K)])).float()[:, None].to(device)
                    memory = [net.memorize(feat, F.interpolate(m0, size=(512, 896)))]
                    continue
                prob = torch.sigmoid(net.decode(feat, torch.cat(memory, 1), (512, 896)).float())
                if t % 5 == 0:
                    memory = memory[:1] + memory[1:][-5:] + [net.memorize(feat, prob)]
            prob = F.interpolate(prob, size=(H, W), mode="bilinear", align_corners=False)[:, 0]
            preds.append(torch.where(prob.max(0).values > 0.5, prob.argmax(0) + 1, 0).cpu().numpy())
        pred = np.stack(preds)
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).sum((1, 2))
            tot[0] += float(np.mean(np.where(u > 0, (p & g).sum((1, 2)) / np.maximum(u, 1), 1.0)))
            tot[1] += 1
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    net = ViTTracker(args.encoder, args.img_size).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(param_groups(net, args), betas=(0.9, 0.999))
    ds = ClipSet(args.train, args.clip_len, args.max_objects, args.img_size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 500) * 0.5 * (1 + np.cos(np.pi * s / total)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump(vars(args), open(os.path.join(args.out, "args.json"), "w"), indent=1)
    history = []

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for rgb, masks, valid in loader:
            rgb, masks, valid = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            if not valid.any():
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, masks)
            loss = per_object_loss(logits.float(), masks[:, 1:].transpose(1, 2), valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += 1
            if rank == 0 and seen % 50 == 0:
                print(f"[ep {epoch}] {seen}/{len(loader)} loss={loss.item():.4f} ({(time.time() - t0) / seen:.2f}s/it)", flush=True)

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            j = evaluate(net, args, device, rank, world)
            history.append({"epoch": epoch, "J": j})
            if rank == 0:
                print(f"epoch {epoch}: DAVIS17 val J {j:.4f}", flush=True)
                torch.save({"encoder": net.encoder.state_dict(),
                            "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("encoder.")},
                            "epoch": epoch, "optimizer": opt.state_dict()}, os.path.join(args.out, f"ep{epoch}.pt"))
                json.dump(history, open(os.path.join(args.out, "history.json"), "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
