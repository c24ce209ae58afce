"""Lift-Splat-Shoot (Philion & Fidler, 2020) vehicle segmentation, ported to DistributedDataParallel.

Model code follows the reference implementation (EfficientNet-B0 trunk, QuickCumsum pooling).

    torchrun --nproc_per_node=4 14_lss_effb0_ddp_port.py --dataroot /data/nuscenes --logdir ./runs/lss_ddp
"""
import argparse
import os
import pickle
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from efficientnet_pytorch import EfficientNet
from PIL import Image
from tensorboardX import SummaryWriter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.resnet import resnet18
from torchvision.transforms import Normalize, ToTensor

GRID = {"xbound": [-50.0, 50.0, 0.5], "ybound": [-50.0, 50.0, 0.5], "zbound": [-10.0, 10.0, 20.0],
        "dbound": [4.0, 45.0, 1.0]}
DATA_AUG = {"resize_lim": (0.193, 0.225), "final_dim": (128, 352), "rot_lim": (-5.4, 5.4), "H": 900, "W": 1600,
            "rand_flip": True, "bot_pct_lim": (0.0, 0.22), "Ncams": 5}
normalize_img = torch.nn.Sequential(ToTensor(), Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--version", default="trainval")
    p.add_argument("--dataroot", default="/data/nuscenes")
    p.add_argument("--logdir", default="./runs")
    p.add_argument("--gpuid", type=int, default=0)
    p.add_argument("--nepochs", type=int, default=30)
    p.add_argument("--bsz", type=int, default=4)
    p.add_argument("--nworkers", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=1e-7)
    p.add_argument("--max_grad_norm", type=float, default=5.0)
    p.add_argument("--pos_weight", type=float, default=2.13)
    p.add_argument("--val_step", type=int, default=1000)
    return p.parse_args()


def gen_dx_bx(xbound, ybound, zbound):
    dx = torch.Tensor([row[2] for row in [xbound, ybound, zbound]])
    bx = torch.Tensor([row[0] + row[2] / 2.0 for row in [xbound, ybound, zbound]])
    nx = torch.LongTensor([(row[1] - row[0]) / row[2] for row in [xbound, ybound, zbound]])
    return dx, bx, nx


def cumsum_trick(x, geom_feats, ranks):
    x = x.cumsum(0)
    kept = torch.ones(x.shape[0], device=x.device, dtype=torch.bool)
    kept[:-1] = ranks[1:] != ranks[:-1]
    x, geom_feats = x[kept], geom_feats[kept]
    x = torch.cat((x[:1], x[1:] - x[:-1]))
    return x, geom_feats


class SegmentationData(Dataset):
    """Reads the pickled per-sample records written by tools/export_lss_records.py."""

    def __init__(self, dataroot, split, is_train):
        with open(os.path.join(dataroot, f"lss_{split}.pkl"), "rb") as f:
            self.recs = pickle.load(f)
        self.dataroot, self.is_train = dataroot, is_train

    def __len__(self):
        return len(self.recs)

    def sample_augmentation(self):
        H, W, (fH, fW) = DATA_AUG["H"], DATA_AUG["W"], DATA_AUG["final_dim"]
        if self.is_train:
            resize = np.random.uniform(*DATA_AUG["resize_lim"])
            newW, newH = int(W * resize), int(H * resize)
            crop_h = int((1 - np.random.uniform(*DATA_AUG["bot_pct_lim"])) * newH) - fH
            crop_w = int(np.random.uniform(0, max(0, newW - fW)))
            flip = DATA_AUG["rand_flip"] and np.random.choice([0, 1])
            rotate = np.random.uniform(*DATA_AUG["rot_lim"])
        else:
            resize = max(fH / H, fW / W)
            newW, newH = int(W * resize), int(H * resize)
            crop_h = int((1 - np.mean(DATA_AUG["bot_pct_lim"])) * newH) - fH
            crop_w = int(max(0, newW - fW) / 2)
            flip, rotate = False, 0
        return resize, (newW, newH), (crop_w, crop_h, crop_w + fW, crop_h + fH), flip, rotate

    def __getitem__(self, index):
        rec = self.recs[index]
        cams = rec["cams"]
        if self.is_train:
            cams = [cams[i] for i in np.random.choice(len(cams), DATA_AUG["Ncams"], replace=False)]
        imgs, rots, trans, intrins, post_rots, post_trans = [], [], [], [], [], []
        for cam in cams:
            img = Image.open(os.path.join(self.dataroot, cam["filename"]))
            resize, dims, crop, flip, rotate = self.sample_augmentation()
            img = img.resize(dims).crop(crop)
            if flip:
                img = img.transpose(method=Image.FLIP_LEFT_RIGHT)
            img = img.rotate(rotate)
            pr = torch.eye(2) * resize
            pt = -torch.Tensor(crop[:2])
            if flip:
                A = torch.Tensor([[-1, 0], [0, 1]])
                pr, pt = A.matmul(pr), A.matmul(pt) + torch.Tensor([crop[2] - crop[0], 0])
            th = rotate / 180 * np.pi
            A = torch.Tensor([[np.cos(th), np.sin(th)], [-np.sin(th), np.cos(th)]])
            b = torch.Tensor([crop[2] - crop[0], crop[3] - crop[1]]) / 2
            b = A.matmul(-b) + b
            post_rot, post_tran = torch.eye(3), torch.zeros(3)
            post_rot[:2, :2], post_tran[:2] = A.matmul(pr), A.matmul(pt) + b
            imgs.append(normalize_img(img))
            intrins.append(torch.Tensor(cam["intrinsic"]))
            rots.append(torch.Tensor(cam["rot"]))
            trans.append(torch.Tensor(cam["trans"]))
            post_rots.append(post_rot)
            post_trans.append(post_tran)
        binimg = torch.Tensor(np.load(os.path.join(self.dataroot, rec["binimg"]))).unsqueeze(0)
        return (torch.stack(imgs), torch.stack(rots), torch.stack(trans), torch.stack(intrins),
                torch.stack(post_rots), torch.stack(post_trans), binimg)


class Up(nn.Module):
    def __init__(self, in_channels, out_channels, scale_factor=2):
        super().__init__()
        self.up = nn.Upsample(scale_factor=scale_factor, mode="bilinear", align_corners=True)
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True), nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))

    def forward(self, x1, x2):
        return self.conv(torch.cat([x2, self.up(x1)], dim=1))


