"""Fine-tune STCN on a domain-specific VOS dataset (DAVIS-style folders), resumable.

    torchrun --nproc_per_node=4 08_stcn_domain_finetune_resume.py --data /data/surgvos --pretrained stcn.pth
    torchrun --nproc_per_node=4 08_stcn_domain_finetune_resume.py --data /data/surgvos --resume runs/surg/last.pth
"""
import argparse
import math
import os
import random

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


def read_rgb(path):
    return (torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD


def read_label(path):
    return torch.from_numpy(np.asarray(Image.open(path), dtype=np.int64))


class SplitClips(Dataset):
    """<root>/JPEGImages/<vid>/*.jpg, <root>/Annotations/<vid>/*.png, <root>/ImageSets/{train,val}.txt"""

    def __init__(self, root, split, num_frames=3, max_objects=3, size=384, max_skip=10):
        self.root, self.T, self.K, self.S, self.skip = root, num_frames, max_objects, size, max_skip
        with open(os.path.join(root, "ImageSets", f"{split}.txt")) as f:
            self.videos = [l.strip() for l in f if l.strip()]
        self.frames = {v: sorted(n[:-4] for n in os.listdir(os.path.join(root, "JPEGImages", v))) for v in self.videos}

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vid = self.videos[i]
        names = self.frames[vid]
        for _ in range(5):
            a = random.randint(0, len(names) - 1)
            idx = sorted({a, *(min(len(names) - 1, max(0, a + random.randint(-self.skip, self.skip))) for _ in range(self.T - 1))})
            while len(idx) < self.T:
                idx = sorted(set(idx) | {random.randint(0, len(names) - 1)})
            if random.random() < 0.5:
                idx = idx[::-1]
            rgb = torch.stack([read_rgb(os.path.join(self.root, "JPEGImages", vid, names[j] + ".jpg")) for j in idx])
            lab = torch.stack([read_label(os.path.join(self.root, "Annotations", vid, names[j] + ".png")) for j in idx])
            H, W = lab.shape[-2:]
            scale = self.S / min(H, W) * random.uniform(1.0, 1.3)
            nh, nw = max(self.S, int(H * scale)), max(self.S, int(W * scale))
            rgb = F.interpolate(rgb, size=(nh, nw), mode="bilinear", align_corners=False)
            lab = F.interpolate(lab[:, None].float(), size=(nh, nw), mode="nearest")[:, 0].long()
            y, x = random.randint(0, nh - self.S), random.randint(0, nw - self.S)
            rgb, lab = rgb[..., y:y + self.S, x:x + self.S], lab[..., y:y + self.S, x:x + self.S]
            ids = [o for o in lab[0].unique().tolist() if o != 0]
            if ids:
                break
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


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        random.seed(args.seed + self.rank)
        torch.manual_seed(args.seed)

        self.net = STCN().to(self.device)
        if args.pretrained:
            self.net.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, weight_decay=1e-7)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, [int(args.epochs * 0.8)], 0.1)
        self.train_set = SplitClips(args.data, "train", max_objects=args.max_objects)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=args.workers, pin_memory=True, drop_last=True)
        self.writer = SummaryWriter(os.path.join(args.out, "tb")) if self.rank == 0 else None
        self.start_epoch, self.best = 0, -1.0
        if args.resume:
            self.load(args.resume)

    def load(self, path):
        ckpt = torch.load(path)
        self.net.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.start_epoch, self.best = ckpt["epoch"] + 1, ckpt["best"]

    def save(self, epoch, name):
        if self.rank != 0:
            return
        torch.save({"model": self.net.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "epoch": epoch, "best": self.best},
                   os.path.join(self.args.out, name))

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        for it, (rgb, masks, sel) in enumerate(self.loader):
            rgb, masks, sel = (x.to(self.device, non_blocking=True) for x in (rgb, masks, sel))
            logits = self.model(rgb, masks, sel)
            labels = torch.cat([torch.full_like(masks[:, 1:, :1], 0.5), masks[:, 1:]], 2).argmax(2)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.rank == 0 and it % 20 == 0:
                step = epoch * len(self.loader) + it
                self.writer.add_scalar("train/ce", loss.item(), step)
        self.sched.step()

    @torch.no_grad()
    def validate(self):
        root = self.args.data
        vids = open(os.path.join(root, "ImageSets", "val.txt")).read().split()
        acc = torch.zeros(2, device=self.device)
        net = self.net.eval()
        for vid in vids[self.rank::self.world]:
            names = sorted(n[:-4] for n in os.listdir(os.path.join(root, "JPEGImages", vid)))
            gts = torch.stack([read_label(os.path.join(root, "Annotations", vid, n + ".png")) for n in names]).to(self.device)
            K = int(gts[0].max())
            H, W = gts.shape[-2:]
            pad = (0, (-W) % 16, 0, (-H) % 16)
            sel = torch.ones(1, K, device=self.device)
            prob = F.pad(torch.stack([(gts[0] == k + 1).float() for k in range(K)])[None], pad)
            mk, mv, preds = [], [], [gts[0]]
            for t, n in enumerate(names):
                img = F.pad(read_rgb(os.path.join(root, "JPEGImages", vid, n + ".jpg"))[None].to(self.device), pad)
                k16, v16, f16, f8, f4 = net.encode_key(img)
                if t > 0:
                    _, prob = net.segment(k16, v16, f8, f4, torch.stack(mk, 2), torch.stack(mv, 3), sel, top_k=20)
                    preds.append(torch.cat([1 - prob.sum(1, keepdim=True), prob], 1)[0, :, :H, :W].argmax(0))
                if t % 5 == 0:
                    mk.append(k16)
                    mv.append(net.encode_value(img, f16, prob))
            pred = torch.stack(preds)
            for k in range(1, K + 1):
                p, g = pred[1:] == k, gts[1:] == k
                u = (p | g).flatten(1).sum(1).float()
                acc[0] += torch.where(u > 0, (p & g).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean()
                acc[1] += 1
        dist.all_reduce(acc)
        net.train()
        return (acc[0] / acc[1].clamp(min=1)).item()

    def run(self):
        if self.rank == 0:
            os.makedirs(self.args.out, exist_ok=True)
        for epoch in range(self.start_epoch, self.args.epochs):
            self.train_epoch(epoch)
            j = self.validate()
            if self.rank == 0:
                self.writer.add_scalar("val/J", j, epoch)
                print(f"epoch {epoch}: val J {j:.4f} (best {max(self.best, j):.4f})", flush=True)
            if j > self.best:
                self.best = j
                self.save(epoch, "best.pth")
            self.save(epoch, "last.pth")
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/surg")
    ap.add_argument("--pretrained", default="")
    ap.add_argument("--resume", default="")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-objects", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3407)
    Trainer(ap.parse_args()).run()
