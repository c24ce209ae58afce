import argparse
import math
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import AdamW
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

# usage: torchrun --nproc_per_node=4 03_rife_vimeo_train.py --world_size=4 --batch_size=16


def get_learning_rate(step, total):
    if step < 2000:
        mul = step / 2000.0
        return 3e-4 * mul
    mul = math.cos((step - 2000) / (total - 2000.0) * math.pi) * 0.5 + 0.5
    return (3e-4 - 3e-6) * mul + 3e-6


class VimeoDataset(Dataset):
    def __init__(self, dataset_name, data_root, h=256, w=256):
        self.dataset_name = dataset_name
        self.h, self.w = h, w
        self.image_root = os.path.join(data_root, "sequences")
        list_file = "tri_testlist.txt" if dataset_name == "test" else "tri_trainlist.txt"
        with open(os.path.join(data_root, list_file)) as f:
            self.meta_data = f.read().splitlines()
        self.meta_data = [m for m in self.meta_data if m]

    def __len__(self):
        return len(self.meta_data)

    def aug(self, img0, gt, img1, h, w):
        ih, iw, _ = img0.shape
        x = np.random.randint(0, ih - h + 1)
        y = np.random.randint(0, iw - w + 1)
        return img0[x:x + h, y:y + w], gt[x:x + h, y:y + w], img1[x:x + h, y:y + w]

    def getimg(self, index):
        imgpath = os.path.join(self.image_root, self.meta_data[index])
        img0 = cv2.imread(imgpath + "/im1.png")
        gt = cv2.imread(imgpath + "/im2.png")
        img1 = cv2.imread(imgpath + "/im3.png")
        return img0, gt, img1

    def __getitem__(self, index):
        img0, gt, img1 = self.getimg(index)
        if self.dataset_name == "train":
            img0, gt, img1 = self.aug(img0, gt, img1, self.h, self.w)
            if random.uniform(0, 1) < 0.5:
                img0, gt, img1 = img0[::-1], gt[::-1], img1[::-1]
            if random.uniform(0, 1) < 0.5:
                img0, gt, img1 = img0[:, ::-1], gt[:, ::-1], img1[:, ::-1]
            if random.uniform(0, 1) < 0.5:
                img0, img1 = img1, img0
        img0 = torch.from_numpy(img0.copy()).permute(2, 0, 1)
        img1 = torch.from_numpy(img1.copy()).permute(2, 0, 1)
        gt = torch.from_numpy(gt.copy()).permute(2, 0, 1)
        return torch.cat((img0, img1, gt), 0)


def conv(in_planes, out_planes, kernel_size=3, stride=1, padding=1):
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, bias=True),
                         nn.LeakyReLU(0.2, True))


def warp(ten_input, ten_flow):
    b, _, h, w = ten_flow.shape
    hor = torch.linspace(-1.0, 1.0, w, device=ten_flow.device).view(1, 1, 1, w).expand(b, -1, h, -1)
    ver = torch.linspace(-1.0, 1.0, h, device=ten_flow.device).view(1, 1, h, 1).expand(b, -1, -1, w)
    grid = torch.cat([hor, ver], 1)
    ten_flow = torch.cat([ten_flow[:, 0:1] / ((w - 1.0) / 2.0), ten_flow[:, 1:2] / ((h - 1.0) / 2.0)], 1)
    g = (grid + ten_flow).permute(0, 2, 3, 1)
    return F.grid_sample(ten_input, g, mode="bilinear", padding_mode="border", align_corners=True)