class CamEncode(nn.Module):
    def __init__(self, D, C):
        super().__init__()
        self.D, self.C = D, C
        self.trunk = EfficientNet.from_pretrained("efficientnet-b0")
        self.up1 = Up(320 + 112, 512)
        self.depthnet = nn.Conv2d(512, self.D + self.C, kernel_size=1, padding=0)

    def get_eff_depth(self, x):
        endpoints = {}
        x = self.trunk._swish(self.trunk._bn0(self.trunk._conv_stem(x)))
        prev_x = x
        for idx, block in enumerate(self.trunk._blocks):
            drop_connect_rate = self.trunk._global_params.drop_connect_rate
            if drop_connect_rate:
                drop_connect_rate *= float(idx) / len(self.trunk._blocks)
            x = block(x, drop_connect_rate=drop_connect_rate)
            if prev_x.size(2) > x.size(2):
                endpoints[f"reduction_{len(endpoints) + 1}"] = prev_x
            prev_x = x
        endpoints[f"reduction_{len(endpoints) + 1}"] = x
        return self.up1(endpoints["reduction_5"], endpoints["reduction_4"])

    def forward(self, x):
        x = self.depthnet(self.get_eff_depth(x))
        depth = x[:, : self.D].softmax(dim=1)
        return depth.unsqueeze(1) * x[:, self.D: (self.D + self.C)].unsqueeze(2)


