"""RAFT training with auto-resume from the newest checkpoint in the run directory.
Meant for preemptible nodes: the job is simply resubmitted with the same command.

    torchrun --nproc_per_node=8 10_raft_autoresume.py --run_dir /shared/runs/raft_things \
        --stage things --restore_ckpt /shared/models/raft-chairs.pth
"""
import argparse
import glob
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.raft import RAFT

MAX_FLOW = 400


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--run_dir", required=True)
    p.add_argument("--stage", choices=["chairs", "things", "sintel", "kitti"], default="things")
    p.add_argument("--restore_ckpt", default=None, help="weights to start from when no run checkpoint exists")
    p.add_argument("--small", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--alternate_corr", action="store_true")
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--lr", type=float, default=1.25e-4)
    p.add_argument("--num_steps", type=int, default=100000)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--image_size", type=int, nargs=2, default=[400, 720])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--gamma", type=float, default=0.8)
    p.add_argument("--wdecay", type=float, default=1e-4)
    p.add_argument("--ckpt_every", type=int, default=2500)
    p.add_argument("--keep", type=int, default=3)
    return p.parse_args()


def build_dataset(args):
    if args.stage == "chairs":
        aug = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug, split="training")
    if args.stage == "things":
        aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        return (datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
                + datasets.FlyingThings3D(aug, dstype="frames_finalpass"))
    if args.stage == "sintel":
        aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        things = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        clean = datasets.MpiSintel(aug, split="training", dstype="clean")
        final = datasets.MpiSintel(aug, split="training", dstype="final")
        kitti = datasets.KITTI({"crop_size": args.image_size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
        hd1k = datasets.HD1K({"crop_size": args.image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
        return 100 * clean + 100 * final + 200 * kitti + 5 * hd1k + things
    aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
    return datasets.KITTI(aug, split="training")


def sequence_loss(preds, gt, valid, gamma):
    n = len(preds)
    mag = torch.sum(gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    loss = 0.0
    for i, pred in enumerate(preds):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (pred - gt).abs()).mean()
    epe = torch.sum((preds[-1] - gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return loss, epe


def latest_checkpoint(run_dir):
    files = glob.glob(os.path.join(run_dir, "step_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.findall(r"step_(\d+)\.pt", f)[0]))


def save_checkpoint(run_dir, step, epoch, model, optimizer, scheduler, scaler, keep):
    path = os.path.join(run_dir, f"step_{step:07d}.pt")
    tmp = path + ".tmp"
    torch.save({"step": step, "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict()}, tmp)
    os.replace(tmp, path)
    old = sorted(glob.glob(os.path.join(run_dir, "step_*.pt")))[:-keep]
    for f in old:
        os.remove(f)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)

    model = RAFT(args).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    dist.barrier()

    step, epoch = 0, 0
    resume_path = latest_checkpoint(args.run_dir)
    if resume_path is not None:
        ckpt = torch.load(resume_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step, epoch = ckpt["step"], ckpt["epoch"]
        del ckpt
        if rank == 0:
            print(f"resumed from {resume_path} at step {step}", flush=True)
    elif args.restore_ckpt:
        weights = torch.load(args.restore_ckpt, map_location="cpu")
        weights = {k[7:] if k.startswith("module.") else k: v for k, v in weights.items()}
        model.module.load_state_dict(weights)

    train_set = build_dataset(args)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)

    model.train()
    if args.stage != "chairs":
        model.module.freeze_bn()
    tic = time.time()
    stats = torch.zeros(3, device=device)
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2 = img1.to(device, non_blocking=True), img2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(img1, img2, iters=args.iters)
            loss, epe = sequence_loss([p.float() for p in preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            stats += torch.stack([loss.detach(), epe.sum(), torch.tensor(float(epe.numel()), device=device)])
            if step % 100 == 0:
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"step {step:7d} loss {stats[0].item() / (100 * world):.4f} "
                          f"epe {stats[1].item() / max(stats[2].item(), 1.0):.3f} "
                          f"{time.time() - tic:.1f}s", flush=True)
                stats.zero_()
                tic = time.time()
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save_checkpoint(args.run_dir, step, epoch, model, optimizer, scheduler, scaler, args.keep)
                dist.barrier()
            if step >= args.num_steps:
                break
        else:
            epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.run_dir, "final.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
