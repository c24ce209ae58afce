"""RAFT fine-tuning on KITTI-2015 flow (sparse ground truth), DDP + gradient accumulation.

We keep 20 of the 200 training images for validation (fixed split, see VAL_IDS).

    torchrun --nproc_per_node=4 16_raft_kitti_sparse.py --restore_ckpt checkpoints/raft-sintel.pth \
        --name raft-kitti-ft --batch_size 8 --per_gpu_batch 1
"""
import argparse
import contextlib
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.append("core")
from raft import RAFT  # noqa: E402
import datasets  # noqa: E402
from utils.utils import InputPadder  # noqa: E402

MAX_FLOW = 400
# fixed validation frames, chosen once with random.Random(2015).sample(range(200), 20)
VAL_IDS = sorted(random.Random(2015).sample(range(200), 20))


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.85, max_flow=MAX_FLOW):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i in range(n):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (flow_preds[i] - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return loss, epe.mean().detach()


@torch.no_grad()
def validate_kitti(model, val_set, device, rank, world, iters=24):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)   # epe, outliers, images
    for i in range(rank, len(val_set), world):
        image1, image2, flow_gt, valid_gt = val_set[i]
        image1, image2 = image1[None].to(device), image2[None].to(device)
        padder = InputPadder(image1.shape, mode="kitti")
        image1, image2 = padder.pad(image1, image2)
        _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        flow = padder.unpad(flow_pr[0]).cpu()
        epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
        mag = torch.sum(flow_gt ** 2, dim=0).sqrt()
        val = valid_gt >= 0.5
        out = ((epe > 3.0) & ((epe / mag) > 0.05)).float()
        acc[0] += epe[val].mean().item()
        acc[1] += out[val].mean().item()
        acc[2] += 1
    dist.all_reduce(acc)
    model.train()
    model.freeze_bn()
    return {"kitti-epe": (acc[0] / acc[2]).item(), "kitti-f1": 100 * (acc[1] / acc[2]).item()}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # augmentation randomness differs per rank on purpose; the data split does not depend on it
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = RAFT(args)
    state = torch.load(args.restore_ckpt, map_location="cpu")
    model.load_state_dict({k.replace("module.", "", 1): v for k, v in state.items()}, strict=False)
    model.to(device)
    model.train()
    model.freeze_bn()
    model = DDP(model, device_ids=[local_rank])

    aug_params = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
    full_train = datasets.KITTI(aug_params, split="training")
    train_ids = [i for i in range(len(full_train)) if i not in VAL_IDS]
    train_set = Subset(full_train, train_ids)
    val_set = Subset(datasets.KITTI(split="training"), VAL_IDS)

    # the global batch stays args.batch_size whatever the number of GPUs: the rest is accumulated
    assert args.batch_size % (args.per_gpu_batch * world) == 0
    accum = args.batch_size // (args.per_gpu_batch * world)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.per_gpu_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                              cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    writer = SummaryWriter(os.path.join("runs", args.name)) if rank == 0 else None

    opt_steps, micro, epoch, skipped = 0, 0, 0, 0
    done = False
    while not done:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            # a crop of the sky has (almost) no LiDAR points; every rank must skip the same batch,
            # otherwise the gradient all-reduce would be out of step
            too_sparse = torch.tensor([float(valid.sum() < args.min_valid_px)], device=device)
            dist.all_reduce(too_sparse, op=dist.ReduceOp.MAX)
            if too_sparse.item() > 0:
                skipped += 1
                continue

            micro += 1
            sync_now = micro % accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                    preds = model(image1, image2, iters=args.iters)
                loss, epe = sequence_loss([p.float() for p in preds], flow, valid, args.gamma)
                scaler.scale(loss / accum).backward()
            if not sync_now:
                continue

            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            opt_steps += 1

            if opt_steps % 50 == 0:
                stats = torch.stack([loss.detach(), epe])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), opt_steps)
                    writer.add_scalar("train/epe", stats[1].item(), opt_steps)
                    writer.add_scalar("train/skipped_batches", skipped, opt_steps)

            if opt_steps % args.val_freq == 0 or opt_steps == args.num_steps:
                res = validate_kitti(model.module, val_set, device, rank, world)
                if rank == 0:
                    print(f"step {opt_steps}: {res}", flush=True)
                    for k, v in res.items():
                        writer.add_scalar("val/" + k, v, opt_steps)
                    torch.save(model.module.state_dict(), f"checkpoints/{opt_steps}_{args.name}.pth")
                dist.barrier()

            if opt_steps >= args.num_steps:
                done = True
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), f"checkpoints/{args.name}.pth")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-kitti")
    parser.add_argument("--restore_ckpt", required=True)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--wdecay", type=float, default=1e-5)
    parser.add_argument("--num_steps", type=int, default=50000, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="global batch per optimizer step")
    parser.add_argument("--per_gpu_batch", type=int, default=1)
    parser.add_argument("--image_size", type=int, nargs=2, default=[288, 960])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--gamma", type=float, default=0.85)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--min_valid_px", type=int, default=500)
    parser.add_argument("--val_freq", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    os.makedirs("checkpoints", exist_ok=True)
    main(args)
