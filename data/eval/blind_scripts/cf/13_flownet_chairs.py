"""FlowNetS / FlowNetC training on FlyingChairs with multi-scale EPE, distributed, tracked with W&B.

    torchrun --nproc_per_node=4 train_flownet.py --arch flownetc --data /data/FlyingChairs_release/data \
        --epochs 300 --batch-size 8 --wandb-project flownet
"""
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import flow_transforms
import models
from datasets import flying_chairs

model_names = sorted(n for n in models.__dict__ if n.islower() and not n.startswith("__"))

parser = argparse.ArgumentParser(description="FlowNet training on FlyingChairs",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--data", metavar="DIR", required=True)
parser.add_argument("--split-file", default="FlyingChairs_train_val.txt")
parser.add_argument("--arch", "-a", default="flownets", choices=model_names)
parser.add_argument("--solver", default="adam", choices=["adam", "sgd"])
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("--epochs", default=300, type=int)
parser.add_argument("-b", "--batch-size", default=8, type=int, help="per GPU")
parser.add_argument("--lr", default=1e-4, type=float)
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--beta", default=0.999, type=float)
parser.add_argument("--weight-decay", default=4e-4, type=float)
parser.add_argument("--bias-decay", default=0, type=float)
parser.add_argument("--multiscale-weights", "-w", default=[0.005, 0.01, 0.02, 0.08, 0.32], type=float, nargs=5)
parser.add_argument("--sparse", action="store_true")
parser.add_argument("--div-flow", default=20, type=float)
parser.add_argument("--milestones", default=[100, 150, 200], type=int, nargs="*")
parser.add_argument("--pretrained", default=None)
parser.add_argument("--save-dir", default="checkpoints")
parser.add_argument("--wandb-project", default="flownet")
parser.add_argument("--print-freq", default=100, type=int)


def EPE(output, target, sparse=False, mean=True):
    epe_map = torch.norm(target - output, 2, 1)
    if sparse:
        mask = (target[:, 0] == 0) & (target[:, 1] == 0)
        epe_map = epe_map[~mask]
    return epe_map.mean() if mean else epe_map.sum()


def multiscale_epe(network_output, target_flow, weights, sparse=False):
    def one_scale(output, target):
        b, _, h, w = output.size()
        if sparse:
            target_scaled = F.adaptive_max_pool2d(target, (h, w))
        else:
            target_scaled = F.interpolate(target, (h, w), mode="area")
        return EPE(output, target_scaled, sparse, mean=False)

    if type(network_output) not in [tuple, list]:
        network_output = [network_output]
    loss = 0
    for output, weight in zip(network_output, weights):
        loss += weight * one_scale(output, target_flow)
    return loss


def real_epe(output, target, sparse=False):
    b, _, h, w = target.size()
    upsampled = F.interpolate(output, (h, w), mode="bilinear", align_corners=False)
    return EPE(upsampled, target, sparse, mean=True)


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run_name = "{}_{}_b{}x{}_lr{}".format(args.arch, args.solver, args.batch_size, world, args.lr)
    wandb.init(project=args.wandb_project, name=run_name, config=vars(args))
    save_path = os.path.join(args.save_dir, run_name)
    if rank == 0:
        os.makedirs(save_path, exist_ok=True)

    input_transform = flow_transforms.Compose([
        flow_transforms.ArrayToTensor(),
        flow_transforms.Normalize(mean=[0, 0, 0], std=[255, 255, 255]),
        flow_transforms.Normalize(mean=[0.45, 0.432, 0.411], std=[1, 1, 1]),
    ])
    target_transform = flow_transforms.Compose([
        flow_transforms.ArrayToTensor(),
        flow_transforms.Normalize(mean=[0, 0], std=[args.div_flow, args.div_flow]),
    ])
    co_transform = flow_transforms.Compose([
        flow_transforms.RandomTranslate(10),
        flow_transforms.RandomRotate(10, 5),
        flow_transforms.RandomCrop((320, 448)),
        flow_transforms.RandomVerticalFlip(),
        flow_transforms.RandomHorizontalFlip(),
    ])
    train_set, test_set = flying_chairs(args.data, transform=input_transform, target_transform=target_transform,
                                        co_transform=co_transform, split=args.split_file)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_shard = torch.utils.data.Subset(test_set, list(range(rank, len(test_set), world)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    network_data = torch.load(args.pretrained, map_location="cpu") if args.pretrained else None
    model = models.__dict__[args.arch](network_data).to(device)
    model = DDP(model, device_ids=[local_rank])

    param_groups = [{"params": model.module.bias_parameters(), "weight_decay": args.bias_decay},
                    {"params": model.module.weight_parameters(), "weight_decay": args.weight_decay}]
    if args.solver == "adam":
        optimizer = torch.optim.Adam(param_groups, args.lr, betas=(args.momentum, args.beta))
    else:
        optimizer = torch.optim.SGD(param_groups, args.lr, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.5)

    best_epe = -1
    n_iter = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (inputs, target) in enumerate(train_loader):
            target = target.to(device, non_blocking=True)
            inp = torch.cat(inputs, 1).to(device, non_blocking=True)
            output = model(inp)
            if args.sparse:
                output = [F.interpolate(o, target.shape[-2:], mode="bilinear", align_corners=False)
                          for o in output]
            loss = multiscale_epe(output, target, weights=args.multiscale_weights, sparse=args.sparse)
            flow2_epe = args.div_flow * real_epe(output[0].detach(), target, sparse=args.sparse)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            stats = torch.stack([loss.detach(), flow2_epe])
            dist.all_reduce(stats)
            stats /= world
            wandb.log({"train/loss": stats[0].item(), "train/epe": stats[1].item(),
                       "lr": scheduler.get_last_lr()[0]}, step=n_iter)
            if rank == 0 and i % args.print_freq == 0:
                print("Epoch: [{}][{}/{}]\t Time {:.3f}\t Loss {:.4f}\t EPE {:.3f}".format(
                    epoch, i, len(train_loader), time.time() - end, stats[0].item(), stats[1].item()))
            end = time.time()
            n_iter += 1
        scheduler.step()

        model.eval()
        sums = torch.zeros(2, device=device)
        with torch.no_grad():
            for inputs, target in val_loader:
                target = target.to(device)
                inp = torch.cat(inputs, 1).to(device)
                output = model.module(inp)
                sums[0] += args.div_flow * real_epe(output, target, sparse=args.sparse) * target.size(0)
                sums[1] += target.size(0)
        dist.all_reduce(sums)
        epe = (sums[0] / sums[1]).item()
        wandb.log({"val/epe": epe, "epoch": epoch}, step=n_iter)

        if rank == 0:
            print(" * EPE {:.3f}".format(epe))
            is_best = best_epe < 0 or epe < best_epe
            best_epe = epe if is_best else best_epe
            state = {"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                     "best_EPE": best_epe, "div_flow": args.div_flow}
            torch.save(state, os.path.join(save_path, "checkpoint.pth.tar"))
            if is_best:
                torch.save(state, os.path.join(save_path, "model_best.pth.tar"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
