"""NYUv2 multi-task dense prediction: 13-class segmentation, depth, surface normals.

Shared DeepLabV3-ResNet50 encoder, one light decoder per task, learned
uncertainty weighting of the three losses.

    torchrun --nproc_per_node=4 06_nyuv2_seg_depth_normals.py \
        --data /datasets/nyuv2 --out /checkpoints/nyu_mtl --batch-size 4
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet50_Weights
from torchvision.models.segmentation import deeplabv3_resnet50

NUM_SEG = 13
IGNORE = 255


class NYUv2(Dataset):
    """Pre-extracted NYUv2: <root>/<split>/{image,label,depth,normal}/<idx>.npy"""

    def __init__(self, root, split, crop=None):
        self.root = os.path.join(root, split)
        self.ids = sorted(f[:-4] for f in os.listdir(os.path.join(self.root, "image")))
        self.crop = crop

    def __len__(self):
        return len(self.ids)

    def _load(self, kind, idx):
        return torch.from_numpy(np.load(os.path.join(self.root, kind, f"{idx}.npy")))

    def __getitem__(self, i):
        idx = self.ids[i]
        img = self._load("image", idx).permute(2, 0, 1).float()
        seg = self._load("label", idx).long()
        depth = self._load("depth", idx).float().unsqueeze(0)
        normal = self._load("normal", idx).permute(2, 0, 1).float()
        if self.crop is not None:
            h, w = seg.shape
            ch, cw = self.crop
            y0, x0 = random.randint(0, h - ch), random.randint(0, w - cw)
            img, depth, normal = (t[:, y0:y0 + ch, x0:x0 + cw] for t in (img, depth, normal))
            seg = seg[y0:y0 + ch, x0:x0 + cw]
            if random.random() < 0.5:
                img, depth, seg = img.flip(-1), depth.flip(-1), seg.flip(-1)
                normal = normal.flip(-1)
                normal[0] = -normal[0]
        return img, seg, depth, normal


class Decoder(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(
            nn.Conv2d(cin, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, cout, 1),
        )


class MTLNet(nn.Module):
    def __init__(self):
        super().__init__()
        base = deeplabv3_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2)
        self.encoder = base.backbone  # dilated ResNet-50, output stride 8
        self.seg_head = Decoder(2048, NUM_SEG)
        self.depth_head = Decoder(2048, 1)
        self.normal_head = Decoder(2048, 3)
        self.log_vars = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        size = x.shape[-2:]
        f = self.encoder(x)["out"]
        up = lambda t: F.interpolate(t, size=size, mode="bilinear", align_corners=False)
        return up(self.seg_head(f)), up(self.depth_head(f)), F.normalize(up(self.normal_head(f)), dim=1)


def task_losses(seg_p, dep_p, nor_p, seg, dep, nor):
    l_seg = F.cross_entropy(seg_p, seg, ignore_index=IGNORE)
    valid = (dep > 0).float()
    l_dep = (torch.abs(dep_p - dep) * valid).sum() / valid.sum().clamp(min=1)
    nvalid = (nor.abs().sum(1, keepdim=True) > 0).float()
    l_nor = (1 - (nor_p * nor).sum(1, keepdim=True)) * nvalid
    l_nor = l_nor.sum() / nvalid.sum().clamp(min=1)
    return torch.stack([l_seg, l_dep, l_nor])


@torch.no_grad()
def evaluate(net, dataset, device, rank, world):
    net.eval()
    # un-padded shard: every test image is counted exactly once after the all_reduce
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=4, num_workers=4)
    conf = torch.zeros(NUM_SEG, NUM_SEG, dtype=torch.long, device=device)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # abs err, depth px, angle err, normal px
    for img, seg, dep, nor in loader:
        img, seg, dep, nor = img.to(device), seg.to(device), dep.to(device), nor.to(device)
        seg_p, dep_p, nor_p = net(img)
        pred = seg_p.argmax(1)
        m = seg != IGNORE
        conf += torch.bincount(seg[m] * NUM_SEG + pred[m], minlength=NUM_SEG ** 2).view(NUM_SEG, NUM_SEG)
        dm = dep > 0
        sums[0] += (dep_p - dep).abs()[dm].sum().double()
        sums[1] += dm.sum()
        nm = nor.abs().sum(1) > 0
        cos = (nor_p * nor).sum(1).clamp(-1, 1)
        sums[2] += torch.rad2deg(torch.acos(cos))[nm].sum().double()
        sums[3] += nm.sum()
    dist.all_reduce(conf)
    dist.all_reduce(sums)
    inter = conf.diag().double()
    union = conf.sum(0).double() + conf.sum(1).double() - inter
    miou = (inter / union.clamp(min=1)).mean().item()
    net.train()
    return {"mIoU": miou, "depth_abs": (sums[0] / sums[1]).item(), "normal_deg": (sums[2] / sums[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--crop", type=int, nargs=2, default=[288, 384])
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)  # crop positions are per-sample augmentation, fine to differ

    train_set = NYUv2(args.data, "train", crop=tuple(args.crop))
    test_set = NYUv2(args.data, "test")
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = MTLNet()
    # 4 images per GPU is far too few for per-GPU batch statistics
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for img, seg, dep, nor in loader:
            img, seg = img.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            dep, nor = dep.to(device, non_blocking=True), nor.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                preds = model(img)
            losses = task_losses(*(p.float() for p in preds), seg, dep, nor)
            s = model.module.log_vars
            loss = (torch.exp(-s) * losses + s).sum()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            agg += losses.detach()
        sched.step()
        dist.all_reduce(agg)
        agg /= world * len(loader)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(model.module, test_set, device, rank, world)
        else:
            metrics = {}
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s seg {agg[0]:.3f} depth {agg[1]:.3f} "
                  f"normal {agg[2]:.3f} sigma {torch.exp(0.5 * model.module.log_vars).tolist()} {metrics}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
