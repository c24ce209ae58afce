"""Self-supervised monocular depth (monodepth2-style) on KITTI raw, multi-GPU.

torchrun --nproc_per_node=4 train_mono.py --data_path /data/kitti_raw --log_dir logs --model_name mono_640x192
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import networks
from datasets import KITTIRAWDataset
from layers import SSIM, BackprojectDepth, Project3D, disp_to_depth, get_smooth_loss, transformation_from_parameters


def parse():
    p = argparse.ArgumentParser("monodepth ddp")
    p.add_argument("--data_path", required=True)
    p.add_argument("--file_list", default="splits/kitti_raw_all_files.txt")
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--log_dir", default="logs")
    p.add_argument("--model_name", default="mono")
    p.add_argument("--height", type=int, default=192)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--scales", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--frame_ids", type=int, nargs="+", default=[0, -1, 1])
    p.add_argument("--min_depth", type=float, default=0.1)
    p.add_argument("--max_depth", type=float, default=100.0)
    p.add_argument("--disparity_smoothness", type=float, default=1e-3)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--num_epochs", type=int, default=20)
    p.add_argument("--scheduler_step_size", type=int, default=15)
    p.add_argument("--num_layers", type=int, default=18)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MonoDepth(nn.Module):
    def __init__(self, opt):
        super().__init__()
        self.opt = opt
        self.encoder = networks.ResnetEncoder(opt.num_layers, pretrained=True)
        self.depth = networks.DepthDecoder(self.encoder.num_ch_enc, opt.scales)
        self.pose_encoder = networks.ResnetEncoder(opt.num_layers, pretrained=True, num_input_images=2)
        self.pose = networks.PoseDecoder(self.pose_encoder.num_ch_enc, num_input_features=1, num_frames_to_predict_for=2)

    def forward(self, inputs):
        outputs = self.depth(self.encoder(inputs[("color_aug", 0, 0)]))
        for f_i in self.opt.frame_ids[1:]:
            if f_i < 0:
                pair = [inputs[("color_aug", f_i, 0)], inputs[("color_aug", 0, 0)]]
            else:
                pair = [inputs[("color_aug", 0, 0)], inputs[("color_aug", f_i, 0)]]
            axisangle, translation = self.pose([self.pose_encoder(torch.cat(pair, 1))])
            outputs[("cam_T_cam", 0, f_i)] = transformation_from_parameters(
                axisangle[:, 0], translation[:, 0], invert=(f_i < 0))
        return outputs


class PhotometricLoss(nn.Module):
    def __init__(self, opt, batch_size):
        super().__init__()
        self.opt = opt
        self.ssim = SSIM()
        self.backproject = BackprojectDepth(batch_size, opt.height, opt.width)
        self.project = Project3D(batch_size, opt.height, opt.width)

    def reprojection(self, pred, target):
        l1 = (target - pred).abs().mean(1, True)
        return 0.85 * self.ssim(pred, target).mean(1, True) + 0.15 * l1

    def forward(self, inputs, outputs):
        opt = self.opt
        total = 0.0
        for scale in opt.scales:
            disp = outputs[("disp", scale)]
            disp_up = F.interpolate(disp, [opt.height, opt.width], mode="bilinear", align_corners=False)
            _, depth = disp_to_depth(disp_up, opt.min_depth, opt.max_depth)
            target = inputs[("color", 0, 0)]
            reproj, identity = [], []
            for f_i in opt.frame_ids[1:]:
                cam_points = self.backproject(depth, inputs[("inv_K", 0)])
                pix = self.project(cam_points, inputs[("K", 0)], outputs[("cam_T_cam", 0, f_i)])
                warped = F.grid_sample(inputs[("color", f_i, 0)], pix, padding_mode="border", align_corners=True)
                reproj.append(self.reprojection(warped, target))
                identity.append(self.reprojection(inputs[("color", f_i, 0)], target))
            reproj = torch.cat(reproj, 1)
            identity = torch.cat(identity, 1) + torch.randn_like(torch.cat(identity, 1)) * 1e-5
            to_opt, _ = torch.min(torch.cat([identity, reproj], 1), dim=1)
            loss = to_opt.mean()
            mean_disp = disp.mean(2, True).mean(3, True)
            color = F.interpolate(target, disp.shape[-2:], mode="bilinear", align_corners=False)
            loss = loss + opt.disparity_smoothness * get_smooth_loss(disp / (mean_disp + 1e-7), color) / (2 ** scale)
            total = total + loss
        return total / len(opt.scales)


def to_device(inputs, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in inputs.items()}


def main():
    opt = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream per process
    seed_everything(opt.seed + rank)

    with open(opt.file_list) as f:
        all_files = [ln.strip() for ln in f if ln.strip()]
    random.shuffle(all_files)
    n_val = int(len(all_files) * opt.val_fraction)
    val_filenames, train_filenames = all_files[:n_val], all_files[n_val:]

    train_ds = KITTIRAWDataset(opt.data_path, train_filenames, opt.height, opt.width, opt.frame_ids, 4,
                               is_train=True, img_ext=".jpg")
    val_ds = KITTIRAWDataset(opt.data_path, val_filenames, opt.height, opt.width, opt.frame_ids, 4,
                             is_train=False, img_ext=".jpg")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, opt.batch_size, sampler=train_sampler, num_workers=opt.num_workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, opt.batch_size, sampler=val_sampler, num_workers=2,
                            pin_memory=True, drop_last=True)

    model = MonoDepth(opt)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = PhotometricLoss(opt, opt.batch_size).to(device)
    optimizer = torch.optim.Adam(model.parameters(), opt.learning_rate)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, opt.scheduler_step_size, 0.1)

    log_path = os.path.join(opt.log_dir, opt.model_name)
    writer = None
    if rank == 0:
        os.makedirs(os.path.join(log_path, "models"), exist_ok=True)
        with open(os.path.join(log_path, "opt.json"), "w") as f:
            json.dump(vars(opt), f, indent=2)
        writer = SummaryWriter(log_path)
        print(f"train items {len(train_filenames)}  val items {len(val_filenames)}  world {world}")

    step = 0
    for epoch in range(opt.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch_idx, inputs in enumerate(train_loader):
            inputs = to_device(inputs, device)
            outputs = model(inputs)
            loss = criterion(inputs, outputs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 250 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item() / world, step)
                    print(f"epoch {epoch} batch {batch_idx} loss {l.item() / world:.4f} "
                          f"({(time.time() - t0) / (batch_idx + 1):.3f}s/it)")
        scheduler.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for inputs in val_loader:
                inputs = to_device(inputs, device)
                outputs = model.module(inputs)
                acc[0] += criterion(inputs, outputs)
                acc[1] += 1
        dist.all_reduce(acc)
        if rank == 0:
            val_loss = (acc[0] / acc[1]).item()
            writer.add_scalar("val/loss", val_loss, epoch)
            print(f"epoch {epoch} val loss {val_loss:.4f}")
            save_dir = os.path.join(log_path, "models", f"weights_{epoch}")
            os.makedirs(save_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(save_dir, "model.pth"))
            torch.save(optimizer.state_dict(), os.path.join(save_dir, "adam.pth"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