class BevEncode(nn.Module):
    def __init__(self, inC, outC):
        super().__init__()
        trunk = resnet18(weights=None, zero_init_residual=True)
        self.conv1 = nn.Conv2d(inC, 64, kernel_size=7, stride=1, padding=3, bias=False)
        self.bn1, self.relu = trunk.bn1, trunk.relu
        self.layer1, self.layer2, self.layer3 = trunk.layer1, trunk.layer2, trunk.layer3
        self.up1 = Up(64 + 256, 256, scale_factor=4)
        self.up2 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                                 nn.Conv2d(256, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128),
                                 nn.ReLU(inplace=True), nn.Conv2d(128, outC, 1))

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x1 = self.layer1(x)
        x = self.layer3(self.layer2(x1))
        return self.up2(self.up1(x, x1))


class LiftSplatShoot(nn.Module):
    def __init__(self, grid_conf, outC=1):
        super().__init__()
        dx, bx, nx = gen_dx_bx(grid_conf["xbound"], grid_conf["ybound"], grid_conf["zbound"])
        self.register_buffer("dx", dx, persistent=False)
        self.register_buffer("bx", bx, persistent=False)
        self.register_buffer("nx", nx, persistent=False)
        self.downsample, self.camC = 16, 64
        self.register_buffer("frustum", self.create_frustum(grid_conf["dbound"]), persistent=False)
        self.D = self.frustum.shape[0]
        self.camencode = CamEncode(self.D, self.camC)
        self.bevencode = BevEncode(inC=self.camC, outC=outC)

    def create_frustum(self, dbound):
        ogfH, ogfW = DATA_AUG["final_dim"]
        fH, fW = ogfH // self.downsample, ogfW // self.downsample
        ds = torch.arange(*dbound, dtype=torch.float).view(-1, 1, 1).expand(-1, fH, fW)
        D = ds.shape[0]
        xs = torch.linspace(0, ogfW - 1, fW, dtype=torch.float).view(1, 1, fW).expand(D, fH, fW)
        ys = torch.linspace(0, ogfH - 1, fH, dtype=torch.float).view(1, fH, 1).expand(D, fH, fW)
        return torch.stack((xs, ys, ds), -1)

    def get_geometry(self, rots, trans, intrins, post_rots, post_trans):
        B, N, _ = trans.shape
        points = self.frustum - post_trans.view(B, N, 1, 1, 1, 3)
        points = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(points.unsqueeze(-1))
        points = torch.cat((points[:, :, :, :, :, :2] * points[:, :, :, :, :, 2:3], points[:, :, :, :, :, 2:3]), 5)
        combine = rots.matmul(torch.inverse(intrins))
        points = combine.view(B, N, 1, 1, 1, 3, 3).matmul(points).squeeze(-1)
        return points + trans.view(B, N, 1, 1, 1, 3)

    def voxel_pooling(self, geom_feats, x):
        B, N, D, H, W, C = x.shape
        Nprime = B * N * D * H * W
        x = x.reshape(Nprime, C)
        geom_feats = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long().view(Nprime, 3)
        batch_ix = torch.cat([torch.full([Nprime // B, 1], ix, device=x.device, dtype=torch.long) for ix in range(B)])
        geom_feats = torch.cat((geom_feats, batch_ix), 1)
        kept = ((geom_feats[:, 0] >= 0) & (geom_feats[:, 0] < self.nx[0]) & (geom_feats[:, 1] >= 0)
                & (geom_feats[:, 1] < self.nx[1]) & (geom_feats[:, 2] >= 0) & (geom_feats[:, 2] < self.nx[2]))
        x, geom_feats = x[kept], geom_feats[kept]
        ranks = (geom_feats[:, 0] * (self.nx[1] * self.nx[2] * B) + geom_feats[:, 1] * (self.nx[2] * B)
                 + geom_feats[:, 2] * B + geom_feats[:, 3])
        sorts = ranks.argsort()
        x, geom_feats, ranks = x[sorts], geom_feats[sorts], ranks[sorts]
        x, geom_feats = cumsum_trick(x, geom_feats, ranks)
        final = torch.zeros((B, C, self.nx[2], self.nx[0], self.nx[1]), device=x.device)
        final[geom_feats[:, 3], :, geom_feats[:, 2], geom_feats[:, 0], geom_feats[:, 1]] = x
        return torch.cat(final.unbind(dim=2), 1)

    def forward(self, x, rots, trans, intrins, post_rots, post_trans):
        geom = self.get_geometry(rots, trans, intrins, post_rots, post_trans)
        B, N, C, imH, imW = x.shape
        x = self.camencode(x.view(B * N, C, imH, imW))
        x = x.view(B, N, self.camC, self.D, imH // self.downsample, imW // self.downsample).permute(0, 1, 3, 4, 5, 2)
        return self.bevencode(self.voxel_pooling(geom, x))


class SimpleLoss(nn.Module):
    def __init__(self, pos_weight):
        super().__init__()
        self.loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.Tensor([pos_weight]))

    def forward(self, ypred, ytgt):
        return self.loss_fn(ypred, ytgt)


def get_batch_iou(preds, binimgs):
    with torch.no_grad():
        pred, tgt = preds > 0, binimgs.bool()
        return (pred & tgt).sum().float(), (pred | tgt).sum().float()


def get_val_info(model, valloader, loss_fn, device):
    model.eval()
    stats = torch.zeros(4, device=device)  # loss_sum, intersect, union, n
    with torch.no_grad():
        for imgs, rots, trans, intrins, post_rots, post_trans, binimgs in valloader:
            preds = model(imgs.to(device), rots.to(device), trans.to(device), intrins.to(device),
                          post_rots.to(device), post_trans.to(device))
            binimgs = binimgs.to(device)
            inter, union = get_batch_iou(preds, binimgs)
            stats += torch.stack([loss_fn(preds, binimgs) * preds.shape[0], inter, union,
                                  torch.tensor(float(preds.shape[0]), device=device)])
    dist.all_reduce(stats)
    model.train()
    return {"loss": (stats[0] / stats[3]).item(), "iou": (stats[1] / stats[2]).item()}


def train():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    traindata = SegmentationData(args.dataroot, "train", is_train=True)
    valdata = SegmentationData(args.dataroot, "val", is_train=False)
    train_sampler = DistributedSampler(traindata, shuffle=True, drop_last=True)
    trainloader = DataLoader(traindata, batch_size=args.bsz, sampler=train_sampler, num_workers=args.nworkers,
                             drop_last=True, pin_memory=True)
    valloader = DataLoader(torch.utils.data.Subset(valdata, range(rank, len(valdata), world_size)),
                           batch_size=args.bsz, num_workers=args.nworkers)

    model = LiftSplatShoot(GRID, outC=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size * args.bsz / 4, weight_decay=args.weight_decay)
    loss_fn = SimpleLoss(args.pos_weight).cuda(args.gpuid)

    writer = SummaryWriter(logdir=args.logdir) if rank == 0 else None
    counter = 0
    for epoch in range(args.nepochs):
        train_sampler.set_epoch(epoch)
        for batchi, (imgs, rots, trans, intrins, post_rots, post_trans, binimgs) in enumerate(trainloader):
            t0 = time()
            opt.zero_grad()
            preds = model(imgs.to(device), rots.to(device), trans.to(device), intrins.to(device),
                          post_rots.to(device), post_trans.to(device))
            binimgs = binimgs.to(device)
            loss = loss_fn(preds, binimgs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            counter += 1
            t1 = time()

            if counter % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), counter)
                    writer.add_scalar("train/step_time", t1 - t0, counter)

            if counter % args.val_step == 0:
                val_info = get_val_info(model.module, valloader, loss_fn, device)
                if rank == 0:
                    print("VAL", val_info, flush=True)
                    writer.add_scalar("val/loss", val_info["loss"], counter)
                    writer.add_scalar("val/iou", val_info["iou"], counter)
                    mname = os.path.join(args.logdir, f"model{counter}.pt")
                    print("saving", mname)
                    torch.save(model.module.state_dict(), mname)
                dist.barrier()
                model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    train()
