"""IRR-PWC with joint occlusion estimation: FlyingChairsOcc + Sintel + KITTI mix, DDP + grad accumulation.

KITTI has no occlusion ground truth, so the occlusion decoder is only run for batches that
have it; DDP therefore has to look for unused parameters.

    torchrun --nproc_per_node=4 train_irr.py --batch_per_gpu 2 --accum 2 --stage mixed --resume auto
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from irr.datasets import FlyingChairsOcc, KittiComb, SintelTraining
from irr.models import IRRPWCOcc

BASE_LR = 1e-4          # for an effective batch of 8
BASE_BATCH = 8


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["chairs", "mixed"], default="mixed")
    p.add_argument("--data_root", default="/datasets")
    p.add_argument("--batch_per_gpu", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--div_flow", type=float, default=0.05)
    p.add_argument("--occ_weight", type=float, default=0.5)
    p.add_argument("--resume", default=None)
    p.add_argument("--init", default=None, help="weights from the chairs stage")
    p.add_argument("--save_dir", default="/shared/irr_runs/mixed")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def build_sets(args):
    root = args.data_root
    if args.stage == "chairs":
        train = FlyingChairsOcc(os.path.join(root, "FlyingChairsOcc"), split="train", photometric_aug=True)
        val = FlyingChairsOcc(os.path.join(root, "FlyingChairsOcc"), split="valid")
        return train, val
    sintel = SintelTraining(os.path.join(root, "MPI-Sintel"), dstype="full", split="train", photometric_aug=True)
    kitti = KittiComb(os.path.join(root, "KITTI"), split="train", photometric_aug=True, crop_size=[320, 896])
    train = ConcatDataset([sintel, kitti, kitti])
    val = SintelTraining(os.path.join(root, "MPI-Sintel"), dstype="full", split="valid")
    return train, val


def multiscale_loss(out, flow_gt, valid, occ_gt, has_occ, div_flow, occ_weight):
    weights = [0.32, 0.08, 0.02, 0.01, 0.005]
    target = flow_gt * div_flow
    total = 0.0
    for level, pred in enumerate(out["flow"]):
        h, w = pred.shape[-2:]
        if valid is not None and not bool(valid.all()):
            # sparse KITTI: evaluate at full resolution
            up = F.interpolate(pred, flow_gt.shape[-2:], mode="bilinear", align_corners=False)
            epe = torch.norm(up - target, p=2, dim=1)
            total = total + weights[level] * (epe * valid).sum() / valid.sum().clamp(min=1.0)
        else:
            tgt = F.interpolate(target, (h, w), mode="bilinear", align_corners=False)
            total = total + weights[level] * torch.norm(pred - tgt, p=2, dim=1).sum() / pred.shape[0]
    if "occ" in out:
        for level, occ in enumerate(out["occ"]):
            occ_t = F.interpolate(occ_gt, occ.shape[-2:], mode="bilinear", align_corners=False)
            bce = F.binary_cross_entropy_with_logits(occ, occ_t, reduction="sum") / occ.shape[0]
            total = total + occ_weight * weights[level] * bce
    return total


@torch.no_grad()
def evaluate(model, val_set, device, rank, world, div_flow):
    model.eval()
    shard = Subset(val_set, list(range(rank, len(val_set), world)))
    loader = DataLoader(shard, batch_size=1, num_workers=2)
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        im1, im2, flow_gt = batch["im1"].to(device), batch["im2"].to(device), batch["flow"].to(device)
        flow = model(im1, im2, with_occ=False)["flow"][-1] / div_flow
        flow = F.interpolate(flow, flow_gt.shape[-2:], mode="bilinear", align_corners=False)
        epe = torch.norm(flow - flow_gt, p=2, dim=1)
        acc[0] += epe.sum().double()
        acc[1] += epe.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    effective_batch = args.batch_per_gpu * args.accum * world
    lr = BASE_LR * effective_batch / BASE_BATCH
    if rank == 0:
        print(f"world={world} effective batch={effective_batch} lr={lr:.2e}")

    train_set, val_set = build_sets(args)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = IRRPWCOcc().to(device)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu")["state_dict"])
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=4e-4)
    updates_per_epoch = len(loader) // args.accum
    milestones = [int(args.epochs * f) * updates_per_epoch for f in (0.5, 0.75, 0.875)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.5)

    start_epoch = 0
    ckpt_path = os.path.join(args.save_dir, "latest.pth")
    if args.resume == "auto" and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed at epoch {start_epoch}")

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        n_micro = (len(loader) // args.accum) * args.accum
        for it, batch in enumerate(loader):
            if it >= n_micro:
                break
            im1, im2 = batch["im1"].to(device, non_blocking=True), batch["im2"].to(device, non_blocking=True)
            flow_gt = batch["flow"].to(device, non_blocking=True)
            valid = batch["valid"].to(device, non_blocking=True)
            occ_gt = batch["occ"].to(device, non_blocking=True)
            has_occ = bool(batch["has_occ"].all())

            sync_now = (it + 1) % args.accum == 0
            if sync_now:
                out = model(im1, im2, with_occ=has_occ)
                loss = multiscale_loss(out, flow_gt, valid, occ_gt, has_occ, args.div_flow, args.occ_weight)
                (loss / args.accum).backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    out = model(im1, im2, with_occ=has_occ)
                    loss = multiscale_loss(out, flow_gt, valid, occ_gt, has_occ, args.div_flow, args.occ_weight)
                    (loss / args.accum).backward()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(stats)
        epe = evaluate(model.module, val_set, device, rank, world, args.div_flow)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.3f} val EPE {epe:.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "val_epe": epe}
            tmp = ckpt_path + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, ckpt_path)
            if not math.isnan(epe) and (epoch + 1) % 20 == 0:
                torch.save(state, os.path.join(args.save_dir, f"epoch_{epoch:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
