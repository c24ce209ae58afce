"""Single-node multi-GPU RAFT fine-tuning on KITTI-2015 + VKITTI2, started with
torch.multiprocessing.spawn (no torchrun on this cluster image).

    python 13_raft_spawn_kitti.py --restore_ckpt models/raft-things.pth --gpus 4
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler

import wandb
from core import datasets
from core.raft import RAFT
from core.utils.utils import InputPadder


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sequence_loss(preds, gt, valid, gamma=0.85, max_flow=400.0):
    n = len(preds)
    mag = torch.sum(gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i, p in enumerate(preds):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean()
    return loss


@torch.no_grad()
def validate_kitti(net, device, rank, world, iters=24):
    """Each rank runs pairs rank, rank+world, ...; EPE is averaged per image (KITTI
    convention) and Fl-all over all valid pixels, both from summed statistics."""
    net.eval()
    val_set = datasets.KITTI(split="training")
    # [sum of per-image EPE, number of images, outlier pixels, valid pixels]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for idx in range(rank, len(val_set), world):
        img1, img2, flow_gt, valid_gt = val_set[idx]
        img1, img2 = img1[None].to(device), img2[None].to(device)
        flow_gt, valid_gt = flow_gt.to(device), valid_gt.to(device)
        padder = InputPadder(img1.shape, mode="kitti")
        img1, img2 = padder.pad(img1, img2)
        _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
        flow = padder.unpad(flow_pr[0])
        epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt().view(-1)
        mag = torch.sum(flow_gt ** 2, dim=0).sqrt().view(-1)
        val = valid_gt.view(-1) >= 0.5
        out = (epe > 3.0) & ((epe / mag) > 0.05)
        acc += torch.stack([epe[val].mean().double(), torch.ones((), dtype=torch.float64, device=device),
                            out[val].sum().double(), val.sum().double()])
    dist.all_reduce(acc)
    net.train()
    return {"kitti-epe": (acc[0] / acc[1]).item(), "kitti-f1": 100.0 * (acc[2] / acc[3]).item()}


def worker(local_rank, world_size, port, args):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + local_rank)
    torch.manual_seed(args.seed + local_rank)

    model = RAFT(args)
    if args.restore_ckpt:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()})
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
    kitti = datasets.KITTI(aug, split="training")
    vkitti = datasets.VKITTI2(aug)
    train_set = ConcatDataset([kitti] * 50 + [vkitti])  # 1:1 roughly, KITTI is only 200 pairs
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=local_rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    if local_rank == 0:
        os.makedirs(args.output, exist_ok=True)
        wandb.init(project=args.project, name=args.name, config=vars(args))

    model.train()
    model.module.freeze_bn()
    step, epoch = 0, 0
    meter = torch.zeros(2, device=device)
    tic = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2, flow, valid = (t.to(device, non_blocking=True) for t in (img1, img2, flow, valid))
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(img1, img2, iters=args.iters)
            loss = sequence_loss([p.float() for p in preds], flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])

            if step % 100 == 0:
                dist.all_reduce(meter)
                if local_rank == 0:
                    wandb.log({"loss": (meter[0] / meter[1]).item(), "lr": scheduler.get_last_lr()[0],
                               "sec_per_100": time.time() - tic}, step=step)
                meter.zero_()
                tic = time.time()

            if step % args.val_freq == 0:
                res = validate_kitti(model.module, device, local_rank, world_size)
                if local_rank == 0:
                    wandb.log(res, step=step)
                    torch.save(model.module.state_dict(), os.path.join(args.output, f"{args.name}_{step}.pth"))
                model.module.freeze_bn()
            if step >= args.num_steps:
                break
        epoch += 1

    if local_rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.output, f"{args.name}.pth"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--name", default="raft-kitti-vk2")
    ap.add_argument("--project", default="flow")
    ap.add_argument("--restore_ckpt", default=None)
    ap.add_argument("--output", default="checkpoints")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--alternate_corr", action="store_true")
    ap.add_argument("--mixed_precision", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--num_steps", type=int, default=50000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--image_size", type=int, nargs=2, default=[288, 960])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--val_freq", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    assert args.gpus <= torch.cuda.device_count(), "more processes than visible GPUs"
    port = free_port()
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)
