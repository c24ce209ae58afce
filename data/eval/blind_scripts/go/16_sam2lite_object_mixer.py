"""SAM2-lite fine-tuning with an object-mixer block that lets the objects of a video exchange information
(helps with distractors of the same class). One clip per GPU, all annotated objects of the clip are used.

    torchrun --nproc_per_node=8 16_sam2lite_object_mixer.py --data /data/ytvos/train --val /data/DAVIS/2017/trainval
"""
import argparse
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

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ytvos/train")
    p.add_argument("--val", default="/data/DAVIS/2017/trainval")
    p.add_argument("--out", default="runs/objmixer")
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--res", type=int, default=480)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--max-objects", type=int, default=5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=5)
    return p.parse_args()


class VideoClips(Dataset):
    def __init__(self, root, frames, max_objects, res):
        self.root, self.T, self.K, self.res = root, frames, max_objects, res
        self.vids = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations", v)))
            if len(names) >= frames:
                self.vids.append((v, names))

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        v, names = self.vids[i]
        r = self.res
        for _ in range(8):
            s = random.randint(0, len(names) - self.T)
            idx = sorted(random.sample(range(s, min(len(names), s + 2 * self.T)), self.T))
            imgs = [Image.open(os.path.join(self.root, "JPEGImages", v, names[j] + ".jpg")).convert("RGB") for j in idx]
            anns = [Image.open(os.path.join(self.root, "Annotations", v, names[j] + ".png")) for j in idx]
            w, h = imgs[0].size
            sc = r / min(w, h) * random.uniform(1.0, 1.3)
            nw, nh = max(r, round(w * sc)), max(r, round(h * sc))
            x0, y0 = random.randint(0, nw - r), random.randint(0, nh - r)
            box = (x0, y0, x0 + r, y0 + r)
            lab = np.stack([np.asarray(a.resize((nw, nh), Image.NEAREST).crop(box)) for a in anns])
            ids = [o for o in np.unique(lab[0]) if o not in (0, 255)]
            if ids:
                break
        rgb = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32) / 255.0)
                            .permute(2, 0, 1) - MEAN) / STD for im in imgs])
        ids = random.sample(ids, min(len(ids), self.K))
        masks = torch.stack([torch.from_numpy(lab == o).float() for o in ids], 1)  # T, K, H, W
        return rgb, masks


def sine_pos(h, w, dim, device):
    y, x = torch.meshgrid(torch.arange(h, device=device).float(), torch.arange(w, device=device).float(), indexing="ij")
    om = 1.0 / 10000 ** (torch.arange(dim // 4, device=device).float() / (dim // 4))
    y, x = y.flatten()[:, None] * om, x.flatten()[:, None] * om
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], 1)


class MemBlock(nn.Module):
    def __init__(self, dim, mem_dim):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.sa = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.ca = nn.MultiheadAttention(dim, 8, kdim=mem_dim, vdim=mem_dim, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pos, mem, mpos):
        q = self.n1(x)
        x = x + self.sa(q + pos, q + pos, q, need_weights=False)[0]
        x = x + self.ca(self.n2(x) + pos, mem + mpos, mem, need_weights=False)[0]
        return x + self.mlp(self.n3(x))


