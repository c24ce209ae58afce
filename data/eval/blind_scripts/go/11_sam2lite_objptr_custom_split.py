"""SAM2-lite with object pointers, fine-tuned on an in-house long-video VOS collection.

The collection has no official split: a fraction of the videos is held out for validation.

    torchrun --nproc_per_node=8 11_sam2lite_objptr_custom_split.py --root /mnt/data/wildlife_vos --val-frac 0.1
"""
import argparse
import logging
import os
import random

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

log = logging.getLogger("sam2lite")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/mnt/data/wildlife_vos")
    p.add_argument("--out", default="runs/wildlife_sam2lite")
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--res", type=int, default=512)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--max-objects", type=int, default=4)
    p.add_argument("--max-skip", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--mem-every", type=int, default=6)
    p.add_argument("--max-mem", type=int, default=7)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def read_frame(path, size=None):
    img = Image.open(path).convert("RGB")
    if size is not None:
        img = img.resize(size, Image.BILINEAR)
    return (torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD


class Clips(Dataset):
    def __init__(self, root, videos, args):
        self.root, self.videos, self.a = root, videos, args
        self.names = {v: sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations", v))) for v in videos}
        self.videos = [v for v in videos if len(self.names[v]) >= args.num_frames]

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        a, v = self.a, self.videos[i]
        names = self.names[v]
        for _ in range(6):
            idx = [random.randint(0, len(names) - a.num_frames)]
            for _ in range(a.num_frames - 1):
                idx.append(min(len(names) - 1, idx[-1] + random.randint(1, a.max_skip)))
            imgs = [Image.open(os.path.join(self.root, "JPEGImages", v, names[j] + ".jpg")).convert("RGB") for j in idx]
            anns = [Image.open(os.path.join(self.root, "Annotations", v, names[j] + ".png")) for j in idx]
            w, h = imgs[0].size
            s = a.res / min(w, h) * random.uniform(1.0, 1.4)
            nw, nh = max(a.res, round(w * s)), max(a.res, round(h * s))
            x0, y0 = random.randint(0, nw - a.res), random.randint(0, nh - a.res)
            box = (x0, y0, x0 + a.res, y0 + a.res)
            lab = np.stack([np.asarray(m.resize((nw, nh), Image.NEAREST).crop(box)) for m in anns])
            ids = [o for o in np.unique(lab[0]) if o not in (0, 255)]
            if ids:
                break
        rgb = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32)
                                             / 255.0).permute(2, 0, 1) - MEAN) / STD for im in imgs])
        ids = random.sample(ids, min(len(ids), a.max_objects))
        masks = torch.zeros(a.num_frames, a.max_objects, a.res, a.res)
        valid = torch.zeros(a.max_objects, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = torch.from_numpy(lab == o).float()
            valid[k] = True
        return rgb, masks, valid


def sine_pos(h, w, dim, device):
    y, x = torch.meshgrid(torch.arange(h, device=device).float(), torch.arange(w, device=device).float(), indexing="ij")
    om = 1.0 / 10000 ** (torch.arange(dim // 4, device=device).float() / (dim // 4))
    y, x = y.flatten()[:, None] * om, x.flatten()[:, None] * om
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], 1)


class Block(nn.Module):
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


class SAM2Lite(nn.Module):
    def __init__(self, backbone, dim=256, mem_dim=64, layers=4):
        super().__init__()
        self.dim, self.mem_dim = dim, mem_dim
        self.trunk = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        self.neck = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in self.trunk.feature_info.channels()])
        self.mask_down = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1), nn.GELU(), nn.Conv2d(16, 64, 3, 2, 1), nn.GELU(),
                                       nn.Conv2d(64, 128, 3, 2, 1), nn.GELU(), nn.Conv2d(128, dim, 3, 2, 1))
        self.mem_fuse = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(),
                                      nn.Conv2d(dim, mem_dim, 1))
        self.obj_ptr_proj = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, mem_dim))
        self.blocks = nn.ModuleList([Block(dim, mem_dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.up1 = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU())
        self.up2 = nn.Sequential(nn.Conv2d(dim, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.head = nn.Conv2d(64, 1, 1)

    def image_features(self, x):
        return [n(f) for n, f in zip(self.neck, self.trunk(x))]

    def encode_memory(self, f16, mask_logits):
        prob = torch.sigmoid(mask_logits)
        spatial = self.mem_fuse(f16 + self.mask_down(prob))
        pooled = F.adaptive_avg_pool2d(prob, f16.shape[-2:])
        ptr = (f16 * pooled).sum((-1, -2)) / pooled.sum((-1, -2)).clamp(min=1e-4)
        return spatial, self.obj_ptr_proj(ptr)

    def decode(self, f4, f8, f16, spatial_mem, ptr_mem, size):
        n, c, h, w = f16.shape
        pos = sine_pos(h, w, c, f16.device)[None]
        t = len(spatial_mem)
        mem = torch.stack(spatial_mem, 1).permute(0, 1, 3, 4, 2).reshape(n, t * h * w, self.mem_dim)
        mpos = sine_pos(h, w, self.mem_dim, f16.device).repeat(t, 1)[None]
        ptr = torch.stack(ptr_mem, 1)
        mem = torch.cat([mem, ptr], 1)
        mpos = torch.cat([mpos.expand(n, -1, -1), torch.zeros_like(ptr)], 1)
        x = f16.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x, pos, mem, mpos)
        x = self.norm(x).transpose(1, 2).reshape(n, c, h, w)
        x = self.up1(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f8)
        x = self.up2(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + f4)
        return F.interpolate(self.head(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, masks):
        B, T, _, H, W = rgb.shape
        K = masks.shape[2]
        f4, f8, f16 = (f.view(B, 1, T, *f.shape[1:]).expand(-1, K, -1, -1, -1, -1).reshape(B * K, T, *f.shape[1:])
                       for f in self.image_features(rgb.flatten(0, 1)))
        s, p = self.encode_memory(f16[:, 0], masks[:, 0].reshape(B * K, 1, H, W) * 20.0 - 10.0)
        spatial, ptrs, outs = [s], [p], []
        for t in range(1, T):
            logit = self.decode(f4[:, t], f8[:, t], f16[:, t], spatial, ptrs, (H, W))
            outs.append(logit)
            if t < T - 1:
                s, p = self.encode_memory(f16[:, t], logit)
                spatial.append(s)
                ptrs.append(p)
        return torch.cat(outs, 1).view(B, K, T - 1, H, W)


def criterion(logits, gt, valid):
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2))
    p, g = logits.sigmoid().flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    w = valid.float()[..., None]
    return ((bce + dice) * w).sum() / (w.sum() * logits.shape[2]).clamp(min=1)


@torch.no_grad()
def evaluate(net, root, videos, args, device, rank, world):
    acc = torch.zeros(2, device=device)
    net.eval()
    for v in videos[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations", v)))
        gts = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(root, "Annotations", v, n + ".png")).resize((896, 512), Image.NEAREST))
                                         for n in names]).astype(np.int64)).to(device)
        ids = [o for o in gts[0].unique().tolist() if o not in (0, 255)]
        K = len(ids)
        if K == 0:
            continue
        spatial, ptrs, preds = [], [], [gts[0]]
        for t, n in enumerate(names):
            x = read_frame(os.path.join(root, "JPEGImages", v, n + ".jpg"), (896, 512))[None].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                f4, f8, f16 = (f.expand(K, -1, -1, -1) for f in net.image_features(x))
                if t == 0:
                    logit = torch.stack([(gts[0] == o).float() for o in ids])[:, None] * 20.0 - 10.0
                else:
                    logit = net.decode(f4, f8, f16, spatial, ptrs, (512, 896)).float()
                    prob = logit.sigmoid()[:, 0]
                    best = torch.tensor(ids, device=device)[prob.argmax(0)]
                    preds.append(torch.where(prob.max(0).values > 0.5, best, 0))
                if t % args.mem_every == 0:
                    s, p = net.encode_memory(f16, logit)
                    spatial = (spatial[:1] + spatial[1:][-(args.max_mem - 2):] if spatial else []) + [s]
                    ptrs = (ptrs[:1] + ptrs[1:][-(args.max_mem - 2):] if ptrs else []) + [p]
        pred = torch.stack(preds)
        for o in ids:
            pm, gm = pred[1:] == o, gts[1:] == o
            u = (pm | gm).flatten(1).sum(1).float()
            acc[0] += torch.where(u > 0, (pm & gm).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean()
            acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    videos = sorted(os.listdir(os.path.join(args.root, "Annotations")))
    random.shuffle(videos)
    n_val = max(1, int(len(videos) * args.val_frac))
    val_videos, train_videos = sorted(videos[:n_val]), sorted(videos[n_val:])
    train_set = Clips(args.root, train_videos, args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = SAM2Lite(args.backbone).to(device)
    model = DDP(net, device_ids=[local_rank])
    trunk_ids = {id(p) for p in net.trunk.parameters()}
    opt = torch.optim.AdamW([{"params": list(net.trunk.parameters()), "lr": args.lr * 0.1},
                             {"params": [p for p in net.parameters() if id(p) not in trunk_ids], "lr": args.lr}],
                            weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        with open(os.path.join(args.out, "split.txt"), "w") as f:
            f.write("\n".join(f"val {v}" for v in val_videos) + "\n" + "\n".join(f"train {v}" for v in train_videos))
        log.info("%d train / %d val videos", len(train_videos), len(val_videos))

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rgb, masks, valid in loader:
            rgb, masks, valid = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, masks)
            loss = criterion(logits.float(), masks[:, 1:].transpose(1, 2), valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            j = evaluate(net, args.root, val_videos, args, device, rank, world)
            if rank == 0:
                writer.add_scalar("val/J", j, step)
                log.info("epoch %d: held-out J %.4f", epoch, j)
                ckpt = {"image_encoder": {k: v for k, v in net.state_dict().items() if k.startswith(("trunk.", "neck."))},
                        "memory": {k: v for k, v in net.state_dict().items() if not k.startswith(("trunk.", "neck."))},
                        "epoch": epoch, "J": j}
                torch.save(ckpt, os.path.join(args.out, "last.pth"))
                if j > best:
                    torch.save(ckpt, os.path.join(args.out, "best.pth"))
            best = max(best, j)
            dist.barrier()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
