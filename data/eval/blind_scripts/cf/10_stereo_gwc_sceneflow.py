#!/usr/bin/env python
"""GwcNet training on SceneFlow (FlyingThings3D + Driving + Monkaa), multi-GPU.

Usage:
    torchrun --nproc_per_node=4 main_ddp.py --model gwcnet-gc --datapath /data/SceneFlow \
        --trainlist ./filenames/sceneflow_train.txt --testlist ./filenames/sceneflow_test.txt \
        --epochs 16 --lrepochs "10,12,14,16:2" --batch_size 4 --logdir ./checkpoints/sceneflow/gwcnet-gc
"""
import argparse
import gc
import os
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from datasets import __datasets__
from models import __models__

cudnn.benchmark = True

parser = argparse.ArgumentParser(description="Group-wise Correlation Stereo Network (GwcNet)")
parser.add_argument("--model", default="gwcnet-g", help="select a model structure", choices=__models__.keys())
parser.add_argument("--maxdisp", type=int, default=192, help="maximum disparity")
parser.add_argument("--dataset", default="sceneflow", help="dataset name", choices=__datasets__.keys())
parser.add_argument("--datapath", required=True, help="data path")
parser.add_argument("--trainlist", required=True, help="training list")
parser.add_argument("--testlist", required=True, help="testing list")
parser.add_argument("--lr", type=float, default=0.001, help="base learning rate")
parser.add_argument("--batch_size", type=int, default=4, help="training batch size per GPU")
parser.add_argument("--test_batch_size", type=int, default=4, help="testing batch size per GPU")
parser.add_argument("--epochs", type=int, required=True, help="number of epochs to train")
parser.add_argument("--lrepochs", type=str, required=True, help="the epochs to decay lr: the downscale rate")
parser.add_argument("--logdir", required=True, help="the directory to save logs and checkpoints")
parser.add_argument("--loadckpt", help="load the weights from a specific checkpoint")
parser.add_argument("--resume", action="store_true", help="continue training the model")
parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
parser.add_argument("--summary_freq", type=int, default=20, help="the frequency of saving summary")
parser.add_argument("--save_freq", type=int, default=1, help="the frequency of saving checkpoint")
parser.add_argument("--local_rank", type=int, default=0, help="GPU used by this process")


def adjust_learning_rate(optimizer, epoch, base_lr, lrepochs):
    splits = lrepochs.split(":")
    downscale_epochs = [int(e) for e in splits[0].split(",")]
    downscale_rate = float(splits[1])
    lr = base_lr
    for e in downscale_epochs:
        if epoch >= e:
            lr /= downscale_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def model_loss(disp_ests, disp_gt, mask):
    weights = [0.5, 0.5, 0.7, 1.0]
    return sum(w * F.smooth_l1_loss(d[mask], disp_gt[mask], reduction="mean") for d, w in zip(disp_ests, weights))


