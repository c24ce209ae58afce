"""
Swin-T memory tracker for semi-supervised VOS (first-frame masks), trained on YouTube-VOS + DAVIS,
validated on DAVIS-2017 val (J&F per sequence, averaged over all ranks' sequences).

    torchrun --nproc_per_node=4 train_swin_memtrack.py --ytvos /ds/ytvos19/train --davis /ds/DAVIS2017 \
        --exp swinT_memtrack_bs16
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
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ytvos", required=True)
    ap.add_argument("--davis", required=True)
    ap.add_argument("--exp", default="swinT_memtrack")
    ap.add_argument("--save_dir", default="checkpoints")
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--seq_len", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=16, help="global")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--val_interval", type=int, default=2)
    ap.add_argument("--wandb_entity", default=None)
    return ap.parse_args()


def normalize(img):
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]


class SeqDataset(Dataset):
    def __init__(self, img_root, ann_root, seq_len, size, repeat=1):
        self.img_root, self.ann_root, self.seq_len, self.size = img_root, ann_root, seq_len, size
        vids = sorted(os.listdir(ann_root))
        self.videos = [(v, sorted(a[:-4] for a in os.listdir(os.path.join(ann_root, v)))) for v in vids] * repeat
        self.videos = [x for x in self.videos if len(x[1]) >= seq_len]

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        gap = random.randint(1, max(1, min(5, (len(names) - 1) // (self.seq_len - 1))))
        s = random.randint(0, len(names) - 1 - gap * (self.seq_len - 1))
        sel = [names[s + k * gap] for k in range(self.seq_len)]
        scale = random.uniform(0.8, 1.2)
        sz = int(self.size * scale)
        ox, oy = random.randint(0, max(0, sz - self.size)), random.randint(0, max(0, sz - self.size))
        imgs, anns = [], []
        for n in sel:
            im = Image.open(os.path.join(self.img_root, v, n + ".jpg")).convert("RGB").resize((sz, sz), Image.BILINEAR)
            an = Image.open(os.path.join(self.ann_root, v, n + ".png")).resize((sz, sz), Image.NEAREST)
            box = (ox, oy, ox + self.size, oy + self.size)
            imgs.append(normalize(im.crop(box)))
            anns.append(np.asarray(an.crop(box)))
        anns = np.stack(anns)
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return torch.stack(imgs), torch.from_numpy((anns == o).astype(np.float32))


class SwinMemTracker(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.enc = timm.create_model("swin_tiny_patch4_window7_224", pretrained=True, features_only=True,
                                     out_indices=(0, 1, 2), img_size=448)
        c4, c8, c16 = self.enc.feature_info.channels()
        self.key = nn.Linear(c16, 64)
        self.val = nn.Sequential(nn.Conv2d(c16 + 1, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU())
        self.fuse = nn.Sequential(nn.Conv2d(c16 + dim, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU())
        self.up8 = nn.Sequential(nn.Conv2d(dim + c8, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.GELU())
        self.up4 = nn.Sequential(nn.Conv2d(128 + c4, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.Conv2d(64, 1, 1))

    def backbone(self, x):
        f4, f8, f16 = [f.permute(0, 3, 1, 2).contiguous() for f in self.enc(x)]   # timm swin gives NHWC
        k = self.key(f16.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return k, f16, f8, f4

    def value(self, f16, mask):
        return self.val(torch.cat([f16, F.interpolate(mask[:, None], size=f16.shape[-2:], mode="bilinear", align_corners=False)], 1))

    def segment(self, k, f16, f8, f4, mk, mv, out_hw):
        b, c, h, w = k.shape
        aff = torch.softmax(torch.einsum("bcn,bcm->bnm", mk, k.flatten(2)) / c ** 0.5, dim=1)
        read = torch.einsum("bdn,bnm->bdm", mv, aff).view(b, -1, h, w)
        x = self.fuse(torch.cat([f16, read], 1))
        x = self.up8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.up4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, seq, mask0):
        B, T = seq.shape[:2]
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in self.backbone(seq.flatten(0, 1))]
        mk, mv = [k[:, 0].flatten(2)], [self.value(f16[:, 0], mask0).flatten(2)]
        out = []
        for t in range(1, T):
            lg = self.segment(k[:, t], f16[:, t], f8[:, t], f4[:, t], torch.cat(mk, 2), torch.cat(mv, 2), seq.shape[-2:])
            out.append(lg)
            mk.append(k[:, t].flatten(2))
            mv.append(self.value(f16[:, t], torch.sigmoid(lg)).flatten(2))
        return torch.stack(out, 1)


def j_f_frame(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 7, 1, 3) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, (2 * p * r / (p + r)) if p + r > 0 else 0.0


@torch.no_grad()
def validate(net, davis, size, device, rank, world):
    seqs = open(os.path.join(davis, "ImageSets/2017/val.txt")).read().split()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(davis, "JPEGImages/480p", seq)))
        imgs = torch.stack([normalize(Image.open(os.path.join(davis, "JPEGImages/480p", seq, n)).convert("RGB").resize((size, size), Image.BILINEAR)) for n in names]).to(device)
        gts = np.stack([np.asarray(Image.open(os.path.join(davis, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names])
        k, f16, f8, f4 = net.backbone(imgs)
        scores = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            mk, mv = [k[:1].flatten(2)], [net.value(f16[:1], m0).flatten(2)]
            for t in range(1, len(names)):
                lg = net.segment(k[t:t + 1], f16[t:t + 1], f8[t:t + 1], f4[t:t + 1], torch.cat(mk, 2), torch.cat(mv, 2), (size, size))
                scores.append(j_f_frame((lg[0] > 0).cpu().numpy(), gts[t] == o))
                if t % 5 == 0:
                    mk.append(k[t:t + 1].flatten(2))
                    mv.append(net.value(f16[t:t + 1], torch.sigmoid(lg)).flatten(2))
        js, fs = zip(*scores)
        sums += torch.tensor([np.mean(js), np.mean(fs), 1], device=device, dtype=torch.float64)
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100)

    run = wandb.init(project="vos-memtrack", entity=args.wandb_entity, name=args.exp, config=vars(args))

    model = SwinMemTracker().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": model.module.enc.parameters(), "lr": args.lr * 0.1},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("enc.")], "lr": args.lr},
    ], weight_decay=0.05)

    data = ConcatDataset([
        SeqDataset(os.path.join(args.ytvos, "JPEGImages"), os.path.join(args.ytvos, "Annotations"), args.seq_len, args.size),
        SeqDataset(os.path.join(args.davis, "JPEGImages/480p"), os.path.join(args.davis, "Annotations/480p"), args.seq_len, args.size, repeat=5),
    ])
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    save_dir = os.path.join(args.save_dir, args.exp)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for seq, masks in loader:
            seq, masks = seq.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(seq, masks[:, 0])
            tgt = masks[:, 1:]
            p = torch.sigmoid(logits.float())
            loss = F.binary_cross_entropy_with_logits(logits.float(), tgt) + \
                (1 - (2 * (p * tgt).sum((-1, -2)) + 1) / (p.sum((-1, -2)) + tgt.sum((-1, -2)) + 1)).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                run.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[1], "train/it_s": (time.time() - t0) / 20}, step=step)
                t0 = time.time()

        if (epoch + 1) % args.val_interval == 0:
            model.eval()
            j, f = validate(model.module, args.davis, args.size, device, rank, world)
            if rank == 0:
                jf = (j + f) / 2
                run.log({"val/J": j, "val/F": f, "val/J&F": jf, "epoch": epoch}, step=step)
                if jf > best:
                    best = jf
                    torch.save(model.module.state_dict(), os.path.join(save_dir, "best.pth"))
                    run.summary["best_J&F"] = best
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, os.path.join(save_dir, "last.pth"))

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
