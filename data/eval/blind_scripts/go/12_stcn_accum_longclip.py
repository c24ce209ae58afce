"""STCN fine-tuning with gradient accumulation (small per-GPU batch, long clips).

Per-GPU batch is 1 clip; gradients are accumulated over --accum clips before each update,
so the effective batch is world_size * accum clips and the LR is scaled accordingly.

    torchrun --nproc_per_node=8 12_stcn_accum_longclip.py --data /data/ytvos/train --val /data/DAVIS/2017/trainval
"""
import argparse
import contextlib
import math
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models
from torchvision.ops import FrozenBatchNorm2d

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ytvos/train")
    p.add_argument("--val", default="/data/DAVIS/2017/trainval")
    p.add_argument("--out", default="runs/stcn_accum")
    p.add_argument("--init", default="", help="STCN weights (plain or DDP-saved)")
    p.add_argument("--clip-len", type=int, default=6)
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--base-lr", type=float, default=1e-5, help="LR for an effective batch of 16 clips")
    p.add_argument("--warmup-updates", type=int, default=500)
    p.add_argument("--updates", type=int, default=40000)
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def read_rgb(path):
    return (torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD


def read_label(path):
    return torch.from_numpy(np.asarray(Image.open(path), dtype=np.int64))


class LongClips(Dataset):
    def __init__(self, root, clip_len, max_objects, size):
        self.root, self.T, self.K, self.S = root, clip_len, max_objects, size
        self.items = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "Annotations", v)))
            if len(names) >= clip_len:
                self.items.append((v, names))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        v, names = self.items[i]
        s = random.randint(0, len(names) - self.T)
        idx = list(range(s, s + self.T))
        rgb = torch.stack([read_rgb(os.path.join(self.root, "JPEGImages", v, names[j] + ".jpg")) for j in idx])
        lab = torch.stack([read_label(os.path.join(self.root, "Annotations", v, names[j] + ".png")) for j in idx])
        H, W = lab.shape[-2:]
        sc = self.S / min(H, W) * random.uniform(1.0, 1.5)
        nh, nw = max(self.S, int(H * sc)), max(self.S, int(W * sc))
        rgb = F.interpolate(rgb, size=(nh, nw), mode="bilinear", align_corners=False)
        lab = F.interpolate(lab[:, None].float(), size=(nh, nw), mode="nearest")[:, 0].long()
        y, x = random.randint(0, nh - self.S), random.randint(0, nw - self.S)
        rgb, lab = rgb[..., y:y + self.S, x:x + self.S], lab[..., y:y + self.S, x:x + self.S]
        if random.random() < 0.5:
            rgb, lab = rgb.flip(-1), lab.flip(-1)
        ids = [o for o in lab[0].unique().tolist() if o not in (0, 255)]
        ids = random.sample(ids, min(self.K, len(ids)))
        masks = torch.zeros(self.T, self.K, self.S, self.S)
        sel = torch.zeros(self.K)
        for k, o in enumerate(ids):
            masks[:, k] = (lab == o).float()
            sel[k] = 1
        return rgb, masks, sel


def resnet(depth, extra_chan=0):
    net = getattr(models, f"resnet{depth}")(weights="DEFAULT", norm_layer=FrozenBatchNorm2d)
    if extra_chan:
        w = net.conv1.weight.data
        net.conv1 = nn.Conv2d(3 + extra_chan, 64, 7, 2, 3, bias=False)
        net.conv1.weight.data = torch.cat([w, torch.zeros(64, extra_chan, 7, 7)], 1)
    return net


class ResBlock(nn.Module):
    def __init__(self, indim, outdim):
        super().__init__()
        self.down = nn.Conv2d(indim, outdim, 3, padding=1) if indim != outdim else nn.Identity()
        self.conv1, self.conv2 = nn.Conv2d(indim, outdim, 3, padding=1), nn.Conv2d(outdim, outdim, 3, padding=1)

    def forward(self, x):
        return self.down(x) + self.conv2(F.relu(self.conv1(F.relu(x))))


