"""DeAOT-style fine-tuning on YouTube-VOS 2019, resumable from periodic checkpoints.

    torchrun --nproc_per_node=8 17_deaot_ytvos_resumable.py --out /shared/deaot_ytvos19
    torchrun --nproc_per_node=8 17_deaot_ytvos_resumable.py --out /shared/deaot_ytvos19 --resume /shared/deaot_ytvos19/ckpt_40000.pth
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
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ytvos", default="/data/YTB/2019/train")
    ap.add_argument("--davis", default="/data/DAVIS/2017/trainval")
    ap.add_argument("--out", default="/shared/deaot_ytvos19")
    ap.add_argument("--resume", default="")
    ap.add_argument("--backbone", default="convnext_small.fb_in22k")
    ap.add_argument("--max-obj", type=int, default=10)
    ap.add_argument("--gp-layers", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=5)
    ap.add_argument("--crop", type=int, default=448)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--save-every", type=int, default=10000)
    ap.add_argument("--eval-every", type=int, default=10000)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def load_rgb(path):
    x = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32)).permute(2, 0, 1)


class YTVOSMeta(Dataset):
    """Uses meta.json so that clips start on a frame where at least one object is annotated."""

    def __init__(self, root, args):
        self.root, self.a = root, args
        meta = json.load(open(os.path.join(root, "meta.json")))["videos"]
        self.items = []
        for vid, info in sorted(meta.items()):
            frames = sorted({f for o in info["objects"].values() for f in o["frames"]})
            if len(frames) >= args.seq_len:
                self.items.append((vid, frames))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, frames = self.items[i]
        a = self.a
        ref = random.randint(0, len(frames) - a.seq_len)
        rest = sorted(random.sample(range(ref + 1, min(len(frames), ref + 1 + 3 * a.seq_len)), a.seq_len - 1))
        idx = [ref] + rest
        rgb = torch.stack([load_rgb(os.path.join(self.root, "JPEGImages", vid, frames[j] + ".jpg")) for j in idx])
        lab = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(self.root, "Annotations", vid, frames[j] + ".png")))
                                         for j in idx]).astype(np.int64))
        H, W = lab.shape[-2:]
        s = a.crop / min(H, W) * random.uniform(1.0, 1.3)
        nh, nw = max(a.crop, int(H * s)), max(a.crop, int(W * s))
        rgb = F.interpolate(rgb, size=(nh, nw), mode="bilinear", align_corners=False)
        lab = F.interpolate(lab[:, None].float(), size=(nh, nw), mode="nearest")[:, 0].long()
        y, x = random.randint(0, nh - a.crop), random.randint(0, nw - a.crop)
        rgb, lab = rgb[..., y:y + a.crop, x:x + a.crop], lab[..., y:y + a.crop, x:x + a.crop]
        ids = [o for o in lab[0].unique().tolist() if o not in (0, 255)]
        random.shuffle(ids)
        out = torch.zeros_like(lab)
        for n, o in enumerate(ids[: a.max_obj], start=1):
            out[lab == o] = n
        return rgb, out, min(len(ids), a.max_obj)


class GatedPropagation(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.norm_self, self.norm_long, self.norm_short, self.norm_ff = (nn.LayerNorm(d) for _ in range(4))
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.long_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.short_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.gate = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pos, lk, lv, sk, sv):
        q = self.norm_self(x) + pos
        x = x + self.self_attn(q, q, self.norm_self(x), need_weights=False)[0]
        g = torch.sigmoid(self.gate(x))
        x = x + g * self.long_attn(self.norm_long(x) + pos, lk, lv, need_weights=False)[0]
        x = x + g * self.short_attn(self.norm_short(x) + pos, sk, sv, need_weights=False)[0]
        return x + self.ff(self.norm_ff(x))


class DeAOT(nn.Module):
    def __init__(self, cfg, d=256):
        super().__init__()
        self.max_obj = cfg.max_obj
        self.backbone = timm.create_model(cfg.backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        c4, c8, c16 = self.backbone.feature_info.channels()
        self.proj = nn.Conv2d(c16, d, 1)
        self.id_bank = nn.Conv2d(cfg.max_obj + 1, d, 17, 16, 8)
        self.pos = nn.Parameter(torch.randn(1, d, 32, 32) * 0.02)
        self.layers = nn.ModuleList([GatedPropagation(d) for _ in range(cfg.gp_layers)])
        self.lat8, self.lat4 = nn.Conv2d(c8, 128, 1), nn.Conv2d(c4, 64, 1)
        self.dec16 = nn.Sequential(nn.Conv2d(d, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.GELU())
        self.dec8 = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.cls = nn.Conv2d(64, cfg.max_obj + 1, 3, padding=1)

    def encode(self, x):
        f4, f8, f16 = self.backbone(x)
        return self.proj(f16), self.lat8(f8), self.lat4(f4)

    def kv(self, x16, prob):
        return x16.flatten(2).transpose(1, 2), (x16 + self.id_bank(prob)).flatten(2).transpose(1, 2)

    def decode(self, x16, f8, f4, lk, lv, sk, sv, size):
        n, d, h, w = x16.shape
        pos = F.interpolate(self.pos, size=(h, w), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
        x = x16.flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pos, lk, lv, sk, sv)
        x = self.dec16(x.transpose(1, 2).reshape(n, d, h, w))
        x = self.dec8(F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False) + f8)
        x = F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False) + f4
        return F.interpolate(self.cls(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, lab, n_obj):
        B, T, _, H, W = rgb.shape
        x16, f8, f4 = (z.view(B, T, *z.shape[1:]) for z in self.encode(rgb.flatten(0, 1)))
        keep = torch.arange(self.max_obj + 1, device=rgb.device)[None] <= n_obj[:, None]
        lk, lv = self.kv(x16[:, 0], F.one_hot(lab[:, 0], self.max_obj + 1).permute(0, 3, 1, 2).float())
        sk, sv = lk, lv
        outs = []
        for t in range(1, T):
            logits = self.decode(x16[:, t], f8[:, t], f4[:, t], lk, lv, sk, sv, (H, W))
            logits = logits.masked_fill(~keep[:, :, None, None], -1e4)
            outs.append(logits)
            sk, sv = self.kv(x16[:, t], logits.softmax(1))
        return torch.stack(outs, 1)


def loss_fn(logits, lab, n_obj):
    C = logits.shape[2]
    ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(0, 1))
    prob = logits.softmax(2)
    oh = F.one_hot(lab, C).permute(0, 1, 4, 2, 3).float()
    inter, union = (prob * oh).flatten(3).sum(-1), (prob + oh - prob * oh).flatten(3).sum(-1)
    obj = (torch.arange(1, C, device=lab.device)[None] <= n_obj[:, None]).float()[:, None]
    jac = ((1 - (inter[:, :, 1:] + 1) / (union[:, :, 1:] + 1)) * obj).sum() / (obj.sum() * logits.shape[1]).clamp(min=1)
    return ce + jac


@torch.no_grad()
def evaluate(net, root, device, rank, world, mem_every=5):
    vids = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(2, device=device)
    net.eval()
    for v in vids[rank::world]:
        names = sorted(f[:-4] for f in os.listdir(os.path.join(root, "JPEGImages/480p", v)))
        gts = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", v, n + ".png")))
                                         for n in names]).astype(np.int64)).to(device)
        K, (H, W) = int(gts[0].max()), gts.shape[1:]
        pad = (0, (-W) % 32, 0, (-H) % 32)
        lk, lv, short, preds = [], [], None, [gts[0]]
        for t, n in enumerate(names):
            img = F.pad(load_rgb(os.path.join(root, "JPEGImages/480p", v, n + ".jpg"))[None].to(device), pad)
            x16, f8, f4 = net.encode(img)
            if t == 0:
                prob = F.pad(F.one_hot(gts[0], net.max_obj + 1).permute(2, 0, 1)[None].float(), pad)
            else:
                logits = net.decode(x16, f8, f4, torch.cat(lk, 1), torch.cat(lv, 1), *short, img.shape[-2:])
                logits[:, K + 1:] = -1e4
                prob = logits.softmax(1)
                preds.append(prob[0, :, :H, :W].argmax(0))
            short = net.kv(x16, prob)
            if t % mem_every == 0:
                lk.append(short[0])
                lv.append(short[1])
        pred = torch.stack(preds)
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).flatten(1).sum(1).float()
            acc[0] += torch.where(u > 0, (p & g).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean()
            acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)
    random.seed(1 + rank)

    net = DeAOT(args).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.07)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2000) * (1 - s / args.steps) ** 0.9)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
    model = DDP(net, device_ids=[local_rank])

    data = YTVOSMeta(args.ytvos, args)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(data)} videos, {len(loader)} steps/epoch, starting at step {step}", flush=True)

    epoch = step // len(loader)
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for rgb, lab, n_obj in loader:
            rgb, lab, n_obj = rgb.to(device, non_blocking=True), lab.to(device, non_blocking=True), n_obj.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, lab, n_obj)
            loss = loss_fn(logits.float(), lab[:, 1:], n_obj)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"step {step} loss {loss.item():.4f} {(time.time() - tic) / 50:.2f}s/it", flush=True)
                tic = time.time()
            if step % args.eval_every == 0:
                j = evaluate(net, args.davis, device, rank, world)
                if tb is not None:
                    tb.add_scalar("val/davis17_J", j, step)
                    print(f"step {step}: DAVIS-17 val J {j:.4f}", flush=True)
            if rank == 0 and step % args.save_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step},
                           os.path.join(args.out, f"ckpt_{step}.pth"))
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"backbone": net.backbone.state_dict(),
                    "propagation": {k: v for k, v in net.state_dict().items() if not k.startswith("backbone.")}},
                   os.path.join(args.out, "final_weights.pth"))
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
