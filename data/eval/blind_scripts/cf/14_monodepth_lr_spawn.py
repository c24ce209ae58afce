"""Unsupervised monocular depth with left-right consistency (Godard et al. 2017), PyTorch DDP via mp.spawn.

    python monodepth_main.py --data_dir /data/kitti_raw --filenames_file utils/filenames/kitti_train_files.txt \
        --model_name monodepth_resnet50 --encoder resnet50 --gpus 4
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from monodepth.dataloader import KittiStereoPairs
from monodepth.models import MonodepthNet


def get_args():
    parser = argparse.ArgumentParser("Monodepth PyTorch")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--filenames_file", required=True)
    parser.add_argument("--val_filenames_file", default="utils/filenames/kitti_stereo_2015_test_files.txt")
    parser.add_argument("--model_name", default="monodepth")
    parser.add_argument("--encoder", default="resnet50", choices=["vgg", "resnet50"])
    parser.add_argument("--input_height", type=int, default=256)
    parser.add_argument("--input_width", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=8, help="per process")
    parser.add_argument("--num_epochs", type=int, default=50)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--alpha_image_loss", type=float, default=0.85)
    parser.add_argument("--disp_gradient_loss_weight", type=float, default=0.1)
    parser.add_argument("--lr_loss_weight", type=float, default=1.0)
    parser.add_argument("--num_threads", type=int, default=8)
    parser.add_argument("--log_directory", default="logs")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", default="12355")
    return parser.parse_args()


def SSIM(x, y):
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    mu_x = F.avg_pool2d(x, 3, 1)
    mu_y = F.avg_pool2d(y, 3, 1)
    sigma_x = F.avg_pool2d(x ** 2, 3, 1) - mu_x ** 2
    sigma_y = F.avg_pool2d(y ** 2, 3, 1) - mu_y ** 2
    sigma_xy = F.avg_pool2d(x * y, 3, 1) - mu_x * mu_y
    n = (2 * mu_x * mu_y + C1) * (2 * sigma_xy + C2)
    d = (mu_x ** 2 + mu_y ** 2 + C1) * (sigma_x + sigma_y + C2)
    return torch.clamp((1 - n / d) / 2, 0, 1)


def apply_disparity(img, disp):
    b, _, h, w = img.shape
    x_base = torch.linspace(0, 1, w, device=img.device).repeat(b, h, 1)
    y_base = torch.linspace(0, 1, h, device=img.device).repeat(b, w, 1).transpose(1, 2)
    flow_field = torch.stack((x_base + disp[:, 0], y_base), dim=3)
    return F.grid_sample(img, 2 * flow_field - 1, mode="bilinear", padding_mode="zeros", align_corners=True)


def scale_pyramid(img, num_scales=4):
    pyr = [img]
    h, w = img.shape[-2:]
    for i in range(num_scales - 1):
        ratio = 2 ** (i + 1)
        pyr.append(F.interpolate(img, size=(h // ratio, w // ratio), mode="bilinear", align_corners=True))
    return pyr


def disp_smoothness(disp, img):
    gx_d = disp[:, :, :, :-1] - disp[:, :, :, 1:]
    gy_d = disp[:, :, :-1, :] - disp[:, :, 1:, :]
    gx_i = img[:, :, :, :-1] - img[:, :, :, 1:]
    gy_i = img[:, :, :-1, :] - img[:, :, 1:, :]
    wx = torch.exp(-torch.mean(gx_i.abs(), 1, keepdim=True))
    wy = torch.exp(-torch.mean(gy_i.abs(), 1, keepdim=True))
    return (gx_d * wx).abs().mean() + (gy_d * wy).abs().mean()


class MonodepthLoss(nn.Module):
    def __init__(self, n=4, SSIM_w=0.85, disp_gradient_w=0.1, lr_w=1.0):
        super().__init__()
        self.n, self.SSIM_w, self.disp_gradient_w, self.lr_w = n, SSIM_w, disp_gradient_w, lr_w

    def forward(self, disps, left, right):
        left_pyr, right_pyr = scale_pyramid(left, self.n), scale_pyramid(right, self.n)
        disp_l = [d[:, 0:1] for d in disps]
        disp_r = [d[:, 1:2] for d in disps]
        loss = 0.0
        for i in range(self.n):
            left_est = apply_disparity(right_pyr[i], -disp_l[i])
            right_est = apply_disparity(left_pyr[i], disp_r[i])
            r2l = apply_disparity(disp_r[i], -disp_l[i])
            l2r = apply_disparity(disp_l[i], disp_r[i])
            l1_l = (left_est - left_pyr[i]).abs().mean()
            l1_r = (right_est - right_pyr[i]).abs().mean()
            ssim_l = SSIM(left_est, left_pyr[i]).mean()
            ssim_r = SSIM(right_est, right_pyr[i]).mean()
            image_loss = self.SSIM_w * (ssim_l + ssim_r) + (1 - self.SSIM_w) * (l1_l + l1_r)
            smooth = (disp_smoothness(disp_l[i], left_pyr[i]) + disp_smoothness(disp_r[i], right_pyr[i])) / 2 ** i
            lr = (r2l - disp_l[i]).abs().mean() + (l2r - disp_r[i]).abs().mean()
            loss = loss + image_loss + self.disp_gradient_w * smooth + self.lr_w * lr
        return loss


def train_worker(rank, args, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_set = KittiStereoPairs(args.data_dir, args.filenames_file, (args.input_height, args.input_width),
                                 augment=True)
    val_set = KittiStereoPairs(args.data_dir, args.val_filenames_file, (args.input_height, args.input_width),
                               augment=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_threads,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=1, shuffle=False, num_workers=2)

    model = MonodepthNet(args.encoder, num_out_layers=2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    criterion = MonodepthLoss(4, args.alpha_image_loss, args.disp_gradient_loss_weight, args.lr_loss_weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    # halve the learning rate at 3/5 and 4/5 of training, as in the paper
    milestones = [int(3 / 5 * args.num_epochs), int(4 / 5 * args.num_epochs)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.5)

    out_dir = os.path.join(args.log_directory, args.model_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for left, right in loader:
            left, right = left.to(device, non_blocking=True), right.to(device, non_blocking=True)
            disps = model(left)
            loss = criterion(disps, left, right)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for left, right in val_loader:
                left, right = left.to(device), right.to(device)
                disps = model.module(left)
                val += torch.stack([criterion(disps, left, right), torch.ones((), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(val)
        if rank == 0:
            print("epoch {:3d} | train {:.4f} | val {:.4f} | {:.0f}s".format(
                epoch, (run[0] / run[1]).item(), (val[0] / val[1]).item(), time.time() - t0))
            torch.save(model.module.state_dict(), os.path.join(out_dir, "model_last.pth"))
            if (epoch + 1) % 10 == 0:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "model_{}.pth".format(epoch + 1)))

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    world_size = args.gpus
    mp.spawn(train_worker, args=(world_size, args), nprocs=world_size, join=True)