class STCN(nn.Module):
    def __init__(self):
        super().__init__()
        r50, r18 = resnet(50), resnet(18, extra_chan=2)
        self.key_encoder = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2, r50.layer3)
        self.key_proj = nn.Conv2d(1024, 64, 3, padding=1)
        self.key_comp = nn.Conv2d(1024, 512, 3, padding=1)
        self.value_encoder = nn.Sequential(r18.conv1, r18.bn1, r18.relu, r18.maxpool, r18.layer1, r18.layer2, r18.layer3)
        self.value_fuser = nn.Sequential(ResBlock(1024 + 256, 512), ResBlock(512, 512))
        self.compress = ResBlock(1024, 512)
        self.skip8, self.skip4 = nn.Conv2d(512, 512, 3, padding=1), nn.Conv2d(256, 256, 3, padding=1)
        self.up8, self.up4 = ResBlock(512, 256), ResBlock(256, 256)
        self.pred = nn.Conv2d(256, 1, 3, padding=1)

    def encode_key(self, x):
        f4 = self.key_encoder[:5](x)
        f8 = self.key_encoder[5](f4)
        f16 = self.key_encoder[6](f8)
        return self.key_proj(f16), self.key_comp(f16), f16, f8, f4

    def encode_value(self, frame, f16, masks):
        K = masks.shape[1]
        others = masks.sum(1, keepdim=True) - masks
        out = []
        for k in range(K):
            x = self.value_encoder(torch.cat([frame, masks[:, k:k + 1], others[:, k:k + 1]], 1))
            out.append(self.value_fuser(torch.cat([x, f16], 1)))
        return torch.stack(out, 1)

    def segment(self, qk, qv, f8, f4, mk, mv, sel, top_k=None):
        B, CK = mk.shape[:2]
        h, w = qk.shape[-2:]
        mk, q = mk.flatten(2), qk.flatten(2)
        aff = (2 * mk.transpose(1, 2) @ q - mk.pow(2).sum(1).unsqueeze(2)) / math.sqrt(CK)
        if top_k is not None and top_k < aff.shape[1]:
            vals, idx = aff.topk(top_k, dim=1)
            aff = torch.zeros_like(aff).scatter_(1, idx, F.softmax(vals, dim=1))
        else:
            aff = F.softmax(aff, dim=1)
        logits = []
        for k in range(mv.shape[1]):
            mem = (mv[:, k].flatten(2) @ aff).view(B, -1, h, w)
            x = self.compress(torch.cat([mem, qv], 1))
            x = self.up8(self.skip8(f8) + F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))
            x = self.up4(self.skip4(f4) + F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))
            logits.append(F.interpolate(self.pred(F.relu(x)), scale_factor=4, mode="bilinear", align_corners=False))
        prob = torch.sigmoid(torch.cat(logits, 1)) * sel[:, :, None, None]
        prob = torch.cat([torch.prod(1 - prob, 1, keepdim=True), prob], 1).clamp(1e-7, 1 - 1e-7)
        logits = torch.log(prob / (1 - prob))
        return logits, F.softmax(logits, 1)[:, 1:]

    def forward(self, rgb, masks, sel):
        B, T = rgb.shape[:2]
        k16, v16, f16, f8, f4 = (x.view(B, T, *x.shape[1:]) for x in self.encode_key(rgb.flatten(0, 1)))
        prev = masks[:, 0]
        mk, mv, out = [], [], []
        for t in range(1, T):
            mk.append(k16[:, t - 1])
            mv.append(self.encode_value(rgb[:, t - 1], f16[:, t - 1], prev))
            logits, prev = self.segment(k16[:, t], v16[:, t], f8[:, t], f4[:, t], torch.stack(mk, 2), torch.stack(mv, 3), sel)
            out.append(logits)
        return torch.stack(out, 1)



