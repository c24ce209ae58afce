"""Monocular depth with stereo + temporal supervision (monodepth2 "MS"), launched with mp.spawn.

single node:  python train_ms.py --data_path /data/kitti_raw --gpus 4
two nodes:    python train_ms.py --nodes 2 --node_rank 0 --master 10.0.0.1 --gpus 8   (and node_rank 1 on the other)
"""
import argparse
import json
import os
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import networks
from datasets import KITTIRAWDataset
from layers import SSIM, BackprojectDepth, Project3D, disp_to_depth, get_smooth_loss
from utils import compute_depth_errors


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", default="/data/kitti_raw")
    p.add_argument("--index_cache", default="/shared/cache/kitti_raw_index.json")
    p.add_argument("--eval_split_gt", default="splits/eigen/gt_depths.npz")
    p.add_argument("--eval_split_files", default="splits/eigen/test_files.txt")
    p.add_argument("--out_dir", default="/shared/exp/ms_640x192")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--master", default="127.0.0.1")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--height", type=int, default=192)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--scales", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--smooth", type=float, default=1e-3)
    return p.parse_args()


def build_index(data_path):
    """List every (folder, frame, side) triplet that has both temporal neighbours."""
    items = []
    for seq in sorted(glob(os.path.join(data_path, "*", "*_sync"))):
        frames = sorted(glob(os.path.join(seq, "image_02", "data", "*.jpg")))
        folder = os.path.relpath(seq, data_path)
        for k in range(1, len(frames) - 1):
            for side in ("l", "r"):
                items.append(f"{folder} {k} {side}")
    return items


