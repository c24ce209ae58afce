"""RAFT-Stereo fine-tuning on KITTI 2012/2015 (sparse disparity) with DDP.

    torchrun --nproc_per_node=4 train_stereo_kitti.py --restore_ckpt models/raftstereo-sceneflow.pth \
        --batch_size 8 --train_iters 22 --valid_iters 32 --num_steps 50000 --mixed_precision
"""
import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import core.stereo_datasets as datasets
from core.raft_stereo import RAFTStereo
from core.utils.utils import InputPadder


def sequence_loss(disp_preds, disp_gt, valid, loss_gamma=0.9, max_disp=700):
    """Exponentially weighted L1 over all refinement iterations. Works for crops without any GT."""
    n_predictions = len(disp_preds)
    mag = disp_gt.abs().sum(dim=1)
    valid = ((valid >= 0.5) & (mag < max_disp)).unsqueeze(1).float()
    denom = valid.sum().clamp(min=1.0)
    loss = 0.0
    for i in range(n_predictions):
        adjusted = loss_gamma ** (15 / (n_predictions - 1))
        w = adjusted ** (n_predictions - i - 1)
        loss = loss + w * ((disp_preds[i] - disp_gt).abs() * valid).sum() / denom
    epe = ((disp_preds[-1] - disp_gt).abs() * valid).sum(dim=(1, 2, 3))
    return loss, epe.detach(), valid.sum(dim=(1, 2, 3)).detach()


@torch.no_grad()
def validate_kitti(model, val_set, iters, rank, world, device, mixed_prec=False):
    """Each rank takes every world-th image; per-image numbers are gathered as Python lists."""
    model.eval()
    per_image = []
    for idx in range(rank, len(val_set), world):
        _, image1, image2, disp_gt, valid_gt = val_set[idx]
        image1, image2 = image1[None].to(device), image2[None].to(device)
        padder = InputPadder(image1.shape, divis_by=32)
        image1, image2 = padder.pad(image1, image2)
        with torch.cuda.amp.autocast(enabled=mixed_prec):
            _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        disp_pr = padder.unpad(flow_pr.float()).cpu().squeeze(0)
        epe = (disp_pr - disp_gt).abs().flatten()
        val = (valid_gt.flatten() >= 0.5)
        d1 = (epe > 3.0)
        per_image.append((idx, epe[val].mean().item(), d1[val].float().mean().item()))

    gathered = [None] * world
    dist.all_gather_object(gathered, per_image)
    model.train()
    rows = sorted(r for part in gathered for r in part)
    epe = float(np.mean([r[1] for r in rows]))
    d1 = 100.0 * float(np.mean([r[2] for r in rows]))
    return {"kitti-epe": epe, "kitti-d1": d1}, rows


def fetch_train_set(args):
    aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False,
           "yjitter": True, "saturation_range": [0, 1.4]}
    k15 = datasets.KITTI(aug, root=args.kitti15_root, image_set="training")
    k12 = datasets.KITTI(aug, root=args.kitti12_root, image_set="training")
    return ConcatDataset([k15, k12])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="raft-stereo-kitti")
    p.add_argument("--restore_ckpt", required=True)
    p.add_argument("--kitti15_root", default="datasets/KITTI/2015")
    p.add_argument("--kitti12_root", default="datasets/KITTI/2012")
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--batch_size", type=int, default=8, help="total")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--wdecay", type=float, default=1e-5)
    p.add_argument("--num_steps", type=int, default=50000)
    p.add_argument("--image_size", type=int, nargs=2, default=[320, 1024])
    p.add_argument("--train_iters", type=int, default=22)
    p.add_argument("--valid_iters", type=int, default=32)
    p.add_argument("--hidden_dims", type=int, nargs="+", default=[128] * 3)
    p.add_argument("--corr_implementation", default="reg")
    p.add_argument("--shared_backbone", action="store_true")
    p.add_argument("--corr_levels", type=int, default=4)
    p.add_argument("--corr_radius", type=int, default=4)
    p.add_argument("--n_downsample", type=int, default=2)
    p.add_argument("--context_norm", default="batch")
    p.add_argument("--slow_fast_gru", action="store_true")
    p.add_argument("--n_gru_layers", type=int, default=3)
    p.add_argument("--val_freq", type=int, default=5000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)-8s [%(filename)s:%(lineno)d] %(message)s")
    torch.manual_seed(666)
    np.random.seed(666)

    model = RAFTStereo(args)
    ckpt = torch.load(args.restore_ckpt, map_location="cpu")
    ckpt = {k[7:] if k.startswith("module.") else k: v for k, v in ckpt.items()}
    model.load_state_dict(ckpt, strict=True)
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)
    model.train()
    model.module.freeze_bn()  # context BatchNorm keeps its SceneFlow statistics

    train_set = fetch_train_set(args)
    val_set = datasets.KITTI({}, root=args.kitti15_root, image_set="training")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, pin_memory=True,
                        num_workers=int(os.environ.get("SLURM_CPUS_PER_TASK", 6)) - 2, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.01,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    writer = SummaryWriter(f"runs/{args.name}") if rank == 0 else None
    ckpt_dir = Path("checkpoints")
    if rank == 0:
        ckpt_dir.mkdir(exist_ok=True, parents=True)

    step, epoch = 0, 0
    acc = torch.zeros(3, device=device)
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for _, left, right, disp_gt, valid in loader:
            left, right = left.to(device, non_blocking=True), right.to(device, non_blocking=True)
            disp_gt, valid = disp_gt.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(left, right, iters=args.train_iters)
            loss, epe_sum, n_valid = sequence_loss(preds, disp_gt, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            acc += torch.stack([loss.detach().float(), epe_sum.sum().float(), n_valid.sum().float()])
            if step % 100 == 0:
                dist.all_reduce(acc)
                if rank == 0:
                    logging.info("step %d loss %.4f epe %.3f", step, acc[0].item() / (100 * world),
                                 acc[1].item() / max(acc[2].item(), 1.0))
                    writer.add_scalar("train/loss", acc[0].item() / (100 * world), step)
                    writer.add_scalar("train/epe", acc[1].item() / max(acc[2].item(), 1.0), step)
                    writer.add_scalar("lr", scheduler.get_last_lr()[0], step)
                acc.zero_()

            if step % args.val_freq == 0:
                if rank == 0:
                    torch.save(model.module.state_dict(), ckpt_dir / f"{step}_{args.name}.pth")
                results, _ = validate_kitti(model.module, val_set, args.valid_iters, rank, world, device,
                                            args.mixed_precision)
                model.module.freeze_bn()
                if rank == 0:
                    logging.info("validation %s", results)
                    for k, v in results.items():
                        writer.add_scalar("val/" + k, v, step)
            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), ckpt_dir / f"{args.name}.pth")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