class ObjectMixer(nn.Module):
    """Attention across the objects of one frame, per spatial location (on a pooled grid)."""

    def __init__(self, dim, pool=4):
        super().__init__()
        self.pool = pool
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.out = nn.Linear(dim, dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        # x: K, C, h, w  (all objects of the same frame)
        K, C, h, w = x.shape
        p = F.avg_pool2d(x, self.pool)
        tok = self.norm(p.flatten(2).permute(2, 0, 1))  # hw', K, C
        mixed = self.out(self.attn(tok, tok, tok, need_weights=False)[0])
        mixed = mixed.permute(1, 2, 0).reshape(K, C, h // self.pool, w // self.pool)
        return x + F.interpolate(mixed, size=(h, w), mode="nearest")


class Tracker(nn.Module):
    def __init__(self, backbone, dim=256, mem_dim=64, layers=4):
        super().__init__()
        self.dim, self.mem_dim = dim, mem_dim
        self.trunk = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        self.neck = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in self.trunk.feature_info.channels()])
        self.mask_down = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1), nn.GELU(), nn.Conv2d(16, 64, 3, 2, 1), nn.GELU(),
                                       nn.Conv2d(64, 128, 3, 2, 1), nn.GELU(), nn.Conv2d(128, dim, 3, 2, 1))
        self.mem_fuse = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(),
                                      nn.Conv2d(dim, mem_dim, 1))
        self.blocks = nn.ModuleList([MemBlock(dim, mem_dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.object_mixer = ObjectMixer(dim)
        self.up1 = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU())
        self.up2 = nn.Sequential(nn.Conv2d(dim, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.head = nn.Conv2d(64, 1, 1)

    def image_features(self, x):
        return [n(f) for n, f in zip(self.neck, self.trunk(x))]

    def encode_memory(self, f16, prob):
        return self.mem_fuse(f16 + self.mask_down(prob))

    def decode(self, f4, f8, f16, mems, size):
        K, c, h, w = f16.shape
        t = len(mems)
        mem = torch.stack(mems, 1).permute(0, 1, 3, 4, 2).reshape(K, t * h * w, self.mem_dim)
        pos = sine_pos(h, w, c, f16.device)[None]
        mpos = sine_pos(h, w, self.mem_dim, f16.device).repeat(t, 1)[None]
        x = f16.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x, pos, mem, mpos)
        x = self.norm(x).transpose(1, 2).reshape(K, c, h, w)
        if K > 1:
            x = self.object_mixer(x)
        x = self.up1(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f8)
        x = self.up2(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f4)
        return F.interpolate(self.head(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, masks):
        # rgb: T,3,H,W ; masks: T,K,H,W  (one clip)
        T, _, H, W = rgb.shape
        K = masks.shape[1]
        f4, f8, f16 = (f.unsqueeze(1).expand(-1, K, -1, -1, -1) for f in self.image_features(rgb))
        mems = [self.encode_memory(f16[0], masks[0][:, None])]
        outs = []
        for t in range(1, T):
            logit = self.decode(f4[t], f8[t], f16[t], mems, (H, W))
            outs.append(logit[:, 0])
            if t < T - 1:
                mems.append(self.encode_memory(f16[t], torch.sigmoid(logit)))
        return torch.stack(outs, 0)  # T-1, K, H, W


def clip_loss(logits, gt):
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2))
    p, g = logits.sigmoid().flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    return (bce + dice).mean()


@torch.no_grad()
def evaluate(net, root, device, rank, world, mem_every=5, max_mem=7):
    vids = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(2, device=device)
    net.eval()
    for v in vids[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations/480p", v)))
        gts = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", v, n + ".png"))
                                                    .resize((864, 480), Image.NEAREST)) for n in names]).astype(np.int64)).to(device)
        K = int(gts[0].max())
        mems, preds = [], [gts[0]]
        for t, n in enumerate(names):
            im = Image.open(os.path.join(root, "JPEGImages/480p", v, n + ".jpg")).convert("RGB").resize((864, 480))
            x = ((torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD)[None].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                f4, f8, f16 = (f.expand(K, -1, -1, -1) for f in net.image_features(x))
                if t == 0:
                    prob = torch.stack([(gts[0] == k + 1).float() for k in range(K)])[:, None]
                else:
                    prob = torch.sigmoid(net.decode(f4, f8, f16, mems, (480, 864)).float())
                    preds.append(torch.where(prob[:, 0].max(0).values > 0.5, prob[:, 0].argmax(0) + 1, 0))
                if t % mem_every == 0:
                    mems = mems[:1] + mems[1:][-(max_mem - 2):] + [net.encode_memory(f16, prob)]
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
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    net = Tracker(args.backbone).to(device)
    model = DDP(net, device_ids=[local_rank])
    trunk = {id(p) for p in net.trunk.parameters()}
    opt = torch.optim.AdamW([{"params": [p for p in net.parameters() if id(p) in trunk], "lr": args.lr * 0.1},
                             {"params": [p for p in net.parameters() if id(p) not in trunk]}], lr=args.lr, weight_decay=0.05)
    ds = VideoClips(args.data, args.frames, args.max_objects, args.res)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    # one clip per step; clips have different numbers of objects, so no collation
    loader = DataLoader(ds, batch_size=None, sampler=sampler, num_workers=args.workers, pin_memory=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    tb = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for rgb, masks in loader:
            rgb, masks = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, masks)
            loss = clip_loss(logits.float(), masks[1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/objects", masks.shape[1], step)
                print(f"ep {epoch} step {step} loss {loss.item():.4f} ({(time.time() - tic) / 50:.2f}s/it)", flush=True)
                tic = time.time()
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            j = evaluate(net, args.val, device, rank, world)
            if rank == 0:
                tb.add_scalar("val/J", j, step)
                print(f"epoch {epoch}: DAVIS-17 val J {j:.4f}", flush=True)
                torch.save({"image_encoder": {k: v for k, v in net.state_dict().items() if k.startswith(("trunk.", "neck."))},
                            "memory": {k: v for k, v in net.state_dict().items() if not k.startswith(("trunk.", "neck."))},
                            "optimizer": opt.state_dict(), "epoch": epoch}, os.path.join(args.out, f"ep{epoch:02d}.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
