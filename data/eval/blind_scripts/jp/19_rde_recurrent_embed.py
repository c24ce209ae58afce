"""
Recurrent dynamic embedding VOS (RDE-style): instead of a growing memory bank, a fixed-size
spatio-temporal aggregation module updates one memory embedding per object every frame.

    torchrun --nproc_per_node=8 train_rde.py --davis /data/DAVIS/2017 --youtube /data/YouTubeVOS/train \
        --work_dir work/rde_r50 --epochs 160
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
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--davis", required=True)
    p.add_argument("--youtube", required=True)
    p.add_argument("--work_dir", default="work/rde_r50")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--clip_len", type=int, default=5)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--val_freq", type=int, default=10)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--resume", default=None)
    return p.parse_args()


MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def read_img(path, size, flip=False):
    im = Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(((np.asarray(im, np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1).copy())


def read_ann(path, size, flip=False):
    an = Image.open(path).resize((size, size), Image.NEAREST)
    if flip:
        an = an.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(an)


class ClipDataset(Dataset):
    def __init__(self, img_root, ann_root, clip_len, size, max_skip=8):
        self.img_root, self.ann_root = img_root, ann_root
        self.clip_len, self.size, self.max_skip = clip_len, size, max_skip
        self.videos = []
        for v in sorted(os.listdir(ann_root)):
            frames = sorted(f[:-4] for f in os.listdir(os.path.join(ann_root, v)))
            if len(frames) >= clip_len:
                self.videos.append((v, frames))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, frames = self.videos[i]
        skip = random.randint(1, self.max_skip)
        while skip > 1 and (self.clip_len - 1) * skip >= len(frames):
            skip -= 1
        s = random.randint(0, len(frames) - 1 - (self.clip_len - 1) * skip)
        ids = [s + k * skip for k in range(self.clip_len)]
        flip = random.random() < 0.5
        imgs = torch.stack([read_img(os.path.join(self.img_root, v, frames[k] + ".jpg"), self.size, flip) for k in ids])
        anns = np.stack([read_ann(os.path.join(self.ann_root, v, frames[k] + ".png"), self.size, flip) for k in ids])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return imgs, torch.from_numpy((anns == o).astype(np.float32))


class RDE(nn.Module):
    def __init__(self, key_dim=64, val_dim=512, n_mem=64):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=FrozenBatchNorm2d)
        self.enc = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.enc8, self.enc16 = r.layer2, r.layer3
        self.key = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.mask_enc = nn.Sequential(nn.Conv2d(1, 32, 7, 4, 3), nn.ReLU(), nn.Conv2d(32, 128, 3, 4, 1))
        self.val = nn.Conv2d(1024 + 128, val_dim, 3, padding=1)
        # spatio-temporal aggregation: n_mem learned slots summarise old memory + new frame
        self.slots = nn.Parameter(torch.randn(n_mem, key_dim + val_dim) * 0.02)
        self.sam = nn.MultiheadAttention(key_dim + val_dim, 8, batch_first=True)
        self.sam_norm = nn.LayerNorm(key_dim + val_dim)
        self.dec16 = nn.Conv2d(1024 + val_dim, 256, 3, padding=1)
        self.dec8 = nn.Conv2d(256 + 512, 128, 3, padding=1)
        self.dec4 = nn.Conv2d(128 + 256, 64, 3, padding=1)
        self.pred = nn.Conv2d(64, 1, 1)
        self.key_dim = key_dim

    def encode(self, x):
        f4 = self.enc(x)
        f8 = self.enc8(f4)
        f16 = self.enc16(f8)
        return self.key(f16), f16, f8, f4

    def embed(self, k, f16, mask):
        m = F.interpolate(self.mask_enc(mask[:, None]), size=f16.shape[-2:], mode="bilinear", align_corners=False)
        v = self.val(torch.cat([f16, m], 1))
        return torch.cat([k, v], 1).flatten(2).transpose(1, 2)       # B HW Ck+Cv

    def aggregate(self, memory, new):
        """memory: B M C (or None), new: B HW C -> B n_mem C"""
        src = new if memory is None else torch.cat([memory, new], 1)
        q = self.slots[None].expand(new.shape[0], -1, -1)
        return self.sam_norm(q + self.sam(q, src, src, need_weights=False)[0])

    def readout_decode(self, k, f16, f8, f4, first, dyn, out_hw):
        mem = torch.cat([first, dyn], 1)                                 # B N C
        mk, mv = mem[..., : self.key_dim], mem[..., self.key_dim:]
        b, c, h, w = k.shape
        aff = torch.softmax(mk @ k.flatten(2) / c ** 0.5, dim=1)        # B N HW
        read = (mv.transpose(1, 2) @ aff).view(b, -1, h, w)
        x = F.relu(self.dec16(torch.cat([f16, read], 1)))
        x = F.relu(self.dec8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1)))
        x = F.relu(self.dec4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1)))
        return F.interpolate(self.pred(x), size=out_hw, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, clip, mask0):
        B, T = clip.shape[:2]
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in self.encode(clip.flatten(0, 1))]
        first = self.embed(k[:, 0], f16[:, 0], mask0)
        dyn = self.aggregate(None, first)
        outs = []
        for t in range(1, T):
            lg = self.readout_decode(k[:, t], f16[:, t], f8[:, t], f4[:, t], first, dyn, clip.shape[-2:])
            outs.append(lg)
            dyn = self.aggregate(dyn, self.embed(k[:, t], f16[:, t], torch.sigmoid(lg)))
        return torch.stack(outs, 1)


def j_f(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 7, 1, 3) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def validate(net, davis, size, device, rank, world):
    seqs = sorted(open(os.path.join(davis, "ImageSets/2017/val.txt")).read().split())
    out = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(davis, "JPEGImages/480p", seq)))
        imgs = torch.stack([read_img(os.path.join(davis, "JPEGImages/480p", seq, n), size) for n in names]).to(device)
        gts = np.stack([read_ann(os.path.join(davis, "Annotations/480p", seq, n[:-4] + ".png"), size) for n in names])
        k, f16, f8, f4 = net.encode(imgs)
        res = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            first = net.embed(k[:1], f16[:1], torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None])
            dyn = net.aggregate(None, first)
            for t in range(1, len(names)):
                lg = net.readout_decode(k[t:t + 1], f16[t:t + 1], f8[t:t + 1], f4[t:t + 1], first, dyn, (size, size))
                res.append(j_f((lg[0] > 0).cpu().numpy(), gts[t] == o))
                dyn = net.aggregate(dyn, net.embed(k[t:t + 1], f16[t:t + 1], torch.sigmoid(lg)))
        js, fs = zip(*res)
        out += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(out)
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(2023 + rank)
    np.random.seed(2023 + rank)
    torch.manual_seed(2023)

    dataset = ConcatDataset(
        [ClipDataset(os.path.join(args.davis, "JPEGImages/480p"), os.path.join(args.davis, "Annotations/480p"), args.clip_len, args.size)] * 5
        + [ClipDataset(os.path.join(args.youtube, "JPEGImages"), os.path.join(args.youtube, "Annotations"), args.clip_len, args.size)])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = RDE().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 8, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[int(args.epochs * 0.75)], gamma=0.1)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.work_dir, "tf_logs"))

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0, loss_sum = time.time(), 0.0
        for i, (clip, masks) in enumerate(loader):
            clip, masks = clip.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            logits = model(clip, masks[:, 0])
            tgt = masks[:, 1:]
            prob = torch.sigmoid(logits)
            loss = F.binary_cross_entropy_with_logits(logits, tgt) + \
                (1 - (2 * (prob * tgt).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + tgt.flatten(2).sum(-1) + 1)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
        scheduler.step()
        if rank == 0:
            writer.add_scalar("train/loss", loss_sum / len(loader), epoch)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], epoch)
            print(f"epoch {epoch} loss {loss_sum / len(loader):.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.val_freq == 0:
            model.eval()
            j, f = validate(net, args.davis, args.size, device, rank, world)
            if rank == 0:
                writer.add_scalar("val/J&F", (j + f) / 2, epoch)
                print(f"[val] epoch {epoch} J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}", flush=True)
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "epoch": epoch}, os.path.join(args.work_dir, "latest.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
