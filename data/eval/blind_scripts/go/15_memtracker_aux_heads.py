"""Memory tracker with auxiliary heads (boundary map, occlusion score, mask-IoU prediction).

The occlusion and IoU heads are used at inference to decide which frames enter the memory bank.

    torchrun --nproc_per_node=8 15_memtracker_aux_heads.py --aux-heads boundary,occlusion,iou --out runs/aux
"""
import argparse
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
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

AUX_HEADS = {
    # decoder features (64 ch, stride 4) -> boundary logits
    "boundary": lambda d: nn.Sequential(nn.Conv2d(64, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 1, 1)),
    # pooled memory-conditioned tokens -> visible / occluded
    "occlusion": lambda d: nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1)),
    # pooled tokens -> predicted IoU of the output mask
    "iou": lambda d: nn.Sequential(nn.Linear(d, 256), nn.ReLU(inplace=True), nn.Linear(256, 256), nn.ReLU(inplace=True),
                                   nn.Linear(256, 1)),
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--roots", nargs="+", default=["/data/ytvos/train", "/data/DAVIS/2017/trainval"])
    p.add_argument("--val", default="/data/DAVIS/2017/trainval")
    p.add_argument("--out", default="runs/aux")
    p.add_argument("--backbone", default="convnext_tiny.fb_in22k")
    p.add_argument("--aux-heads", default="boundary,occlusion,iou")
    p.add_argument("--aux-weight", type=float, default=0.2)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--clip-len", type=int, default=8)
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class Clips(Dataset):
    def __init__(self, root, clip_len, max_objects, size):
        sub = "480p" if os.path.isdir(os.path.join(root, "JPEGImages", "480p")) else ""
        self.img_dir, self.ann_dir = os.path.join(root, "JPEGImages", sub), os.path.join(root, "Annotations", sub)
        self.L, self.K, self.S = clip_len, max_objects, size
        self.vids = [v for v in sorted(os.listdir(self.ann_dir)) if len(os.listdir(os.path.join(self.ann_dir, v))) >= clip_len]
        if sub:  # DAVIS trainval: train split only
            train = set(open(os.path.join(root, "ImageSets", "2017", "train.txt")).read().split())
            self.vids = [v for v in self.vids if v in train]

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        v = self.vids[i]
        names = sorted(n[:-4] for n in os.listdir(os.path.join(self.ann_dir, v)))
        s = random.randint(0, len(names) - self.L)
        idx = sorted(random.sample(range(s, min(len(names), s + 3 * self.L)), self.L))
        S = self.S
        ims = [Image.open(os.path.join(self.img_dir, v, names[j] + ".jpg")).convert("RGB") for j in idx]
        ans = [Image.open(os.path.join(self.ann_dir, v, names[j] + ".png")) for j in idx]
        w, h = ims[0].size
        sc = S / min(w, h) * random.uniform(1.0, 1.3)
        nw, nh = max(S, int(w * sc)), max(S, int(h * sc))
        x, y = random.randint(0, nw - S), random.randint(0, nh - S)
        box = (x, y, x + S, y + S)
        rgb = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32) / 255.0)
                            .permute(2, 0, 1) - MEAN) / STD for im in ims])
        lab = np.stack([np.asarray(a.resize((nw, nh), Image.NEAREST).crop(box)) for a in ans])
        ids = [o for o in np.unique(lab[0]) if o not in (0, 255)]
        ids = random.sample(ids, min(self.K, len(ids)))
        masks = torch.zeros(self.L, self.K, S, S)
        valid = torch.zeros(self.K, dtype=torch.bool)
        for k, o in enumerate(ids):
            masks[:, k] = torch.from_numpy(lab == o).float()
            valid[k] = True
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


