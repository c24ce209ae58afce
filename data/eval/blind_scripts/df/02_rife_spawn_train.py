"""RIFE (IFNet + privileged teacher) training on Vimeo-90K triplets, one process per GPU via mp.spawn.

    python 02_rife_spawn_train.py --data_root /datasets/vimeo_triplet --gpus 8
"""
import argparse
import copy
import math
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class VimeoDataset(Dataset):
    def __init__(self, root, split, crop=256):
        name = "tri_trainlist.txt" if split == "train" else "tri_testlist.txt"
        with open(os.path.join(root, name)) as fh:
            self.meta = [x.strip() for x in fh if x.strip()]
        self.root, self.split, self.crop = root, split, crop

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        folder = os.path.join(self.root, "sequences", self.meta[i])
        ims = [cv2.imread(os.path.join(folder, "im%d.png" % k)) for k in (1, 2, 3)]
        if self.split == "train":
            h, w = ims[0].shape[:2]
            y, x = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
            ims = [im[y:y + self.crop, x:x + self.crop] for im in ims]
            if random.random() < 0.5:
                ims = [im[:, :, ::-1] for im in ims]  # channel order swap, as in RIFE
            if random.random() < 0.5:
                ims = [im[:, ::-1] for im in ims]
            if random.random() < 0.5:
                ims = ims[::-1]
        t = [torch.from_numpy(np.ascontiguousarray(im)).permute(2, 0, 1) for im in ims]
        return torch.cat(t, 0).float() / 255.0  # 9 x H x W


def conv(i, o, k=3, s=1, p=1):
    return nn.Sequential(nn.Conv2d(i, o, k, s, p), nn.PReLU(o))


def warp(img, flow):
    n, _, h, w = flow.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=img.device), torch.arange(w, device=img.device), indexing="ij")
    gx = (xs.unsqueeze(0) + flow[:, 0]) / (w - 1) * 2 - 1
    gy = (ys.unsqueeze(0) + flow[:, 1]) / (h - 1) * 2 - 1
    return F.grid_sample(img, torch.stack((gx, gy), -1), padding_mode="border", align_corners=True)