class DepthPoseNet(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.encoder = networks.ResnetEncoder(18, True)
        self.decoder = networks.DepthDecoder(self.encoder.num_ch_enc, scales)
        self.pose_encoder = networks.ResnetEncoder(18, True, num_input_images=2)
        self.pose_decoder = networks.PoseDecoder(self.pose_encoder.num_ch_enc, 1, 2)

    def forward(self, inputs):
        out = self.decoder(self.encoder(inputs[("color_aug", 0, 0)]))
        for f_i in (-1, 1):
            pair = (inputs[("color_aug", f_i, 0)], inputs[("color_aug", 0, 0)]) if f_i < 0 else \
                   (inputs[("color_aug", 0, 0)], inputs[("color_aug", f_i, 0)])
            axisangle, translation = self.pose_decoder([self.pose_encoder(torch.cat(pair, 1))])
            out[("axisangle", f_i)] = axisangle
            out[("translation", f_i)] = translation
        return out


def photometric(ssim, pred, target):
    return 0.85 * ssim(pred, target).mean(1, True) + 0.15 * (pred - target).abs().mean(1, True)


def compute_loss(inputs, outputs, opt, ssim, backproject, project):
    from layers import transformation_from_parameters
    total = 0.0
    target = inputs[("color", 0, 0)]
    for scale in opt.scales:
        disp = outputs[("disp", scale)]
        disp_up = F.interpolate(disp, (opt.height, opt.width), mode="bilinear", align_corners=False)
        _, depth = disp_to_depth(disp_up, 0.1, 100.0)
        cam_points = backproject(depth, inputs[("inv_K", 0)])
        reproj, ident = [], []
        for f_i in (-1, 1, "s"):
            if f_i == "s":
                T = inputs["stereo_T"]
            else:
                T = transformation_from_parameters(outputs[("axisangle", f_i)][:, 0],
                                                   outputs[("translation", f_i)][:, 0], invert=(f_i < 0))
            pix = project(cam_points, inputs[("K", 0)], T)
            warped = F.grid_sample(inputs[("color", f_i, 0)], pix, padding_mode="border", align_corners=True)
            reproj.append(photometric(ssim, warped, target))
            ident.append(photometric(ssim, inputs[("color", f_i, 0)], target))
        ident = torch.cat(ident, 1)
        ident = ident + 1e-5 * torch.randn_like(ident)
        loss = torch.cat([ident, torch.cat(reproj, 1)], 1).min(1)[0].mean()
        norm_disp = disp / (disp.mean((2, 3), True) + 1e-7)
        color = F.interpolate(target, disp.shape[-2:], mode="bilinear", align_corners=False)
        total = total + loss + opt.smooth * get_smooth_loss(norm_disp, color) / (2 ** scale)
    return total / len(opt.scales)


@torch.no_grad()
def eval_eigen(net, opt, device):
    gt_depths = np.load(opt.eval_split_gt, fix_imports=True, encoding="latin1", allow_pickle=True)["data"]
    with open(opt.eval_split_files) as f:
        files = f.read().splitlines()
    ds = KITTIRAWDataset(opt.data_path, files, opt.height, opt.width, [0], 4, is_train=False)
    loader = DataLoader(ds, 16, shuffle=False, num_workers=4, pin_memory=True)
    net.eval()
    preds = []
    for inputs in loader:
        disp = net.decoder(net.encoder(inputs[("color", 0, 0)].to(device)))[("disp", 0)]
        preds.append(disp_to_depth(disp, 0.1, 100.0)[0].cpu()[:, 0].numpy())
    net.train()
    preds = np.concatenate(preds)
    errors = []
    for i, gt in enumerate(gt_depths):
        h, w = gt.shape
        pred = 1.0 / cv2_resize(preds[i], w, h)
        mask = (gt > 1e-3) & (gt < 80)
        pred, gt = pred[mask], gt[mask]
        pred *= 5.4  # stereo-trained models are metric
        pred = np.clip(pred, 1e-3, 80)
        errors.append(compute_depth_errors(torch.from_numpy(gt), torch.from_numpy(pred)))
    return np.array([[e.item() for e in err] for err in errors]).mean(0)


def cv2_resize(img, w, h):
    import cv2
    return cv2.resize(img, (w, h))


def worker(gpu, opt):
    rank = opt.node_rank * opt.gpus + gpu
    world_size = opt.nodes * opt.gpus
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://{opt.master}:{opt.port}",
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    torch.backends.cudnn.benchmark = True

    if rank == 0 and not os.path.exists(opt.index_cache):
        os.makedirs(os.path.dirname(opt.index_cache), exist_ok=True)
        tmp = opt.index_cache + ".tmp"
        with open(tmp, "w") as f:
            json.dump(build_index(opt.data_path), f)
        os.replace(tmp, opt.index_cache)
    dist.barrier()
    with open(opt.index_cache) as f:
        filenames = json.load(f)

    frame_ids = [0, -1, 1, "s"]
    train_ds = KITTIRAWDataset(opt.data_path, filenames, opt.height, opt.width, frame_ids, 4, is_train=True)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, opt.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    net = DepthPoseNet(opt.scales)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[gpu], output_device=gpu)
    ssim = SSIM().to(device)
    backproject = BackprojectDepth(opt.batch_size, opt.height, opt.width).to(device)
    project = Project3D(opt.batch_size, opt.height, opt.width).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=opt.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 15, 0.1)

    for epoch in range(opt.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for inputs in loader:
            inputs = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in inputs.items()}
            outputs = model(inputs)
            loss = compute_loss(inputs, outputs, opt, ssim, backproject, project)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)

        if rank == 0:
            print(f"epoch {epoch}: loss {(running[0] / running[1]).item():.4f}")
            metrics = eval_eigen(model.module, opt, device)
            print("  abs_rel %.3f sq_rel %.3f rmse %.3f rmse_log %.3f a1 %.3f a2 %.3f a3 %.3f" % tuple(metrics))
            os.makedirs(opt.out_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optimizer.state_dict()},
                       os.path.join(opt.out_dir, f"epoch_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    opt = get_opts()
    mp.spawn(worker, nprocs=opt.gpus, args=(opt,), join=True)