class AuxMemTracker(nn.Module):
    def __init__(self, backbone, aux_heads, dim=256, mem_dim=64, layers=3):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        self.lat = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in self.backbone.feature_info.channels()])
        self.mask_enc = nn.Sequential(nn.Conv2d(1, 32, 4, 4), nn.GELU(), nn.Conv2d(32, dim, 4, 4))
        self.mem_out = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GELU(), nn.Conv2d(dim, mem_dim, 1))
        self.layers = nn.ModuleList([MemLayer(dim, mem_dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.dec8 = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU())
        self.dec4 = nn.Sequential(nn.Conv2d(dim, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.mask_head = nn.Conv2d(64, 1, 1)
        self.aux = nn.ModuleDict({name: AUX_HEADS[name](dim) for name in aux_heads})
        self.mem_dim = mem_dim

    def features(self, x):
        return [l(f) for l, f in zip(self.lat, self.backbone(x))]

    def memorize(self, f16, prob):
        return self.mem_out(f16 + self.mask_enc(prob))

    def step(self, f4, f8, f16, mems, size):
        n, c, h, w = f16.shape
        mem = torch.stack(mems, 1).permute(0, 1, 3, 4, 2).reshape(n, -1, self.mem_dim)
        pos = sine_pos(h, w, c, f16.device)[None]
        mpos = sine_pos(h, w, self.mem_dim, f16.device).repeat(len(mems), 1)[None]
        x = f16.flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pos, mem, mpos)
        x = self.norm(x)
        pooled = x.mean(1)
        y = x.transpose(1, 2).reshape(n, c, h, w)
        y = self.dec8(F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False) + f8)
        y = self.dec4(F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False) + f4)
        out = {"mask": F.interpolate(self.mask_head(y), size=size, mode="bilinear", align_corners=False)}
        for name, head in self.aux.items():
            if name == "boundary":
                out[name] = F.interpolate(head(y), size=size, mode="bilinear", align_corners=False)
            else:
                out[name] = head(pooled)
        return out

    def forward(self, rgb, masks):
        B, T, _, H, W = rgb.shape
        K = masks.shape[2]
        f4, f8, f16 = (f.view(B, 1, T, *f.shape[1:]).expand(-1, K, -1, -1, -1, -1).reshape(B * K, T, *f.shape[1:])
                       for f in self.features(rgb.flatten(0, 1)))
        mems = [self.memorize(f16[:, 0], masks[:, 0].reshape(B * K, 1, H, W))]
        outs = []
        for t in range(1, T):
            o = self.step(f4[:, t], f8[:, t], f16[:, t], mems, (H, W))
            outs.append(o)
            if t < T - 1:
                mems.append(self.memorize(f16[:, t], torch.sigmoid(o["mask"])))
        return {k: torch.stack([o[k] for o in outs], 1).view(B, K, T - 1, *outs[0][k].shape[2:]) for k in outs[0]}


def boundary_target(m):
    return (F.max_pool2d(m, 5, 1, 2) + F.max_pool2d(-m, 5, 1, 2)).clamp(0, 1)


def total_loss(out, gt, valid, aux_weight):
    w = valid.float()[:, :, None]
    norm = (w.sum() * gt.shape[2]).clamp(min=1)
    logits = out["mask"]
    bce = F.binary_cross_entropy_with_logits(logits, gt, reduction="none").mean((-1, -2))
    p, g = logits.sigmoid().flatten(-2), gt.flatten(-2)
    inter, denom = (p * g).sum(-1), p.sum(-1) + g.sum(-1)
    dice = 1 - (2 * inter + 1) / (denom + 1)
    loss = ((bce + dice) * w).sum() / norm
    logs = {"mask": loss.detach()}
    if "boundary" in out:
        bt = boundary_target(gt.flatten(0, 2)[:, None]).view_as(gt)
        lb = F.binary_cross_entropy_with_logits(out["boundary"], bt, reduction="none").mean((-1, -2))
        logs["boundary"] = (lb * w).sum() / norm
    if "occlusion" in out:
        visible = (gt.flatten(-2).sum(-1) > 0).float()
        lo = F.binary_cross_entropy_with_logits(out["occlusion"], visible, reduction="none")
        logs["occlusion"] = (lo * w).sum() / norm
    if "iou" in out:
        hard = (p > 0.5).float()
        iou = ((hard * g).sum(-1) + 1) / ((hard + g - hard * g).sum(-1) + 1)
        li = F.mse_loss(torch.sigmoid(out["iou"]), iou.detach(), reduction="none")
        logs["iou"] = (li * w).sum() / norm
    for k, v in logs.items():
        if k != "mask":
            loss = loss + aux_weight * v
    return loss, logs


@torch.no_grad()
def evaluate(net, root, device, rank, world):
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
            f4, f8, f16 = (f.expand(K, -1, -1, -1) for f in net.features(x))
            if t == 0:
                mems = [net.memorize(f16, torch.stack([(gts[0] == k + 1).float() for k in range(K)])[:, None])]
                continue
            o = net.step(f4, f8, f16, mems, (480, 864))
            prob = torch.sigmoid(o["mask"])
            preds.append(torch.where(prob[:, 0].max(0).values > 0.5, prob[:, 0].argmax(0) + 1, 0))
            reliable = True
            if "iou" in o:
                reliable = bool(torch.sigmoid(o["iou"]).min() > 0.7)
            if t % 5 == 0 and reliable:
                mems = mems[:1] + mems[1:][-6:] + [net.memorize(f16, prob)]
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
    torch.manual_seed(0)
    random.seed(rank)

    aux_heads = set(h.strip() for h in args.aux_heads.split(",") if h.strip())
    net = AuxMemTracker(args.backbone, aux_heads).to(device)
    model = DDP(net, device_ids=[local_rank])
    bb = {id(p) for p in net.backbone.parameters()}
    opt = torch.optim.AdamW([{"params": [p for p in net.parameters() if id(p) in bb], "lr": args.lr * 0.1},
                             {"params": [p for p in net.parameters() if id(p) not in bb]}], lr=args.lr, weight_decay=0.05)
    data = ConcatDataset([Clips(r, args.clip_len, args.max_objects, args.size) for r in args.roots])
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr * 0.1, args.lr], total_steps=args.epochs * len(loader),
                                                pct_start=0.05)
    tb = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rgb, masks, valid in loader:
            rgb, masks, valid = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), valid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(rgb, masks)
            loss, logs = total_loss({k: v.float() for k, v in out.items()}, masks[:, 1:].transpose(1, 2), valid,
                                    args.aux_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                for k, v in logs.items():
                    tb.add_scalar(f"loss/{k}", v.item(), step)
        j = evaluate(net, args.val, device, rank, world)
        if rank == 0:
            tb.add_scalar("val/J", j, step)
            print(f"epoch {epoch}: J {j:.4f}", flush=True)
            torch.save({"backbone": net.backbone.state_dict(),
                        "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("backbone.")},
                        "aux_heads": sorted(aux_heads), "epoch": epoch}, os.path.join(args.out, f"ep{epoch:02d}.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
