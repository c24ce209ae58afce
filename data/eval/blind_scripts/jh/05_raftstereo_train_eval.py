"""RAFT-Stereo training on SceneFlow with periodic KITTI-2015 validation (D1, EPE).

Usage:
  torchrun --nproc_per_node=8 05_raftstereo_train_eval.py \
      --train_datasets sceneflow --kitti_root /data/kitti15 --batch_size 1 --num_steps 200000
"""
import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from core.raft_stereo import RAFTStereo
import core.stereo_datasets as stereo_datasets
from core.utils.utils import InputPadder

logger = logging.getLogger(__name__)


def sequence_loss(disp_preds, disp_gt, valid, loss_gamma=0.9, max_disp=700):
    """Exponentially weighted L1 over all GRU iterations."""
    n_predictions = len(disp_preds)
    mag = torch.sum(disp_gt ** 2, dim=1).sqrt()
    valid = ((valid >= 0.5) & (mag < max_disp)).unsqueeze(1)
    loss = 0.0
    for i in range(n_predictions):
        adjusted_gamma = loss_gamma ** (15 / (n_predictions - 1))
        w = adjusted_gamma ** (n_predictions - i - 1)
        i_loss = (disp_preds[i] - disp_gt).abs()
        loss = loss + w * i_loss[valid.bool()].mean()
    epe = torch.sum((disp_preds[-1] - disp_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    return loss, epe


@torch.no_grad()
def validate_kitti(model, root, rank, world, iters=32, mixed_prec=False):
    """Sharded evaluation: every rank runs its slice of the 200 pairs, then the
    per-pixel errors are gathered so D1 is computed over all valid pixels."""
    model.eval()
    val_dataset = stereo_datasets.KITTI({}, root=root, image_set="training")
    errors = []
    for idx in range(rank, len(val_dataset), world):
        _, image1, image2, disp_gt, valid_gt = val_dataset[idx]
        image1 = image1[None].cuda()
        image2 = image2[None].cuda()
        padder = InputPadder(image1.shape, divis_by=32)
        image1, image2 = padder.pad(image1, image2)
        with torch.cuda.amp.autocast(enabled=mixed_prec):
            _, disp_pr = model(image1, image2, iters=iters, test_mode=True)
        disp_pr = padder.unpad(disp_pr.float()).cpu().squeeze(0)
        epe = torch.sum((disp_pr - disp_gt) ** 2, dim=0).sqrt().flatten()
        val = (valid_gt.flatten() >= 0.5) & (disp_gt.abs().flatten() < 192)
        errors.append(torch.stack([epe[val], disp_gt.abs().flatten()[val]], dim=0))
    local = torch.cat(errors, dim=1).cuda()
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allerr = torch.cat(gathered, dim=1)
    epe, gt = allerr[0], allerr[1]
    d1 = ((epe > 3.0) & (epe > 0.05 * gt)).float().mean().item() * 100
    model.train()
    return {"kitti-epe": epe.mean().item(), "kitti-d1": d1}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-stereo")
    parser.add_argument("--restore_ckpt", default=None)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--train_datasets", nargs="+", default=["sceneflow"])
    parser.add_argument("--kitti_root", default="datasets/KITTI")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--num_steps", type=int, default=200000)
    parser.add_argument("--image_size", type=int, nargs="+", default=[320, 720])
    parser.add_argument("--train_iters", type=int, default=16)
    parser.add_argument("--valid_iters", type=int, default=32)
    parser.add_argument("--wdecay", type=float, default=1e-5)
    parser.add_argument("--validation_frequency", type=int, default=10000)
    # architecture
    parser.add_argument("--corr_implementation", default="reg", choices=["reg", "alt"])
    parser.add_argument("--shared_backbone", action="store_true")
    parser.add_argument("--corr_levels", type=int, default=4)
    parser.add_argument("--corr_radius", type=int, default=4)
    parser.add_argument("--n_downsample", type=int, default=2)
    parser.add_argument("--context_norm", default="batch")
    parser.add_argument("--slow_fast_gru", action="store_true")
    parser.add_argument("--n_gru_layers", type=int, default=3)
    parser.add_argument("--hidden_dims", nargs="+", type=int, default=[128] * 3)
    # augmentation
    parser.add_argument("--img_gamma", type=float, nargs="+", default=None)
    parser.add_argument("--saturation_range", type=float, nargs="+", default=None)
    parser.add_argument("--do_flip", default=False, choices=["h", "v"])
    parser.add_argument("--spatial_scale", type=float, nargs="+", default=[-0.2, 0.4])
    parser.add_argument("--noyjitter", action="store_true")
    return parser.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)-8s [%(filename)s:%(lineno)d] %(message)s")
    torch.manual_seed(666)
    np.random.seed(666 + rank)

    model = RAFTStereo(args)
    if args.restore_ckpt is not None:
        ckpt = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.removeprefix("module."): v for k, v in ckpt.items()}, strict=True)
        logger.info("loaded %s", args.restore_ckpt)
    model.cuda()
    model.freeze_bn()
    model = DDP(model, device_ids=[local_rank])

    train_dataset = stereo_datasets.fetch_dataset(args)  # concatenation of the chosen sets
    sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=sampler,
                              pin_memory=True, num_workers=8, drop_last=True)
    logger.info("training with %d image pairs on %d GPUs", len(train_dataset), world)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                                    pct_start=0.01, cycle_momentum=False,
                                                    anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    ckpt_dir = Path("checkpoints")
    if rank == 0:
        ckpt_dir.mkdir(exist_ok=True, parents=True)

    total_steps, epoch = 0, 0
    model.train()
    model.module.freeze_bn()
    keep_training = True
    while keep_training:
        sampler.set_epoch(epoch)
        pbar = tqdm(train_loader, disable=rank != 0, dynamic_ncols=True)
        for image1, image2, disp_gt, valid in pbar:
            image1, image2 = image1.cuda(non_blocking=True), image2.cuda(non_blocking=True)
            disp_gt, valid = disp_gt.cuda(non_blocking=True), valid.cuda(non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                disp_preds = model(image1, image2, iters=args.train_iters)
            loss, epe = sequence_loss([d.float() for d in disp_preds], disp_gt, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()
            total_steps += 1

            if rank == 0 and total_steps % 50 == 0:
                pbar.set_postfix(loss=f"{loss.item():.3f}", epe=f"{epe.mean().item():.3f}",
                                 lr=f"{scheduler.get_last_lr()[0]:.1e}")

            if total_steps % args.validation_frequency == 0:
                if rank == 0:
                    torch.save(model.module.state_dict(), ckpt_dir / f"{total_steps}_{args.name}.pth")
                results = validate_kitti(model.module, args.kitti_root, rank, world,
                                         iters=args.valid_iters, mixed_prec=args.mixed_precision)
                logger.info("step %d: %s", total_steps, results)
                model.module.freeze_bn()

            if total_steps >= args.num_steps:
                keep_training = False
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), ckpt_dir / f"{args.name}.pth")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
