"""STCN main training with a max-jump curriculum (YouTube-VOS + DAVIS), evaluated with J&F on DAVIS-17 val.

    torchrun --nproc_per_node=8 20_stcn_curriculum_jf.py --pretrained saves/stcn_static.pth --exp main_s03
"""
import argparse
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
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models
from torchvision.ops import FrozenBatchNorm2d

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--exp", default="main")
    p.add_argument("--yv", default="/data/YouTube/train_480p")
    p.add_argument("--davis", default="/data/DAVIS/2017/trainval")
    p.add_argument("--pretrained", default="")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-objects", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read_rgb(path):
    return (torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD


def read_label(path):
    return torch.from_numpy(np.asarray(Image.open(path), dtype=np.int64))


class TripletDataset(Dataset):
    """Three frames per sample, at most `max_jump` apart; the jump grows during training (curriculum)."""

    def __init__(self, im_root, gt_root, max_objects, size=384, subset=None):
        self.im_root, self.gt_root, self.K, self.S = im_root, gt_root, max_objects, size
        self.max_jump = 5
        self.videos = []
        for v in sorted(os.listdir(gt_root)):
            if subset is not None and v not in subset:
                continue
            names = sorted(n[:-4] for n in os.listdir(os.path.join(gt_root, v)))
            if len(names) >= 3:
                self.videos.append((v, names))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        for _ in range(5):
            n = len(names)
            jump = min(self.max_jump, n - 1)
            a = random.randint(0, n - 1)
            b = min(n - 1, max(0, a + random.randint(-jump, jump)))
            c = min(n - 1, max(0, b + random.randint(-jump, jump)))
            idx = [a, b, c] if random.random() < 0.5 else [c, b, a]
            rgb = torch.stack([read_rgb(os.path.join(self.im_root, v, names[j] + ".jpg")) for j in idx])
            lab = torch.stack([read_label(os.path.join(self.gt_root, v, names[j] + ".png")) for j in idx])
            H, W = lab.shape[-2:]
            sc = self.S / min(H, W) * random.uniform(1.0, 1.4)
            nh, nw = max(self.S, int(H * sc)), max(self.S, int(W * sc))
            rgb = F.interpolate(rgb, size=(nh, nw), mode="bilinear", align_corners=False)
            lab = F.interpolate(lab[:, None].float(), size=(nh, nw), mode="nearest")[:, 0].long()
            y, x = random.randint(0, nh - self.S), random.randint(0, nw - self.S)
            rgb, lab = rgb[..., y:y + self.S, x:x + self.S], lab[..., y:y + self.S, x:x + self.S]
            ids = [o for o in lab[0].unique().tolist() if o not in (0, 255)]
            if ids:
                break
        ids = random.sample(ids, min(self.K, len(ids)))
        masks = torch.zeros(3, self.K, self.S, self.S)
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


def boundary_f(p, g, tol=3):
    def edge(m):
        m = m.float()[:, None]
        return (m + F.max_pool2d(-m, 3, 1, 1))[:, 0] > 0

    def dil(m):
        return F.max_pool2d(m.float()[:, None], 2 * tol + 1, 1, tol)[:, 0] > 0

    pe, ge = edge(p), edge(g)
    prec = (pe & dil(ge)).flatten(1).sum(1) / pe.flatten(1).sum(1).clamp(min=1)
    rec = (ge & dil(pe)).flatten(1).sum(1) / ge.flatten(1).sum(1).clamp(min=1)
    f = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    both_empty = (pe.flatten(1).sum(1) == 0) & (ge.flatten(1).sum(1) == 0)
    return torch.where(both_empty, torch.ones_like(f), f).mean()


@torch.no_grad()
def evaluate(net, root, device, rank, world, mem_every=5):
    vids = open(os.path.join(root, "ImageSets", "2017", "val.txt")).read().split()
    acc = torch.zeros(3, device=device)
    net.eval()
    for vid in vids[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "JPEGImages", "480p", vid)))
        gts = torch.stack([read_label(os.path.join(root, "Annotations", "480p", vid, n + ".png")) for n in names]).to(device)
        K, (H, W) = int(gts[0].max()), gts.shape[-2:]
        pad = (0, (-W) % 16, 0, (-H) % 16)
        sel = torch.ones(1, K, device=device)
        prob = F.pad(torch.stack([(gts[0] == k + 1).float() for k in range(K)])[None], pad)
        mk, mv, preds = [], [], [gts[0]]
        for t, n in enumerate(names):
            img = F.pad(read_rgb(os.path.join(root, "JPEGImages", "480p", vid, n + ".jpg"))[None].to(device), pad)
            k16, v16, f16, f8, f4 = net.encode_key(img)
            if t > 0:
                _, prob = net.segment(k16, v16, f8, f4, torch.stack(mk, 2), torch.stack(mv, 3), sel, top_k=20)
                preds.append(torch.cat([1 - prob.sum(1, keepdim=True), prob], 1)[0, :, :H, :W].argmax(0))
            if t % mem_every == 0:
                mk.append(k16)
                mv.append(net.encode_value(img, f16, prob))
        pred = torch.stack(preds)
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).flatten(1).sum(1).float()
            acc[0] += torch.where(u > 0, (p & g).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean()
            acc[1] += boundary_f(p, g)
            acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(14159265 + rank)
    torch.manual_seed(14159265)

    net = STCN().to(device)
    if args.pretrained:
        net.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-7)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.8)], 0.1)

    yv = TripletDataset(os.path.join(args.yv, "JPEGImages"), os.path.join(args.yv, "Annotations"), args.max_objects)
    davis = TripletDataset(os.path.join(args.davis, "JPEGImages", "480p"), os.path.join(args.davis, "Annotations", "480p"),
                           args.max_objects, subset=set(open(os.path.join(args.davis, "ImageSets/2017/train.txt")).read().split()))
    parts = [yv] + [davis] * 5
    train_set = ConcatDataset(parts)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=False)
    save_dir = os.path.join("saves", args.exp)
    writer = None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join("logs", args.exp))
        print(f"{len(train_set)} samples/epoch, {len(loader)} iterations/epoch", flush=True)

    it = 0
    for epoch in range(args.epochs):
        # curriculum: the allowed gap between the three frames grows to 25 and then shrinks back to 5
        progress = epoch / args.epochs
        jump = 5 + int(20 * math.sin(math.pi * min(progress / 0.9, 1.0)))
        for d in (yv, davis):
            d.max_jump = jump
        tic = time.time()
        for rgb, masks, sel in loader:
            rgb, masks, sel = rgb.to(device, non_blocking=True), masks.to(device, non_blocking=True), sel.to(device)
            logits = model(rgb, masks, sel)
            labels = torch.cat([torch.full_like(masks[:, 1:, :1], 0.5), masks[:, 1:]], 2).argmax(2)
            raw = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="none").flatten(1)
            p = 1.0 if epoch < 5 else max(0.15, 1.0 - 0.85 * (epoch - 5) / 15)
            loss = raw.topk(int(raw.shape[1] * p), dim=1).values.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1
            if writer is not None and it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                writer.add_scalar("train/max_jump", jump, it)
                print(f"ep {epoch} it {it} loss {loss.item():.4f} {(time.time() - tic) / 100:.2f}s/it", flush=True)
                tic = time.time()
        sched.step()
        if (epoch + 1) % 5 == 0:
            j, f = evaluate(net, args.davis, device, rank, world)
            if rank == 0:
                writer.add_scalar("val/J", j, it)
                writer.add_scalar("val/F", f, it)
                writer.add_scalar("val/JF", (j + f) / 2, it)
                torch.save(net.state_dict(), os.path.join(save_dir, f"model_ep{epoch}.pth"))
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
