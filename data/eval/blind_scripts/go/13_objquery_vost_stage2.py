"""Object-query memory tracker, stage 2: joint fine-tuning on VOST + DAVIS train, validation on DAVIS-17 val.

    torchrun --nproc_per_node=8 13_objquery_vost_stage2.py --init runs/oq_stage1/best.pt --out /shared/runs/oq_stage2
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models import ConvNeXt_Tiny_Weights, convnext_tiny

NORM_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
NORM_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vost", default="/data/VOST")
    ap.add_argument("--davis", default="/data/DAVIS/2017/trainval")
    ap.add_argument("--init", default="")
    ap.add_argument("--out", default="/shared/runs/oq_stage2")
    ap.add_argument("--crop", type=int, default=448)
    ap.add_argument("--clip-len", type=int, default=8)
    ap.add_argument("--max-obj", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--num-queries", type=int, default=16)
    ap.add_argument("--mem-every", type=int, default=5)
    ap.add_argument("--max-mem", type=int, default=8)
    return ap.parse_args()


def to_tensor(img):
    return torch.from_numpy(((np.asarray(img, dtype=np.float32) / 255.0 - NORM_MEAN) / NORM_STD).transpose(2, 0, 1))


class SplitDataset(Dataset):
    """DAVIS-style layout; VOST uses the same JPEGImages/Annotations/ImageSets structure."""

    def __init__(self, img_root, ann_root, list_file, args, repeat=1):
        self.img_root, self.ann_root, self.a = img_root, ann_root, args
        with open(list_file) as f:
            vids = [l.strip() for l in f if l.strip()]
        self.items = []
        for v in vids:
            names = sorted(n[:-4] for n in os.listdir(os.path.join(ann_root, v)))
            if len(names) >= args.clip_len:
                self.items.append((v, names))
        self.items *= repeat

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        v, names = self.items[i]
        a = self.a
        for _ in range(6):
            s = random.randint(0, len(names) - a.clip_len)
            span = min(len(names) - s, a.clip_len * 3)
            idx = [s] + sorted(random.sample(range(s + 1, s + span), a.clip_len - 1))
            imgs = [Image.open(os.path.join(self.img_root, v, names[j] + ".jpg")).convert("RGB") for j in idx]
            anns = [Image.open(os.path.join(self.ann_root, v, names[j] + ".png")) for j in idx]
            w, h = imgs[0].size
            sc = a.crop / min(w, h) * random.uniform(1.0, 1.4)
            nw, nh = max(a.crop, int(w * sc)), max(a.crop, int(h * sc))
            x, y = random.randint(0, nw - a.crop), random.randint(0, nh - a.crop)
            box = (x, y, x + a.crop, y + a.crop)
            lab = np.stack([np.asarray(m.resize((nw, nh), Image.NEAREST).crop(box)) for m in anns])
            ids = [o for o in np.unique(lab[0]) if o not in (0, 255) and (lab[0] == o).sum() > 64]
            if ids:
                break
        rgb = torch.stack([to_tensor(im.resize((nw, nh), Image.BILINEAR).crop(box)) for im in imgs])
        ids = random.sample(ids, min(len(ids), a.max_obj))
        masks = torch.zeros(a.clip_len, a.max_obj, a.crop, a.crop)
        valid = torch.zeros(a.max_obj, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = torch.from_numpy(lab == o).float()
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
def validate(net, args, device, rank, world):
    root = args.davis
    vids = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(2, device=device)
    net.eval()
    for vid in vids[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "JPEGImages/480p", vid)))
        gts = np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", vid, n + ".png"))) for n in names])
        K, (H, W) = int(gts[0].max()), gts.shape[1:]
        pad = (0, (-W) % 32, 0, (-H) % 32)
        mem, preds = None, [gts[0]]
        for t, n in enumerate(names):
            img = F.pad(to_tensor(Image.open(os.path.join(root, "JPEGImages/480p", vid, n + ".jpg")).convert("RGB"))[None].to(device), pad)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                key, pix, f8, f4 = net.encode(img)
                if t == 0:
                    prob = F.pad(torch.from_numpy(np.stack([gts[0] == k + 1 for k in range(K)])).float()[None].to(device), pad)
                else:
                    prob = torch.sigmoid(net.decode(key, pix, f8, f4, torch.cat(mem[0], 2), torch.cat(mem[1], 3),
                                                    torch.stack(mem[2], 0).mean(0), img.shape[-2:]).float())
                    p = prob[0, :, :H, :W]
                    preds.append(torch.where(p.max(0).values > 0.5, p.argmax(0) + 1, 0).cpu().numpy())
                if t % args.mem_every == 0:
                    v, s = net.encode_memory(pix, prob)
                    entry = (key.flatten(2), v.flatten(3), s)
                    mem = tuple([x] for x in entry) if mem is None else tuple(
                        (lst[:1] + lst[1:][-(args.max_mem - 2):] + [x]) for lst, x in zip(mem, entry))
        pred = np.stack(preds)
        for k in range(1, K + 1):
            pm, gm = pred[1:-1] == k, gts[1:-1] == k
            u = (pm | gm).sum((1, 2))
            acc[0] += float(np.mean(np.where(u > 0, (pm & gm).sum((1, 2)) / np.maximum(u, 1), 1.0)))
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
    random.seed(99 + rank)
    torch.manual_seed(99)
    os.makedirs(args.out, exist_ok=True)

    net = Tracker(args.num_queries).to(device)
    start_epoch, best = 0, 0.0
    last_path = os.path.join(args.out, "last.pt")
    if os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        net.pixel_encoder.load_state_dict(ckpt["pixel_encoder"])
        net.load_state_dict({**net.state_dict(), **ckpt["memory"]})
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    elif args.init:
        ckpt = torch.load(args.init, map_location="cpu")
        net.pixel_encoder.load_state_dict(ckpt["pixel_encoder"])
        net.load_state_dict({**net.state_dict(), **ckpt["memory"]})
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW([{"params": net.pixel_encoder.parameters(), "lr": args.lr * 0.1},
                             {"params": [p for n, p in net.named_parameters() if not n.startswith("pixel_encoder.")]}],
                            lr=args.lr, weight_decay=0.05)
    if start_epoch > 0:
        opt.load_state_dict(ckpt["optimizer"])

    vost = SplitDataset(os.path.join(args.vost, "JPEGImages"), os.path.join(args.vost, "Annotations"),
                        os.path.join(args.vost, "ImageSets", "train.txt"), args)
    davis = SplitDataset(os.path.join(args.davis, "JPEGImages/480p"), os.path.join(args.davis, "Annotations/480p"),
                         os.path.join(args.davis, "ImageSets/2017/train.txt"), args, repeat=3)
    data = ConcatDataset([vost, davis])
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
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
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(loader) + it)
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} {(time.time() - tic) / (it + 1):.2f}s/it")
        j = validate(net, args, device, rank, world)
        best = max(best, j)
        if writer is not None:
            writer.add_scalar("val/J", j, epoch)
            print(f"epoch {epoch}: DAVIS-17 val J {j:.4f} (best {best:.4f})")
        state = {"pixel_encoder": net.pixel_encoder.state_dict(),
                 "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("pixel_encoder.")},
                 "optimizer": opt.state_dict(), "epoch": epoch, "best": best}
        torch.save(state, last_path)
        if j >= best:
            torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