class IFBlock(nn.Module):
    def __init__(self, in_planes, c=64):
        super().__init__()
        self.conv0 = nn.Sequential(conv(in_planes, c // 2, 3, 2, 1), conv(c // 2, c, 3, 2, 1))
        self.convblock = nn.Sequential(*[conv(c, c) for _ in range(8)])
        self.lastconv = nn.ConvTranspose2d(c, 5, 4, 2, 1)

    def forward(self, x, flow, scale):
        if scale != 1:
            x = F.interpolate(x, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            flow = F.interpolate(flow, scale_factor=1.0 / scale, mode="bilinear", align_corners=False) / scale
            x = torch.cat((x, flow), 1)
        x = self.conv0(x)
        x = self.convblock(x) + x
        tmp = self.lastconv(x)
        tmp = F.interpolate(tmp, scale_factor=scale * 2, mode="bilinear", align_corners=False)
        return tmp[:, :4] * scale * 2, tmp[:, 4:5]


class IFNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block0 = IFBlock(6, c=192)
        self.block1 = IFBlock(13 + 4, c=128)
        self.block2 = IFBlock(13 + 4, c=96)

    def forward(self, x, scale=(4, 2, 1)):
        img0, img1 = x[:, :3], x[:, 3:6]
        flow, mask = None, None
        warped0, warped1 = img0, img1
        merged = []
        for i, block in enumerate([self.block0, self.block1, self.block2]):
            if flow is None:
                flow, mask = block(torch.cat((img0, img1), 1), None, scale=scale[i])
            else:
                fd, md = block(torch.cat((img0, img1, warped0, warped1, mask), 1), flow, scale=scale[i])
                flow, mask = flow + fd, mask + md
            warped0 = warp(img0, flow[:, :2])
            warped1 = warp(img1, flow[:, 2:4])
            m = torch.sigmoid(mask)
            merged.append(warped0 * m + warped1 * (1 - m))
        return flow, merged


class Model:
    def __init__(self, local_rank):
        self.device = torch.device("cuda", local_rank)
        self.flownet = IFNet().to(self.device)
        self.optimG = AdamW(self.flownet.parameters(), lr=1e-6, weight_decay=1e-3)
        self.flownet = DDP(self.flownet, device_ids=[local_rank], output_device=local_rank)

    def train(self):
        self.flownet.train()

    def eval(self):
        self.flownet.eval()

    def load_model(self, path):
        sd = torch.load(os.path.join(path, "flownet.pkl"), map_location=self.device)
        self.flownet.module.load_state_dict(sd)

    def save_model(self, path, rank):
        if rank == 0:
            torch.save(self.flownet.module.state_dict(), os.path.join(path, "flownet.pkl"))

    def update(self, imgs, gt, learning_rate):
        for g in self.optimG.param_groups:
            g["lr"] = learning_rate
        self.train()
        flow, merged = self.flownet(imgs)
        loss_l1 = (merged[2] - gt).abs().mean()
        loss_coarse = sum((m - gt).abs().mean() for m in merged[:2])
        loss = loss_l1 + 0.5 * loss_coarse
        self.optimG.zero_grad()
        loss.backward()
        self.optimG.step()
        return merged[2], {"loss_l1": loss_l1.detach(), "loss_coarse": loss_coarse.detach(), "flow": flow.detach()}


@torch.no_grad()
def evaluate(model, val_loader, step, local_rank, writer_val):
    model.eval()
    stats = torch.zeros(3, device=model.device)
    for data in val_loader:
        data = data.to(model.device, non_blocking=True).float() / 255.0
        imgs, gt = data[:, :6], data[:, 6:9]
        _, merged = model.flownet.module(imgs)
        pred = merged[2]
        mse = ((pred - gt) ** 2).mean((1, 2, 3))
        stats[0] += (-10 * torch.log10(mse)).sum()
        stats[1] += ssim(pred, gt, data_range=1.0, size_average=False).sum()
        stats[2] += pred.shape[0]
    dist.all_reduce(stats)
    psnr, s = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
    if local_rank == 0:
        print("step {} psnr {:.3f} ssim {:.4f}".format(step, psnr, s))
        writer_val.add_scalar("psnr", psnr, step)
        writer_val.add_scalar("ssim", s, step)


def train(model, local_rank, args):
    writer = SummaryWriter("train") if local_rank == 0 else None
    writer_val = SummaryWriter("validate") if local_rank == 0 else None
    step = 0
    dataset = VimeoDataset("train", args.data_root)
    sampler = DistributedSampler(dataset)
    train_data = DataLoader(dataset, batch_size=args.batch_size, num_workers=8, pin_memory=True,
                            drop_last=True, sampler=sampler)
    args.step_per_epoch = len(train_data)
    total = args.step_per_epoch * args.epoch
    dataset_val = VimeoDataset("test", args.data_root)
    rank, world = dist.get_rank(), dist.get_world_size()
    val_shard = Subset(dataset_val, range(rank, len(dataset_val), world))
    val_data = DataLoader(val_shard, batch_size=16, pin_memory=True, num_workers=4)
    print("training...")
    time_stamp = time.time()
    for epoch in range(args.epoch):
        sampler.set_epoch(epoch)
        for i, data in enumerate(train_data):
            data_time_interval = time.time() - time_stamp
            time_stamp = time.time()
            data_gpu = data.to(model.device, non_blocking=True) / 255.0
            imgs, gt = data_gpu[:, :6], data_gpu[:, 6:9]
            lr = get_learning_rate(step, total) * args.world_size / 4
            pred, info = model.update(imgs, gt, lr)
            train_time_interval = time.time() - time_stamp
            time_stamp = time.time()
            if step % 200 == 1 and local_rank == 0:
                writer.add_scalar("learning_rate", lr, step)
                writer.add_scalar("loss/l1", info["loss_l1"].item(), step)
                writer.add_scalar("loss/coarse", info["loss_coarse"].item(), step)
            if local_rank == 0 and i % 50 == 0:
                print("epoch:{} {}/{} time:{:.2f}+{:.2f} loss_l1:{:.4e}".format(
                    epoch, i, args.step_per_epoch, data_time_interval, train_time_interval, info["loss_l1"].item()))
            step += 1
        if epoch % 5 == 0:
            evaluate(model, val_data, step, local_rank, writer_val)
        model.save_model(args.log_path, local_rank)
        dist.barrier()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epoch", default=300, type=int)
    parser.add_argument("--batch_size", default=16, type=int, help="minibatch size")
    parser.add_argument("--local_rank", default=0, type=int, help="local rank")
    parser.add_argument("--world_size", default=4, type=int, help="world size")
    parser.add_argument("--data_root", default="/data/vimeo_triplet")
    parser.add_argument("--log_path", default="train_log")
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(backend="nccl", world_size=args.world_size)
    seed = 1234
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.benchmark = True
    os.makedirs(args.log_path, exist_ok=True)
    model = Model(args.local_rank)
    train(model, args.local_rank, args)
    dist.destroy_process_group()