def stereo_metrics(disp_est, disp_gt, mask):
    """Sums so that they can be all-reduced: [epe_sum, d1_count, >1px, >2px, >3px, n_valid]."""
    est, gt = disp_est[mask], disp_gt[mask]
    err = (est - gt).abs()
    d1 = ((err > 3) & (err / gt.abs() > 0.05)).float().sum()
    return torch.stack([err.sum(), d1, (err > 1).float().sum(), (err > 2).float().sum(),
                        (err > 3).float().sum(), mask.float().sum()])


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        logger = SummaryWriter(args.logdir)
        print("creating new summary file")

    StereoDataset = __datasets__[args.dataset]
    train_dataset = StereoDataset(args.datapath, args.trainlist, True)
    test_dataset = StereoDataset(args.datapath, args.testlist, False)
    train_sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    TrainImgLoader = DataLoader(train_dataset, args.batch_size, sampler=train_sampler, num_workers=8,
                                pin_memory=True, drop_last=True)
    # strided shard instead of DistributedSampler so that no test sample is counted twice
    test_shard = Subset(test_dataset, list(range(rank, len(test_dataset), world_size)))
    TestImgLoader = DataLoader(test_shard, args.test_batch_size, shuffle=False, num_workers=4,
                               pin_memory=True, drop_last=False)

    model = __models__[args.model](args.maxdisp)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda(args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    start_epoch = 0
    if args.resume:
        all_saved_ckpts = [fn for fn in os.listdir(args.logdir) if fn.endswith(".ckpt")]
        all_saved_ckpts = sorted(all_saved_ckpts, key=lambda x: int(x.split("_")[-1].split(".")[0]))
        loadckpt = os.path.join(args.logdir, all_saved_ckpts[-1])
        if rank == 0:
            print("loading the lastest model in logdir: {}".format(loadckpt))
        state_dict = torch.load(loadckpt, map_location="cuda:{}".format(args.local_rank))
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optimizer"])
        start_epoch = state_dict["epoch"] + 1
    elif args.loadckpt:
        state_dict = torch.load(args.loadckpt, map_location="cpu")
        model.load_state_dict(state_dict["model"])

    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    for epoch_idx in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch_idx)
        lr = adjust_learning_rate(optimizer, epoch_idx, args.lr, args.lrepochs)
        model.train()
        for batch_idx, sample in enumerate(TrainImgLoader):
            global_step = len(TrainImgLoader) * epoch_idx + batch_idx
            start_time = time.time()
            imgL = sample["left"].cuda(args.local_rank, non_blocking=True)
            imgR = sample["right"].cuda(args.local_rank, non_blocking=True)
            disp_gt = sample["disparity"].cuda(args.local_rank, non_blocking=True)
            mask = (disp_gt < args.maxdisp) & (disp_gt > 0)

            optimizer.zero_grad()
            disp_ests = model(imgL, imgR)
            loss = model_loss(disp_ests, disp_gt, mask)
            loss.backward()
            optimizer.step()

            if global_step % args.summary_freq == 0:
                with torch.no_grad():
                    m = stereo_metrics(disp_ests[-1].detach(), disp_gt, mask)
                    red = torch.cat([loss.detach().view(1), m])
                    dist.all_reduce(red)
                if rank == 0:
                    n = red[6].clamp(min=1)
                    logger.add_scalar("train/loss", red[0].item() / world_size, global_step)
                    logger.add_scalar("train/EPE", (red[1] / n).item(), global_step)
                    logger.add_scalar("train/D1", (red[2] / n).item(), global_step)
                    logger.add_scalar("train/lr", lr, global_step)
                    print("Epoch {}/{}, Iter {}/{}, train loss = {:.3f}, time = {:.3f}".format(
                        epoch_idx, args.epochs, batch_idx, len(TrainImgLoader), red[0].item() / world_size,
                        time.time() - start_time))

        if rank == 0 and (epoch_idx + 1) % args.save_freq == 0:
            checkpoint_data = {"epoch": epoch_idx, "model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict()}
            torch.save(checkpoint_data, "{}/checkpoint_{:0>6}.ckpt".format(args.logdir, epoch_idx))
        gc.collect()

        # testing
        model.eval()
        totals = torch.zeros(6, device="cuda")
        with torch.no_grad():
            for sample in TestImgLoader:
                imgL = sample["left"].cuda(args.local_rank, non_blocking=True)
                imgR = sample["right"].cuda(args.local_rank, non_blocking=True)
                disp_gt = sample["disparity"].cuda(args.local_rank, non_blocking=True)
                mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
                disp_ests = model.module(imgL, imgR)
                totals += stereo_metrics(disp_ests[-1], disp_gt, mask)
        dist.all_reduce(totals)
        if rank == 0:
            n = totals[5].item()
            names = ["EPE", "D1", "Thres1", "Thres2", "Thres3"]
            avg = {k: totals[i].item() / n for i, k in enumerate(names)}
            for k, v in avg.items():
                logger.add_scalar("test/" + k, v, epoch_idx)
            print("avg_test_scalars", avg)
        dist.barrier()
        gc.collect()

    if rank == 0:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
