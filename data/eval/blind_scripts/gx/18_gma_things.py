"""GMA (global motion aggregation) training on FlyingThings3D, DDP, logged to Weights & Biases.

    torchrun --nproc_per_node=4 18_gma_things.py --name gma-things --stage things \
        --restore_ckpt checkpoints/gma-chairs.pth --validation sintel --batch_size 8 --lr 0.000125 \
        --image_size 400 720 --wdecay 0.0001 --num_steps 120000
"""
from __future__ import print_function, division

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import wandb

sys.path.append("core")
from network import RAFTGMA  # noqa: E402
import datasets  # noqa: E402
from utils.utils import InputPadder  # noqa: E402

MAX_FLOW = 400


def sequence_loss(flow_preds, flow_gt, valid, gamma):
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    metrics = torch.stack([epe.mean(), (epe < 1).float().mean(), (epe < 3).float().mean(), (epe < 5).float().mean()])
    return flow_loss, metrics.detach()


@torch.no_grad()
def validate_sintel(model, device, rank, world, iters=32):
    model.eval()
    results = {}
    for dstype in ["clean", "final"]:
        val_dataset = datasets.MpiSintel(split="training", dstype=dstype)
        acc = torch.zeros(5, device=device, dtype=torch.float64)
        for val_id in range(rank, len(val_dataset), world):
            image1, image2, flow_gt, _ = val_dataset[val_id]
            image1, image2 = image1[None].to(device), image2[None].to(device)
            padder = InputPadder(image1.shape)
            image1, image2 = padder.pad(image1, image2)
            _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
            flow = padder.unpad(flow_pr[0]).cpu()
            epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt().view(-1)
            acc += torch.tensor([epe.sum().item(), (epe < 1).sum().item(), (epe < 3).sum().item(),
                                 (epe < 5).sum().item(), epe.numel()], device=device, dtype=torch.float64)
        dist.all_reduce(acc)
        results[f"{dstype}_epe"] = (acc[0] / acc[4]).item()
        results[f"{dstype}_1px"] = (acc[1] / acc[4]).item()
        results[f"{dstype}_3px"] = (acc[2] / acc[4]).item()
        results[f"{dstype}_5px"] = (acc[3] / acc[4]).item()
    model.train()
    model.freeze_bn()
    return results


def fetch_dataset(args):
    if args.stage == "things":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        return (datasets.FlyingThings3D(aug_params, dstype="frames_cleanpass")
                + datasets.FlyingThings3D(aug_params, dstype="frames_finalpass"))
    if args.stage == "chairs":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug_params, split="training")
    raise ValueError(args.stage)


def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="gma-flow", name=args.name, config=vars(args), dir=os.path.join("runs", args.name))

    model = RAFTGMA(args)
    if args.restore_ckpt is not None:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()}, strict=False)
    model.to(device)
    model.train()
    if args.stage != "chairs":
        model.freeze_bn()
    model = DDP(model, device_ids=[local_rank])

    train_dataset = fetch_dataset(args)
    sampler = DistributedSampler(train_dataset, shuffle=True)
    loader = DataLoader(train_dataset, batch_size=args.batch_size // world, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                              cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    total_steps, epoch = 0, 0
    running = torch.zeros(4, device=device)
    t0 = time.time()
    keep = True
    while keep:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            optimizer.zero_grad()
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            running += metrics
            total_steps += 1
            if total_steps % args.print_freq == 0:
                dist.all_reduce(running)
                running /= args.print_freq * world
                if rank == 0:
                    wandb.log({"train/epe": running[0].item(), "train/1px": running[1].item(),
                               "train/3px": running[2].item(), "train/5px": running[3].item(),
                               "lr": scheduler.get_last_lr()[0],
                               "sec_per_iter": (time.time() - t0) / args.print_freq}, step=total_steps)
                running.zero_()
                t0 = time.time()

            if total_steps % args.val_freq == 0:
                results = {}
                if "sintel" in args.validation:
                    results = validate_sintel(model.module, device, rank, world)
                if rank == 0:
                    wandb.log({"val/" + k: v for k, v in results.items()}, step=total_steps)
                    torch.save(model.module.state_dict(), f"checkpoints/{total_steps}_{args.name}.pth")
                dist.barrier()

            if total_steps >= args.num_steps:
                keep = False
                break
        epoch += 1

    if rank == 0:
        path = f"checkpoints/{args.name}.pth"
        torch.save(model.module.state_dict(), path)
        wandb.save(path)
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="gma", help="name your experiment")
    parser.add_argument("--stage", help="determines which dataset to use for training")
    parser.add_argument("--validation", type=str, nargs="+", default=[])
    parser.add_argument("--restore_ckpt", help="restore checkpoint")
    parser.add_argument("--lr", type=float, default=0.00002)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=8, help="global")
    parser.add_argument("--image_size", type=int, nargs="+", default=[384, 512])
    parser.add_argument("--mixed_precision", default=False, action="store_true")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.00005)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    parser.add_argument("--print_freq", type=int, default=100)
    parser.add_argument("--val_freq", type=int, default=10000)
    parser.add_argument("--model_name", default="", help="specify model name")
    parser.add_argument("--position_only", default=False, action="store_true",
                        help="only use position-wise attention")
    parser.add_argument("--position_and_content", default=False, action="store_true",
                        help="use position and content-wise attention")
    parser.add_argument("--num_heads", default=1, type=int, help="number of heads in attention and aggregation")
    args = parser.parse_args()

    torch.manual_seed(1234)
    np.random.seed(1234)
    os.makedirs("checkpoints", exist_ok=True)

    train(args)
