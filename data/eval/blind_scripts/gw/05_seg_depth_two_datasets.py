"""Scene parsing (ADE20K) + monocular depth (NYUv2) with a shared dilated ResNet-50.

Two datasets, two loaders, two heads (ASPP for segmentation, a light decoder for
depth). One batch of each task per step; losses are summed with fixed weights.

    torchrun --nproc_per_node=8 train_seg_depth.py --ade_root /data/ADEChallengeData2016 --nyu_root /data/nyu_depth_v2
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision.models import ResNet50_Weights, resnet50
from torchvision.models.segmentation.deeplabv3 import ASPP

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def to_tensor(img):
    x = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(x.transpose(2, 0, 1).copy())


class ADESeg(Dataset):
    def __init__(self, root, split, crop=512):
        sub = "training" if split == "train" else "validation"
        self.img_dir = os.path.join(root, "images", sub)
        self.ann_dir = os.path.join(root, "annotations", sub)
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.train, self.crop = split == "train", crop

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        lab = Image.open(os.path.join(self.ann_dir, self.names[i] + ".png"))
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = max(int(w * s), self.crop), max(int(h * s), self.crop)
            img, lab = img.resize((nw, nh), Image.BILINEAR), lab.resize((nw, nh), Image.NEAREST)
            x0, y0 = random.randint(0, nw - self.crop), random.randint(0, nh - self.crop)
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            lab = lab.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            if random.random() < 0.5:
                img, lab = img.transpose(Image.FLIP_LEFT_RIGHT), lab.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            img, lab = img.resize((self.crop, self.crop), Image.BILINEAR), lab.resize((self.crop, self.crop), Image.NEAREST)
        # ADE: 0 = other -> 255 ignore, 1..150 -> 0..149
        lab = torch.from_numpy(np.asarray(lab, dtype=np.int64)) - 1
        lab[lab < 0] = 255
        return to_tensor(img), lab


class NYUDepth(Dataset):
    def __init__(self, root, split, size=(448, 576)):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.pairs = [l.split() for l in f if l.strip()]
        self.root, self.size, self.train = root, size, split == "train"

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        rgb, dep = self.pairs[i]
        img = Image.open(os.path.join(self.root, rgb)).convert("RGB").resize(self.size[::-1], Image.BILINEAR)
        d = np.asarray(Image.open(os.path.join(self.root, dep)), dtype=np.float32) / 1000.0
        d = torch.from_numpy(d)[None, None]
        d = F.interpolate(d, size=self.size, mode="nearest")[0]
        x = to_tensor(img)
        if self.train and random.random() < 0.5:
            x, d = x.flip(-1), d.flip(-1)
        return x, d


class SegDepthNet(nn.Module):
    def __init__(self, num_classes=150):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, replace_stride_with_dilation=[False, True, True])
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.seg_head = nn.Sequential(ASPP(2048, [12, 24, 36]), nn.Conv2d(256, 256, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(256), nn.ReLU(inplace=True), nn.Conv2d(256, num_classes, 1))
        self.depth_head = nn.Sequential(nn.Conv2d(2048, 512, 3, padding=1, bias=False), nn.BatchNorm2d(512),
                                        nn.ReLU(inplace=True), nn.Conv2d(512, 128, 3, padding=1, bias=False),
                                        nn.BatchNorm2d(128), nn.ReLU(inplace=True), nn.Conv2d(128, 1, 1))

    def features(self, x):
        return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))

    def forward(self, seg_x, depth_x):
        seg = self.seg_head(self.features(seg_x))
        seg = F.interpolate(seg, size=seg_x.shape[-2:], mode="bilinear", align_corners=False)
        dep = self.depth_head(self.features(depth_x))
        dep = F.interpolate(dep, size=depth_x.shape[-2:], mode="bilinear", align_corners=False)
        return seg, F.softplus(dep)


def silog_loss(pred, gt, lam=0.85):
    valid = gt > 1e-3
    d = torch.log(pred[valid].clamp(min=1e-3)) - torch.log(gt[valid])
    if d.numel() == 0:
        return pred.sum() * 0.0
    return torch.sqrt((d ** 2).mean() - lam * d.mean() ** 2 + 1e-8) * 10.0


@torch.no_grad()
def evaluate(model, ade_val, nyu_val, device, rank, world):
    model.eval()
    conf = torch.zeros(150, 150, device=device, dtype=torch.long)
    for x, y in DataLoader(Subset(ade_val, range(rank, len(ade_val), world)), batch_size=8, num_workers=4):
        x, y = x.to(device), y.to(device)
        p = F.interpolate(model.seg_head(model.features(x)), size=y.shape[-2:], mode="bilinear").argmax(1)
        k = y != 255
        conf += torch.bincount(y[k] * 150 + p[k], minlength=150 * 150).view(150, 150)
    dep = torch.zeros(3, device=device, dtype=torch.float64)  # abs_rel sum, rmse sq sum, n
    for x, d in DataLoader(Subset(nyu_val, range(rank, len(nyu_val), world)), batch_size=8, num_workers=4):
        x, d = x.to(device), d.to(device)
        p = F.softplus(F.interpolate(model.depth_head(model.features(x)), size=d.shape[-2:], mode="bilinear"))
        v = d > 1e-3
        dep[0] += ((p[v] - d[v]).abs() / d[v]).sum()
        dep[1] += ((p[v] - d[v]) ** 2).sum()
        dep[2] += v.sum()
    dist.all_reduce(conf)
    dist.all_reduce(dep)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), (dep[0] / dep[2]).item(), (dep[1] / dep[2]).sqrt().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ade_root", required=True)
    ap.add_argument("--nyu_root", required=True)
    ap.add_argument("--batch_size", type=int, default=2, help="images per task per GPU")
    ap.add_argument("--iters", type=int, default=80000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--depth_weight", type=float, default=1.0)
    ap.add_argument("--eval_every", type=int, default=4000)
    ap.add_argument("--work_dir", default="work_dirs/seg_depth")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    ade_tr, nyu_tr = ADESeg(args.ade_root, "train"), NYUDepth(args.nyu_root, "train")
    ade_va, nyu_va = ADESeg(args.ade_root, "val"), NYUDepth(args.nyu_root, "test")
    s_ade, s_nyu = DistributedSampler(ade_tr, drop_last=True), DistributedSampler(nyu_tr, drop_last=True)
    dl_ade = DataLoader(ade_tr, args.batch_size, sampler=s_ade, num_workers=6, pin_memory=True, drop_last=True)
    dl_nyu = DataLoader(nyu_tr, args.batch_size, sampler=s_nyu, num_workers=4, pin_memory=True, drop_last=True)

    model = SegDepthNet().to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.module.named_parameters() if not n.startswith(("seg_head", "depth_head"))]
    heads = [p for n, p in model.module.named_parameters() if n.startswith(("seg_head", "depth_head"))]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr}, {"params": heads, "lr": args.lr * 10}],
                          lr=args.lr, momentum=0.9, weight_decay=1e-4)
    poly = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / args.iters) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()

    def forever(loader, sampler):
        ep = 0
        while True:
            sampler.set_epoch(ep)
            yield from loader
            ep += 1

    it_ade, it_nyu = forever(dl_ade, s_ade), forever(dl_nyu, s_nyu)
    os.makedirs(args.work_dir, exist_ok=True)
    model.train()
    for it in range(1, args.iters + 1):
        sx, sy = next(it_ade)
        dx, dy = next(it_nyu)
        sx, sy = sx.to(device, non_blocking=True), sy.to(device, non_blocking=True)
        dx, dy = dx.to(device, non_blocking=True), dy.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            seg, dep = model(sx, dx)
            l_seg = F.cross_entropy(seg, sy, ignore_index=255)
        l_dep = silog_loss(dep.float(), dy)
        loss = l_seg + args.depth_weight * l_dep

        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        poly.step()

        if it % 50 == 0:
            rep = torch.stack([l_seg.detach().float(), l_dep.detach()])
            dist.all_reduce(rep, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"it {it} seg {rep[0]:.4f} depth {rep[1]:.4f} lr {poly.get_last_lr()[0]:.2e}", flush=True)
        if it % args.eval_every == 0 or it == args.iters:
            miou, absrel, rmse = evaluate(model.module, ade_va, nyu_va, device, rank, world)
            if rank == 0:
                print(f"[eval it {it}] mIoU {miou:.4f} AbsRel {absrel:.4f} RMSE {rmse:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "it": it,
                            "scaler": scaler.state_dict()}, os.path.join(args.work_dir, f"iter_{it}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
