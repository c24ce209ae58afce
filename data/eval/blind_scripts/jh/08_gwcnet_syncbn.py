"""GwcNet-style stereo (group-wise correlation volume, 3D aggregation) on SceneFlow.

Multi-GPU with torchrun; SyncBatchNorm because each GPU only holds 1-2 crops:
    torchrun --nproc_per_node=8 08_gwcnet_syncbn.py --data /data/sceneflow --batch_size 2
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from datasets import SceneFlowDataset  # yields dict(left, right, disparity) as float tensors


def conv_bn_relu(cin, cout, k=3, s=1, p=1, dim=2):
    Conv = nn.Conv2d if dim == 2 else nn.Conv3d
    BN = nn.BatchNorm2d if dim == 2 else nn.BatchNorm3d
    return nn.Sequential(Conv(cin, cout, k, s, p, bias=False), BN(cout), nn.ReLU(inplace=True))


class FeatureNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            conv_bn_relu(3, 32, 3, 2, 1), conv_bn_relu(32, 32), conv_bn_relu(32, 64, 3, 2, 1),
            conv_bn_relu(64, 64), conv_bn_relu(64, 128), conv_bn_relu(128, 128),
            nn.Conv2d(128, 320, 3, 1, 1, bias=False))

    def forward(self, x):
        return self.layers(x)


def groupwise_correlation_volume(fl, fr, maxdisp, groups):
    b, c, h, w = fl.shape
    cpg = c // groups
    vol = fl.new_zeros(b, groups, maxdisp, h, w)
    for d in range(maxdisp):
        if d > 0:
            vol[:, :, d, :, d:] = (fl[..., d:] * fr[..., :-d]).view(b, groups, cpg, h, w - d).mean(2)
        else:
            vol[:, :, d] = (fl * fr).view(b, groups, cpg, h, w).mean(2)
    return vol.contiguous()


class Hourglass(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.down1 = conv_bn_relu(c, 2 * c, 3, 2, 1, dim=3)
        self.down2 = conv_bn_relu(2 * c, 4 * c, 3, 2, 1, dim=3)
        self.up2 = nn.Sequential(nn.ConvTranspose3d(4 * c, 2 * c, 3, 2, 1, output_padding=1, bias=False),
                                 nn.BatchNorm3d(2 * c))
        self.up1 = nn.Sequential(nn.ConvTranspose3d(2 * c, c, 3, 2, 1, output_padding=1, bias=False),
                                 nn.BatchNorm3d(c))

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(d1)
        u2 = F.relu(self.up2(d2) + d1)
        return F.relu(self.up1(u2) + x)


class GwcNet(nn.Module):
    def __init__(self, maxdisp=192, groups=40, n_hourglass=3):
        super().__init__()
        self.maxdisp, self.groups = maxdisp, groups
        self.feature = FeatureNet()
        self.dres0 = nn.Sequential(conv_bn_relu(groups, 32, dim=3), conv_bn_relu(32, 32, dim=3))
        self.hourglasses = nn.ModuleList([Hourglass(32) for _ in range(n_hourglass)])
        self.heads = nn.ModuleList([
            nn.Sequential(conv_bn_relu(32, 32, dim=3), nn.Conv3d(32, 1, 3, 1, 1, bias=False))
            for _ in range(n_hourglass + 1)])

    def regress(self, cost, size):
        cost = F.interpolate(cost, [self.maxdisp, size[0], size[1]], mode="trilinear", align_corners=False)
        prob = F.softmax(cost.squeeze(1), dim=1)
        disp = torch.arange(self.maxdisp, device=prob.device, dtype=prob.dtype).view(1, -1, 1, 1)
        return (prob * disp).sum(1)

    def forward(self, left, right):
        fl, fr = self.feature(left), self.feature(right)
        vol = groupwise_correlation_volume(fl, fr, self.maxdisp // 4, self.groups)
        x = self.dres0(vol)
        size = left.shape[-2:]
        outs = [self.regress(self.heads[0](x), size)]
        for hg, head in zip(self.hourglasses, self.heads[1:]):
            x = hg(x)
            outs.append(self.regress(head(x), size))
        # training: all intermediate estimates get deep supervision; eval: last only
        return outs if self.training else outs[-1]


def model_loss(preds, gt, mask, weights=(0.5, 0.5, 0.7, 1.0)):
    return sum(w * F.smooth_l1_loss(p[mask], gt[mask], reduction="mean") for w, p in zip(weights, preds))


@torch.no_grad()
def evaluate(model, loader, maxdisp, device):
    model.eval()
    per_image = []  # (epe, d1, >1px) per test pair on this rank
    for batch in loader:
        left, right, gt = (batch[k].to(device, non_blocking=True) for k in ("left", "right", "disparity"))
        pred = model(left, right)
        for p, g in zip(pred, gt):
            m = (g > 0) & (g < maxdisp)
            if m.sum() == 0:
                continue
            err = (p[m] - g[m]).abs()
            per_image.append((err.mean().item(),
                              ((err > 3) & (err > 0.05 * g[m])).float().mean().item(),
                              (err > 1).float().mean().item()))
    # ranks can hold different numbers of valid pairs; gather python lists
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_image)
    model.train()
    flat = np.array([r for part in gathered for r in part])
    return {"epe": flat[:, 0].mean(), "d1": 100 * flat[:, 1].mean(), "bad1": 100 * flat[:, 2].mean()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--maxdisp", type=int, default=192)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr_milestones", type=int, nargs="+", default=[10, 12, 14])
    ap.add_argument("--logdir", default="runs/gwcnet")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--amp", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    model = GwcNet(args.maxdisp)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.lr_milestones, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{local_rank}"})
        state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ckpt["model"].items()}
        model.module.load_state_dict(state)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    train_set = SceneFlowDataset(args.data, "train", crop=(256, 512))
    test_set = SceneFlowDataset(args.data, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # equal number of test forwards on every rank (DDP forward still syncs buffers)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
    test_loader = DataLoader(test_set, 1, sampler=test_sampler, num_workers=4, pin_memory=True)

    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for it, batch in enumerate(train_loader):
            left, right, gt = (batch[k].to(device, non_blocking=True) for k in ("left", "right", "disparity"))
            mask = (gt > 0) & (gt < args.maxdisp)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                preds = model(left, right)
            loss = model_loss([p.float() for p in preds], gt, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)
        metrics = evaluate(model, test_loader, args.maxdisp, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"test epe {metrics['epe']:.3f} d1 {metrics['d1']:.2f}% >1px {metrics['bad1']:.2f}% "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.logdir, f"checkpoint_{epoch:03d}.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
