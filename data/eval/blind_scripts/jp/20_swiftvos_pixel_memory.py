"""
Lightweight real-time VOS (SwiftNet-like pixel-adaptive memory) with a ConvNeXt-V2-T encoder.
Trains on YouTube-VOS + DAVIS, validates on DAVIS-2017 val every few epochs and keeps the best J&F.

    torchrun --nproc_per_node=4 train_swift.py --ytvos /data/ytvos/train --davis /data/DAVIS --out out/swift_cnv2t
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
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ytvos", required=True)
    ap.add_argument("--davis", required=True)
    ap.add_argument("--out", default="out/swift_cnv2t")
    ap.add_argument("--size", type=int, default=480)
    ap.add_argument("--clip_len", type=int, default=4)
    ap.add_argument("--bs", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--val_every", type=int, default=5)
    ap.add_argument("--mem_every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def rgb(p, size):
    a = np.asarray(Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR), np.float32) / 255.0
    a = (a - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    return torch.from_numpy(a.astype(np.float32).transpose(2, 0, 1))


def ann(p, size):
    return np.asarray(Image.open(p).resize((size, size), Image.NEAREST))


class Clips(Dataset):
    def __init__(self, img_root, ann_root, clip_len, size, repeat=1):
        self.img_root, self.ann_root, self.clip_len, self.size = img_root, ann_root, clip_len, size
        vids = []
        for v in sorted(os.listdir(ann_root)):
            names = sorted(a[:-4] for a in os.listdir(os.path.join(ann_root, v)))
            if len(names) >= clip_len:
                vids.append((v, names))
        self.vids = vids * repeat

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        v, names = self.vids[i]
        skip = random.randint(1, 4)
        span = (self.clip_len - 1) * skip + 1
        if span > len(names):
            skip, span = 1, self.clip_len
        s = random.randint(0, len(names) - span)
        sel = [names[s + k * skip] for k in range(self.clip_len)]
        imgs = torch.stack([rgb(os.path.join(self.img_root, v, n + ".jpg"), self.size) for n in sel])
        anns = np.stack([ann(os.path.join(self.ann_root, v, n + ".png"), self.size) for n in sel])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return imgs, torch.from_numpy((anns == o).astype(np.float32))


class DavisSeqs(Dataset):
    def __init__(self, root, size):
        self.root, self.size = root, size
        self.seqs = sorted(open(os.path.join(root, "ImageSets/2017/val.txt")).read().split())

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i]
        names = sorted(os.listdir(os.path.join(self.root, "JPEGImages/480p", seq)))
        imgs = torch.stack([rgb(os.path.join(self.root, "JPEGImages/480p", seq, n), self.size) for n in names])
        gts = np.stack([ann(os.path.join(self.root, "Annotations/480p", seq, n[:-4] + ".png"), self.size) for n in names])
        return imgs, torch.from_numpy(gts.astype(np.int64)), seq


class SwiftVOS(nn.Module):
    def __init__(self, dim=256, key_dim=64):
        super().__init__()
        self.enc = timm.create_model("convnextv2_tiny.fcmae_ft_in22k_in1k", pretrained=True, features_only=True, out_indices=(0, 1, 2))
        c4, c8, c16 = self.enc.feature_info.channels()
        self.key = nn.Conv2d(c16, key_dim, 1)
        self.pixel_value = nn.Sequential(nn.Conv2d(c16 + 1, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU(), nn.Conv2d(dim, dim, 1))
        self.dec16 = nn.Sequential(nn.Conv2d(c16 + dim, 192, 3, padding=1), nn.GroupNorm(16, 192), nn.GELU())
        self.dec8 = nn.Sequential(nn.Conv2d(192 + c8, 96, 3, padding=1), nn.GroupNorm(8, 96), nn.GELU())
        self.dec4 = nn.Sequential(nn.Conv2d(96 + c4, 48, 3, padding=1), nn.GroupNorm(8, 48), nn.GELU(), nn.Conv2d(48, 1, 1))

    def encode(self, x):
        f4, f8, f16 = self.enc(x)
        return self.key(f16), f16, f8, f4

    def value(self, f16, m):
        return self.pixel_value(torch.cat([f16, F.interpolate(m[:, None], size=f16.shape[-2:], mode="bilinear", align_corners=False)], 1))

    def decode(self, k, f16, f8, f4, mk, mv, hw):
        b, c, h, w = k.shape
        aff = torch.softmax(torch.einsum("bcn,bcm->bnm", mk, k.flatten(2)) / c ** 0.5, 1)
        read = torch.einsum("bdn,bnm->bdm", mv, aff).view(b, -1, h, w)
        x = self.dec16(torch.cat([f16, read], 1))
        x = self.dec8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.dec4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(x, size=hw, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, clip, m0):
        B, T = clip.shape[:2]
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in self.encode(clip.flatten(0, 1))]
        mk, mv = [k[:, 0].flatten(2)], [self.value(f16[:, 0], m0).flatten(2)]
        out = []
        for t in range(1, T):
            lg = self.decode(k[:, t], f16[:, t], f8[:, t], f4[:, t], torch.cat(mk, 2), torch.cat(mv, 2), clip.shape[-2:])
            out.append(lg)
            mk.append(k[:, t].flatten(2))
            mv.append(self.value(f16[:, t], torch.sigmoid(lg)).flatten(2))
        return torch.stack(out, 1)


def frame_jf(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def validate(net, loader, device, mem_every):
    net.eval()
    seq_j, seq_f = [], []
    for imgs, gts, _ in loader:
        imgs, gts = imgs[0].to(device), gts[0].numpy()
        hw = imgs.shape[-2:]
        k, f16, f8, f4 = net.encode(imgs)
        js, fs = [], []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            mk, mv = [k[:1].flatten(2)], [net.value(f16[:1], m0).flatten(2)]
            for t in range(1, len(imgs)):
                lg = net.decode(k[t:t + 1], f16[t:t + 1], f8[t:t + 1], f4[t:t + 1], torch.cat(mk, 2), torch.cat(mv, 2), hw)
                j, f = frame_jf((lg[0] > 0).cpu().numpy(), gts[t] == o)
                js.append(j)
                fs.append(f)
                if t % mem_every == 0:
                    mk.append(k[t:t + 1].flatten(2))
                    mv.append(net.value(f16[t:t + 1], torch.sigmoid(lg)).flatten(2))
        seq_j.append(np.mean(js))
        seq_f.append(np.mean(fs))
    net.train()
    return float(np.mean(seq_j)), float(np.mean(seq_f))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    train_set = ConcatDataset([
        Clips(os.path.join(args.ytvos, "JPEGImages"), os.path.join(args.ytvos, "Annotations"), args.clip_len, args.size),
        Clips(os.path.join(args.davis, "JPEGImages/480p"), os.path.join(args.davis, "Annotations/480p"), args.clip_len, args.size, repeat=5),
    ])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_set = DavisSeqs(args.davis, args.size)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4)

    net = SwiftVOS().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * args.bs * world / 16, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_jf = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (clip, masks) in enumerate(train_loader):
            clip, masks = clip.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(clip, masks[:, 0])
            tgt = masks[:, 1:]
            prob = torch.sigmoid(logits.float())
            loss = F.binary_cross_entropy_with_logits(logits.float(), tgt) + \
                (1 - (2 * (prob * tgt).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + tgt.flatten(2).sum(-1) + 1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + it)
        sched.step()
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.val_every == 0:
            j, f = validate(net, val_loader, device, args.mem_every)
            jf = (j + f) / 2
            if rank == 0:
                writer.add_scalar("val/J", j, epoch)
                writer.add_scalar("val/F", f, epoch)
                writer.add_scalar("val/J&F", jf, epoch)
                print(f"[val] epoch {epoch}: J {j:.4f} F {f:.4f} J&F {jf:.4f}", flush=True)
                if jf > best_jf:
                    best_jf = jf
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