class IFBlock(nn.Module):
    def __init__(self, cin, c=64):
        super().__init__()
        self.conv0 = nn.Sequential(conv(cin, c // 2, 3, 2, 1), conv(c // 2, c, 3, 2, 1))
        self.convblock = nn.Sequential(*[conv(c, c) for _ in range(6)])
        self.lastconv = nn.ConvTranspose2d(c, 5, 4, 2, 1)

    def forward(self, x, flow, scale):
        x = F.interpolate(x, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            f = F.interpolate(flow, scale_factor=1.0 / scale, mode="bilinear", align_corners=False) / scale
            x = torch.cat((x, f), 1)
        x = self.conv0(x)
        x = self.convblock(x) + x
        tmp = F.interpolate(self.lastconv(x), scale_factor=scale * 2, mode="bilinear", align_corners=False)
        return tmp[:, :4] * scale * 2, tmp[:, 4:5]


class IFNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block0 = IFBlock(6, c=240)
        self.block1 = IFBlock(13 + 4, c=150)
        self.block2 = IFBlock(13 + 4, c=90)
        self.block_tea = IFBlock(16 + 4, c=90)

    def forward(self, imgs, gt=None, scale=(4, 2, 1)):
        img0, img1 = imgs[:, :3], imgs[:, 3:6]
        flow = mask = None
        w0, w1 = img0, img1
        merged = []
        for i, blk in enumerate((self.block0, self.block1, self.block2)):
            if flow is None:
                flow, mask = blk(torch.cat((img0, img1), 1), None, scale[i])
            else:
                df, dm = blk(torch.cat((img0, img1, w0, w1, mask), 1), flow, scale[i])
                flow, mask = flow + df, mask + dm
            w0, w1 = warp(img0, flow[:, :2]), warp(img1, flow[:, 2:4])
            m = torch.sigmoid(mask)
            merged.append(w0 * m + w1 * (1 - m))
        if gt is None:
            return merged, None
        df, dm = self.block_tea(torch.cat((img0, img1, w0, w1, mask, gt), 1), flow, 1)
        flow_t, mask_t = flow + df, mask + dm
        mt = torch.sigmoid(mask_t)
        merged_t = warp(img0, flow_t[:, :2]) * mt + warp(img1, flow_t[:, 2:4]) * (1 - mt)
        return merged, (merged_t, flow_t, flow)


def lap_loss(pred, gt, levels=5):
    loss = 0.0
    for _ in range(levels):
        p_low, g_low = F.avg_pool2d(pred, 2), F.avg_pool2d(gt, 2)
        loss = loss + F.l1_loss(pred - F.interpolate(p_low, scale_factor=2.0), gt - F.interpolate(g_low, scale_factor=2.0))
        pred, gt = p_low, g_low
    return loss


def setup(local_rank, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=args.gpus)


@torch.no_grad()
def validate(net, ds, rank, world):
    net.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=4, num_workers=2)
    acc = torch.zeros(2).cuda()
    for data in loader:
        data = data.cuda(non_blocking=True)
        pred = net(data[:, :6])[0][-1]
        mse = F.mse_loss(pred, data[:, 6:9], reduction="none").mean((1, 2, 3))
        acc += torch.stack([(-10 * torch.log10(mse)).sum(), torch.tensor(float(mse.numel()), device=acc.device)])
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    return (acc[0] / acc[1]).item()


def worker(local_rank, args):
    setup(local_rank, args)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    model = IFNet().cuda()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    step, epoch0 = 0, 0
    ckpt_path = os.path.join(args.log_dir, "last.pkl")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": "cuda:%d" % local_rank})
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        optim.load_state_dict(ckpt["optim"])
        step, epoch0 = ckpt["step"], ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])

    train_ds = VimeoDataset(args.data_root, "train")
    val_ds = VimeoDataset(args.data_root, "test")
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    steps_per_epoch = len(loader)
    total = steps_per_epoch * args.epochs

    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for data in loader:
            if step < 2000:
                lr = args.lr * step / 2000
            else:
                lr = (args.lr - 3e-6) * (math.cos((step - 2000) / (total - 2000) * math.pi) + 1) / 2 + 3e-6
            for g in optim.param_groups:
                g["lr"] = lr
            data = data.cuda(non_blocking=True)
            imgs, gt = data[:, :6], data[:, 6:9]
            merged, (merged_t, flow_t, flow_s) = model(imgs, gt)
            loss_l1 = lap_loss(merged[-1], gt)
            loss_tea = lap_loss(merged_t, gt)
            err_s = (merged[-1] - gt).abs().mean(1, keepdim=True)
            err_t = (merged_t - gt).abs().mean(1, keepdim=True)
            keep = (err_s > err_t + 0.01).float().detach()
            loss_distill = (((flow_t.detach() - flow_s) ** 2).mean(1, True) ** 0.5 * keep).mean()
            loss = loss_l1 + loss_tea + 0.01 * loss_distill
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.module.parameters()):
                    pe.lerp_(pm, 1 - args.ema_decay)
            step += 1
            if rank == 0 and step % 200 == 0:
                print("ep %d step %d/%d lr %.2e l1 %.4f tea %.4f distill %.4f %.2fs/it"
                      % (epoch, step, total, lr, loss_l1.item(), loss_tea.item(), loss_distill.item(),
                         (time.time() - tic) / 200), flush=True)
                tic = time.time()

        psnr = validate(ema, val_ds, rank, world)
        if rank == 0:
            print("epoch %d  EMA val PSNR %.3f" % (epoch, psnr), flush=True)
            os.makedirs(args.log_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "optim": optim.state_dict(),
                        "step": step, "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--log_dir", default="train_log")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=64, help="total over all GPUs")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--ema_decay", type=float, default=0.999)
    parser.add_argument("--port", type=int, default=29513)
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.gpus, join=True)
