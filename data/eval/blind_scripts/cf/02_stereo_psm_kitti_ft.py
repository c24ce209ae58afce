"""PSMNet-style stereo matching: SceneFlow pretraining and KITTI 2015 finetuning (DDP).

Pretrain:  torchrun --nproc_per_node=4 train_psm.py --stage sceneflow --epochs 10
Finetune:  torchrun --nproc_per_node=4 train_psm.py --stage kitti --epochs 300 \
               --loadmodel ckpt/psm_sceneflow_9.tar
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from dataloader import listflowfile, readpfm


def convbn(in_planes, out_planes, kernel_size, stride, pad, dilation=1):
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size, stride, dilation if dilation > 1 else pad, dilation, bias=False),
        nn.BatchNorm2d(out_planes))


def convbn_3d(in_planes, out_planes, kernel_size, stride, pad):
    return nn.Sequential(nn.Conv3d(in_planes, out_planes, kernel_size, stride, pad, bias=False),
                         nn.BatchNorm3d(out_planes))


class FeatureExtraction(nn.Module):
    def __init__(self):
        super().__init__()
        self.firstconv = nn.Sequential(convbn(3, 32, 3, 2, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 64, 3, 2, 1), nn.ReLU(inplace=True))
        self.layer = nn.Sequential(convbn(64, 64, 3, 1, 1, 2), nn.ReLU(inplace=True),
                                   convbn(64, 64, 3, 1, 1, 4), nn.ReLU(inplace=True))
        self.lastconv = nn.Sequential(convbn(128, 64, 3, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv2d(64, 32, 1, bias=False))

    def forward(self, x):
        x = self.firstconv(x)
        y = self.layer(x)
        return self.lastconv(torch.cat([x, y], 1))


class Hourglass(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Sequential(convbn_3d(c, c * 2, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(convbn_3d(c * 2, c * 2, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv3 = nn.Sequential(
            nn.ConvTranspose3d(c * 2, c, 3, padding=1, output_padding=1, stride=2, bias=False),
            nn.BatchNorm3d(c))

    def forward(self, x):
        out = self.conv2(self.conv1(x))
        return F.relu(self.conv3(out) + x, inplace=True)


class PSMNet(nn.Module):
    def __init__(self, maxdisp):
        super().__init__()
        self.maxdisp = maxdisp
        self.feature_extraction = FeatureExtraction()
        self.dres0 = nn.Sequential(convbn_3d(64, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True))
        self.dres2 = Hourglass(32)
        self.dres3 = Hourglass(32)
        self.dres4 = Hourglass(32)
        self.classif1 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv3d(32, 1, 3, padding=1, bias=False))
        self.classif2 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv3d(32, 1, 3, padding=1, bias=False))
        self.classif3 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv3d(32, 1, 3, padding=1, bias=False))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def build_cost(self, ref, tgt):
        B, C, H, W = ref.shape
        D = self.maxdisp // 4
        cost = ref.new_zeros(B, C * 2, D, H, W)
        for i in range(D):
            if i > 0:
                cost[:, :C, i, :, i:] = ref[:, :, :, i:]
                cost[:, C:, i, :, i:] = tgt[:, :, :, :-i]
            else:
                cost[:, :C, i] = ref
                cost[:, C:, i] = tgt
        return cost.contiguous()

    def regress(self, cost, size):
        cost = F.interpolate(cost, [self.maxdisp, size[0], size[1]], mode="trilinear", align_corners=False)
        prob = F.softmax(torch.squeeze(cost, 1), dim=1)
        disp = torch.arange(self.maxdisp, device=prob.device, dtype=prob.dtype).view(1, -1, 1, 1)
        return torch.sum(prob * disp, 1)

    def forward(self, left, right):
        ref, tgt = self.feature_extraction(left), self.feature_extraction(right)
        cost0 = self.dres0(self.build_cost(ref, tgt))
        out1 = self.dres2(cost0)
        out2 = self.dres3(out1)
        out3 = self.dres4(out2)
        cost3 = self.classif3(out3)
        pred3 = self.regress(cost3, left.shape[-2:])
        if not self.training:
            return pred3
        pred1 = self.regress(self.classif1(out1), left.shape[-2:])
        pred2 = self.regress(self.classif2(out2) + cost3, left.shape[-2:])
        return pred1, pred2, pred3


class KITTI2015(Dataset):
    def __init__(self, root, indices, training):
        self.root, self.indices, self.training = root, indices, training

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        name = "%06d_10.png" % self.indices[i]
        left = Image.open(os.path.join(self.root, "image_2", name)).convert("RGB")
        right = Image.open(os.path.join(self.root, "image_3", name)).convert("RGB")
        disp = np.ascontiguousarray(Image.open(os.path.join(self.root, "disp_occ_0", name)), dtype=np.float32) / 256.0
        left, right = np.asarray(left, np.float32) / 255.0, np.asarray(right, np.float32) / 255.0
        h, w = disp.shape
        if self.training:
            th, tw = 256, 512
            y1, x1 = random.randint(0, h - th), random.randint(0, w - tw)
            left, right = left[y1:y1 + th, x1:x1 + tw], right[y1:y1 + th, x1:x1 + tw]
            disp = disp[y1:y1 + th, x1:x1 + tw]
        else:
            left, right, disp = left[h - 368:, w - 1232:], right[h - 368:, w - 1232:], disp[h - 368:, w - 1232:]
        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        left = torch.from_numpy(((left - mean) / std).transpose(2, 0, 1).copy()).float()
        right = torch.from_numpy(((right - mean) / std).transpose(2, 0, 1).copy()).float()
        return left, right, torch.from_numpy(disp.copy())


class SceneFlow(Dataset):
    def __init__(self, left, right, disp):
        self.left, self.right, self.disp = left, right, disp

    def __len__(self):
        return len(self.left)

    def __getitem__(self, i):
        l = np.asarray(Image.open(self.left[i]).convert("RGB"), np.float32) / 255.0
        r = np.asarray(Image.open(self.right[i]).convert("RGB"), np.float32) / 255.0
        d, _ = readpfm.readPFM(self.disp[i])
        d = np.ascontiguousarray(d, dtype=np.float32)
        h, w = d.shape
        y1, x1 = random.randint(0, h - 256), random.randint(0, w - 512)
        l, r, d = l[y1:y1 + 256, x1:x1 + 512], r[y1:y1 + 256, x1:x1 + 512], d[y1:y1 + 256, x1:x1 + 512]
        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        l = torch.from_numpy(((l - mean) / std).transpose(2, 0, 1).copy()).float()
        r = torch.from_numpy(((r - mean) / std).transpose(2, 0, 1).copy()).float()
        return l, r, torch.from_numpy(d.copy())


def main():
    parser = argparse.ArgumentParser(description="PSMNet")
    parser.add_argument("--stage", choices=["sceneflow", "kitti"], default="sceneflow")
    parser.add_argument("--maxdisp", type=int, default=192)
    parser.add_argument("--datapath", default="/data/kitti2015/training/")
    parser.add_argument("--sceneflow_path", default="/data/sceneflow/")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=3, help="per GPU")
    parser.add_argument("--loadmodel", default=None)
    parser.add_argument("--savemodel", default="ckpt/")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    if args.stage == "kitti":
        train_set = KITTI2015(args.datapath, list(range(0, 160)), True)
        val_set = KITTI2015(args.datapath, list(range(160, 200)), False)
    else:
        all_left, all_right, all_disp, test_left, test_right, test_disp = listflowfile.dataloader(args.sceneflow_path)
        train_set = SceneFlow(all_left, all_right, all_disp)
        val_set = None

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = PSMNet(args.maxdisp)
    if args.loadmodel is not None:
        state = torch.load(args.loadmodel, map_location="cpu")
        model.load_state_dict(state["state_dict"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, betas=(0.9, 0.999))

    os.makedirs(args.savemodel, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        lr = 0.001 if (args.stage == "sceneflow" or epoch < 200) else 0.0001
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        total, n = torch.zeros(2, device="cuda"), 0
        for left, right, disp in loader:
            left, right, disp = left.cuda(non_blocking=True), right.cuda(non_blocking=True), disp.cuda(non_blocking=True)
            mask = (disp > 0) & (disp < args.maxdisp)
            mask.detach_()
            optimizer.zero_grad()
            pred1, pred2, pred3 = model(left, right)
            if args.stage == "kitti":
                loss = F.smooth_l1_loss(pred3[mask], disp[mask], reduction="mean")
            else:
                loss = (0.5 * F.smooth_l1_loss(pred1[mask], disp[mask])
                        + 0.7 * F.smooth_l1_loss(pred2[mask], disp[mask])
                        + F.smooth_l1_loss(pred3[mask], disp[mask]))
            loss.backward()
            optimizer.step()
            total[0] += loss.detach()
            total[1] += 1
        dist.all_reduce(total)
        if rank == 0:
            print("epoch %d  train loss %.4f" % (epoch, (total[0] / total[1]).item()))

        if val_set is not None and (epoch + 1) % 10 == 0:
            model.eval()
            err = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for i in range(rank, len(val_set), world):
                    l, r, d = val_set[i]
                    pred = model.module(l[None].cuda(), r[None].cuda())[0]
                    d = d.cuda()
                    valid = d > 0
                    e = (pred - d).abs()
                    bad = (e > 3) & (e > 0.05 * d)
                    err[0] += bad[valid].float().sum()
                    err[1] += valid.float().sum()
            dist.all_reduce(err)
            if rank == 0:
                print("epoch %d  D1-all %.3f%%" % (epoch, 100 * (err[0] / err[1]).item()))

        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                       os.path.join(args.savemodel, "psm_%s_%d.tar" % (args.stage, epoch)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
