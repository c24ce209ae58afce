"""Fine-tune RAFT-Stereo on KITTI 2012 + 2015 (sparse LiDAR disparity) with DDP.

    torchrun --nproc_per_node=4 05_raft_stereo_kitti.py --name raftstereo-kitti \
        --restore_ckpt models/raftstereo-sceneflow.pth --batch_size 8 --num_steps 50000
"""
from __future__ import print_function, division

import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from core.raft_stereo import RAFTStereo
import core.stereo_datasets as datasets
from core.utils.utils import InputPadder


def sequence_loss(flow_preds, flow_gt, valid, loss_gamma=0.9, max_flow=700):
    """ Loss function defined over sequence of flow predictions """
    n_predictions = len(flow_preds)
    assert n_predictions >= 1
    flow_loss = 0.0

    # exclude invalid pixels and extremely large displacements
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()

    # exclude extremely large displacements
    valid = ((valid >= 0.5) & (mag < max_flow)).unsqueeze(1)
    assert valid.shape == flow_gt.shape, [valid.shape, flow_gt.shape]
    assert not torch.isinf(flow_gt[valid.bool()]).any()

    for i in range(n_predictions):
        assert not torch.isnan(flow_preds[i]).any() and not torch.isinf(flow_preds[i]).any()
        # We adjust the loss_gamma so it is consistent for any number of RAFT-Stereo iterations
        adjusted_loss_gamma = loss_gamma ** (15 / (n_predictions - 1))
        i_weight = adjusted_loss_gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * i_loss[valid.bool()].mean()

    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    metrics = torch.stack([epe.mean(), (epe < 1).float().mean(), (epe < 3).float().mean()])
    return flow_loss, metrics


def fetch_optimizer(args, model):
    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                              pct_start=0.01, cycle_momentum=False, anneal_strategy="linear")
    return optimizer, scheduler


@torch.no_grad()
def validate_kitti(model, val_dataset, device, iters, rank, world_size):
    """Bad-3 / EPE on the held-out KITTI 2015 images, sharded over the ranks."""
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)  # epe sum, d1 sum, count
    for val_id in range(rank, len(val_dataset), world_size):
        _, image1, image2, flow_gt, valid_gt = val_dataset[val_id]
        image1 = image1[None].to(device)
        image2 = image2[None].to(device)
        padder = InputPadder(image1.shape, divis_by=32)
        image1, image2 = padder.pad(image1, image2)
        with torch.autocast("cuda", enabled=args.mixed_precision):
            _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        flow_pr = padder.unpad(flow_pr).cpu().squeeze(0)

        epe = torch.sum((flow_pr - flow_gt) ** 2, dim=0).sqrt().flatten()
        val = valid_gt.flatten() >= 0.5
        out = (epe > 3.0)
        acc[0] += epe[val].mean().item()
        acc[1] += out[val].float().mean().item()
        acc[2] += 1
    dist.all_reduce(acc)
    model.train()
    model.freeze_bn()
    return {"kitti-epe": (acc[0] / acc[2]).item(), "kitti-d1": 100 * (acc[1] / acc[2]).item()}