def stcn_loss(logits, gt, sel):
    labels = torch.cat([torch.full_like(gt[:, :, :1], 0.5), gt], 2).argmax(2)
    raw = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="none").flatten(1)
    ce = raw.topk(raw.shape[1] // 4, dim=1).values.mean()  # bootstrapped: hardest 25% of pixels
    prob = F.softmax(logits, 2)[:, :, 1:].flatten(3)
    g = gt.flatten(3)
    dice = 1 - (2 * (prob * g).sum(-1) + 1) / (prob.sum(-1) + g.sum(-1) + 1)
    w = sel[:, None, :]
    dice = (dice * w).sum() / (w.sum() * dice.shape[1]).clamp(min=1)
    return ce + dice


@torch.no_grad()
def evaluate(net, root, device, rank, world, mem_every=5, top_k=20):
    vids = open(os.path.join(root, "ImageSets", "2017", "val.txt")).read().split()
    acc = torch.zeros(2, device=device)
    net.eval()
    # videos are split round-robin, so ranks hold different numbers of videos and objects;
    # only the final all_reduce is collective
    for vid in vids[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "JPEGImages", "480p", vid)))
        gts = torch.stack([read_label(os.path.join(root, "Annotations", "480p", vid, n + ".png")) for n in names]).to(device)
        K = int(gts[0].max())
        H, W = gts.shape[-2:]
        pad = (0, (-W) % 16, 0, (-H) % 16)
        sel = torch.ones(1, K, device=device)
        prob = F.pad(torch.stack([(gts[0] == k + 1).float() for k in range(K)])[None], pad)
        mk, mv, preds = [], [], [gts[0]]
        for t, n in enumerate(names):
            img = F.pad(read_rgb(os.path.join(root, "JPEGImages", "480p", vid, n + ".jpg"))[None].to(device), pad)
            k16, v16, f16, f8, f4 = net.encode_key(img)
            if t > 0:
                _, prob = net.segment(k16, v16, f8, f4, torch.stack(mk, 2), torch.stack(mv, 3), sel, top_k=top_k)
                preds.append(torch.cat([1 - prob.sum(1, keepdim=True), prob], 1)[0, :, :H, :W].argmax(0))
            if t % mem_every == 0:
                mk.append(k16)
                mv.append(net.encode_value(img, f16, prob))
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
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    net = STCN().to(device)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("model", sd)
        sd = {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()}
        net.load_state_dict(sd)
    model = DDP(net, device_ids=[local_rank])

    eff_batch = world * args.accum  # one clip per GPU per micro-step
    lr = args.base_lr * eff_batch / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: min(1.0, (u + 1) / args.warmup_updates) * 0.5 * (1 + math.cos(math.pi * min(u, args.updates) / args.updates)))
    ds = LongClips(args.data, args.clip_len, args.max_objects, args.size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=args.workers, pin_memory=True)
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        print(f"world={world} accum={args.accum} effective batch={eff_batch} lr={lr:.2e}", flush=True)

    micro, updates, epoch, best = 0, 0, 0, -1.0
    tic = time.time()
    while updates < args.updates:
        sampler.set_epoch(epoch)
        for rgb, masks, sel in loader:
            rgb, masks, sel = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), sel.to(device)
            micro += 1
            sync = micro % args.accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(rgb, masks, sel)
                loss = stcn_loss(logits.float(), masks[:, 1:], sel)
                (loss / args.accum).backward()
            if not sync:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1
            if rank == 0 and updates % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), updates)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], updates)
                print(f"update {updates} loss {loss.item():.4f} {(time.time() - tic) / 50:.2f}s/update", flush=True)
                tic = time.time()
            if updates % args.eval_every == 0:
                j = evaluate(net, args.val, device, rank, world)
                if rank == 0:
                    writer.add_scalar("val/J", j, updates)
                    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "updates": updates, "J": j}
                    torch.save(state, os.path.join(args.out, "last.pth"))
                    if j > best:
                        torch.save(state, os.path.join(args.out, "best.pth"))
                best = max(best, j)
            if updates >= args.updates:
                break
        epoch += 1

    # every rank reloads the best weights for a final pass with a denser memory
    dist.barrier()
    if best >= 0:
        net.load_state_dict(torch.load(os.path.join(args.out, "best.pth"), map_location="cpu")["model"])
        j = evaluate(net, args.val, device, rank, world, mem_every=3)
        if rank == 0:
            writer.add_scalar("val/J_final_dense", j, updates)
            print(f"best checkpoint, mem_every=3: J {j:.4f}", flush=True)
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
