# PSMNet-style stereo matching on SceneFlow (FlyingThings3D + Driving + Monkaa).
# torchrun --nnodes=1 --nproc_per_node=8 02_psmnet_sceneflow.py --datapath /data/sceneflow
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from datasets.sceneflow import SceneFlowList, StereoDataset  # local package

log = logging.getLogger("psmnet")


def convbn(cin, cout, k, s, pad, dil):
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, s, padding=dil if dil > 1 else pad, dilation=dil, bias=False),
        nn.BatchNorm2d(cout))


def convbn_3d(cin, cout, k, s, pad):
    return nn.Sequential(nn.Conv3d(cin, cout, k, s, pad, bias=False), nn.BatchNorm3d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, downsample, pad, dil):
        super().__init__()
        self.conv1 = nn.Sequential(convbn(cin, cout, 3, stride, pad, dil), nn.ReLU(inplace=True))
        self.conv2 = convbn(cout, cout, 3, 1, pad, dil)
        self.downsample = downsample

    def forward(self, x):
        out = self.conv2(self.conv1(x))
        if self.downsample is not None:
            x = self.downsample(x)
        return out + x


class FeatureExtraction(nn.Module):
    def __init__(self):
        super().__init__()
        self.firstconv = nn.Sequential(
            convbn(3, 32, 3, 2, 1, 1), nn.ReLU(inplace=True),
            convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True),
            convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True))
        self.layer1 = self._make_layer(32, 32, 3, 1, 1, 1)
        self.layer2 = self._make_layer(32, 64, 8, 2, 1, 1)
        self.layer3 = self._make_layer(64, 128, 3, 1, 1, 2)
        self.lastconv = nn.Sequential(
            convbn(128 + 64, 128, 3, 1, 1, 1), nn.ReLU(inplace=True),
            nn.Conv2d(128, 32, 1, bias=False))

    @staticmethod
    def _make_layer(cin, cout, blocks, stride, pad, dil):
        down = None
        if stride != 1 or cin != cout:
            down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        layers = [BasicBlock(cin, cout, stride, down, pad, dil)]
        layers += [BasicBlock(cout, cout, 1, None, pad, dil) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.firstconv(x)
        x = self.layer1(x)
        l2 = self.layer2(x)
        l3 = self.layer3(l2)
        return self.lastconv(torch.cat([l2, l3], 1))


class PSMNetBasic(nn.Module):
    def __init__(self, maxdisp=192):
        super().__init__()
        self.maxdisp = maxdisp
        self.feature = FeatureExtraction()
        self.dres0 = nn.Sequential(convbn_3d(64, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True))
        self.dres1 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1))
        self.classify = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv3d(32, 1, 3, 1, 1, bias=False))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def build_concat_volume(self, fl, fr):
        b, c, h, w = fl.shape
        d = self.maxdisp // 4
        cost = fl.new_zeros(b, 2 * c, d, h, w)
        for i in range(d):
            if i > 0:
                cost[:, :c, i, :, i:] = fl[:, :, :, i:]
                cost[:, c:, i, :, i:] = fr[:, :, :, :-i]
            else:
                cost[:, :c, i] = fl
                cost[:, c:, i] = fr
        return cost.contiguous()

    def forward(self, left, right):
        fl, fr = self.feature(left), self.feature(right)
        cost = self.build_concat_volume(fl, fr)
        cost0 = self.dres0(cost)
        cost0 = self.dres1(cost0) + cost0
        cost = self.classify(cost0)
        cost = F.interpolate(cost, [self.maxdisp, left.size(2), left.size(3)],
                             mode="trilinear", align_corners=False).squeeze(1)
        prob = F.softmax(cost, dim=1)
        disp_values = torch.arange(self.maxdisp, device=prob.device, dtype=prob.dtype)
        return torch.sum(prob * disp_values.view(1, -1, 1, 1), dim=1)


def get_args():
    ap = argparse.ArgumentParser("PSMNet SceneFlow")
    ap.add_argument("--datapath", default="/data/sceneflow")
    ap.add_argument("--maxdisp", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch_size", type=int, default=2, help="per process")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--crop", type=int, nargs=2, default=[256, 512])
    ap.add_argument("--savemodel", default="./runs/psmnet_sf")
    ap.add_argument("--loadmodel", default=None)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_l, train_r, train_d, test_l, test_r, test_d = SceneFlowList(args.datapath)
    train_set = StereoDataset(train_l, train_r, train_d, training=True, crop=tuple(args.crop))
    test_set = StereoDataset(test_l, test_r, test_d, training=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    # strided shard of the test split: no padding duplicates, every pair seen exactly once
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=1, shuffle=False, num_workers=4)

    model = PSMNetBasic(args.maxdisp).cuda()
    if args.loadmodel:
        state = torch.load(args.loadmodel, map_location="cpu")
        model.load_state_dict(state["state_dict"])
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    if rank == 0:
        os.makedirs(args.savemodel, exist_ok=True)
        log.info("params: %.2fM, world %d, global batch %d",
                 sum(p.numel() for p in model.parameters()) / 1e6, world, args.batch_size * world)

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        lr = args.lr if epoch <= 10 else args.lr * 0.1
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        total = torch.zeros(2, device="cuda")
        for it, (imgL, imgR, dispL) in enumerate(train_loader):
            imgL, imgR = imgL.cuda(non_blocking=True), imgR.cuda(non_blocking=True)
            dispL = dispL.cuda(non_blocking=True)
            mask = (dispL < args.maxdisp) & (dispL > 0)
            pred = model(imgL, imgR)
            loss = F.smooth_l1_loss(pred[mask], dispL[mask], reduction="mean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device="cuda")])
            if it % 200 == 0:
                log.info("epoch %d iter %d loss %.4f", epoch, it, loss.item())
        dist.all_reduce(total)
        log.info("epoch %d mean train loss %.4f", epoch, (total[0] / total[1]).item())

        # test: end-point error on the full SceneFlow test split
        model.eval()
        stats = torch.zeros(2, device="cuda", dtype=torch.float64)
        with torch.no_grad():
            for imgL, imgR, dispL in test_loader:
                imgL, imgR, dispL = imgL.cuda(), imgR.cuda(), dispL.cuda()
                pred = model.module(imgL, imgR)
                mask = (dispL < args.maxdisp) & (dispL > 0)
                if mask.any():
                    stats[0] += (pred[mask] - dispL[mask]).abs().mean().double()
                    stats[1] += 1
        dist.all_reduce(stats)
        log.info("epoch %d test EPE %.4f", epoch, (stats[0] / stats[1].clamp(min=1)).item())

        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.savemodel, f"checkpoint_{epoch}.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