def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    np.random.seed(1234 + rank)

    model = RAFTStereo(args)
    if args.restore_ckpt is not None:
        assert args.restore_ckpt.endswith(".pth")
        checkpoint = torch.load(args.restore_ckpt, map_location="cpu")
        checkpoint = {k.replace("module.", "", 1): v for k, v in checkpoint.items()}
        model.load_state_dict(checkpoint, strict=True)
        if rank == 0:
            logging.info("Loaded checkpoint %s", args.restore_ckpt)
    model.to(device)
    model.train()
    model.freeze_bn()  # keep BatchNorm frozen
    model = DDP(model, device_ids=[local_rank])

    aug_params = {"crop_size": args.image_size, "min_scale": args.spatial_scale[0],
                  "max_scale": args.spatial_scale[1], "do_flip": False, "yjitter": not args.noyjitter}
    kitti15 = datasets.KITTI(aug_params, image_set="training", year=2015)
    kitti12 = datasets.KITTI(aug_params, image_set="training", year=2012)
    # last 40 images of KITTI 2015 are kept for validation
    train_set = torch.utils.data.ConcatDataset([Subset(kitti15, range(0, len(kitti15) - 40)), kitti12])
    val_set = datasets.KITTI({}, image_set="training", year=2015)
    val_set = Subset(val_set, range(len(val_set) - 40, len(val_set)))

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                              pin_memory=True, num_workers=args.workers, drop_last=True)

    optimizer, scheduler = fetch_optimizer(args, model)
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    writer = SummaryWriter(log_dir=os.path.join("runs", args.name)) if rank == 0 else None

    total_steps = 0
    epoch = 0
    running = torch.zeros(3, device=device)
    n_running = 0
    should_keep_training = True
    while should_keep_training:
        sampler.set_epoch(epoch)
        for i_batch, (_, *data_blob) in enumerate(tqdm(train_loader, disable=rank != 0)):
            optimizer.zero_grad()
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]

            # KITTI crops sometimes land almost entirely above the LiDAR range
            if valid.sum() < args.min_valid_px:
                continue

            flow_predictions = model(image1, image2, iters=args.train_iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            running += metrics.detach()
            n_running += 1
            total_steps += 1

            if total_steps % 100 == 0:
                dist.all_reduce(running)
                running /= world_size
                if writer is not None:
                    writer.add_scalar("lr", optimizer.param_groups[0]["lr"], total_steps)
                    for k, v in zip(["epe", "1px", "3px"], (running / max(n_running, 1)).tolist()):
                        writer.add_scalar("train/" + k, v, total_steps)
                running.zero_()
                n_running = 0

            if total_steps % args.valid_freq == 0:
                results = validate_kitti(model.module, val_set, device, args.valid_iters, rank, world_size)
                if rank == 0:
                    save_path = Path("checkpoints/%d_%s.pth" % (total_steps, args.name))
                    torch.save(model.module.state_dict(), save_path)
                    logging.info("step %d: %s", total_steps, results)
                    for k, v in results.items():
                        writer.add_scalar(k, v, total_steps)
                dist.barrier()

            if total_steps > args.num_steps:
                should_keep_training = False
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), "checkpoints/%s.pth" % args.name)
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-stereo", help="name your experiment")
    parser.add_argument("--restore_ckpt", default=None, help="restore checkpoint")
    parser.add_argument("--mixed_precision", action="store_true", help="use mixed precision")

    # Training parameters
    parser.add_argument("--batch_size", type=int, default=8, help="global batch size used during training.")
    parser.add_argument("--lr", type=float, default=0.0001, help="max learning rate.")
    parser.add_argument("--num_steps", type=int, default=50000, help="length of training schedule.")
    parser.add_argument("--image_size", type=int, nargs="+", default=[320, 1000], help="size of the random image crops")
    parser.add_argument("--train_iters", type=int, default=22)
    parser.add_argument("--wdecay", type=float, default=0.00001, help="Weight decay in optimizer.")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--min_valid_px", type=int, default=500)
    parser.add_argument("--valid_freq", type=int, default=5000)

    # Validation parameters
    parser.add_argument("--valid_iters", type=int, default=32, help="number of flow-field updates during validation forward pass")

    # Architecure choices
    parser.add_argument("--corr_implementation", choices=["reg", "alt", "reg_cuda", "alt_cuda"], default="reg")
    parser.add_argument("--shared_backbone", action="store_true", help="use a single backbone for the context and feature encoders")
    parser.add_argument("--corr_levels", type=int, default=4, help="number of levels in the correlation pyramid")
    parser.add_argument("--corr_radius", type=int, default=4, help="width of the correlation pyramid")
    parser.add_argument("--n_downsample", type=int, default=2, help="resolution of the disparity field (1/2^K)")
    parser.add_argument("--context_norm", type=str, default="batch", choices=["group", "batch", "instance", "none"])
    parser.add_argument("--slow_fast_gru", action="store_true", help="iterate the low-res GRUs more frequently")
    parser.add_argument("--n_gru_layers", type=int, default=3, help="number of hidden GRU levels")
    parser.add_argument("--hidden_dims", nargs="+", type=int, default=[128] * 3, help="hidden state and context dimensions")

    # Data augmentation
    parser.add_argument("--img_gamma", type=float, nargs="+", default=None, help="gamma range")
    parser.add_argument("--saturation_range", type=float, nargs="+", default=None, help="color saturation")
    parser.add_argument("--do_flip", default=False, choices=["h", "v"], help="flip the images horizontally or vertically")
    parser.add_argument("--spatial_scale", type=float, nargs="+", default=[-0.2, 0.4], help="re-scale the images randomly")
    parser.add_argument("--noyjitter", action="store_true", help="don't simulate imperfect rectification")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)-8s [%(filename)s:%(lineno)d] %(message)s")
    Path("checkpoints").mkdir(exist_ok=True, parents=True)

    train(args)
