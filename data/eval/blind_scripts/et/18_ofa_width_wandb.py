"""Elastic-width phase of progressive shrinking for a ResNet-50 supernet
(OFA-ResNet style), with Weights & Biases tracking.

Each step trains `--n-subnets` randomly sampled width configurations with
knowledge distillation from the full-width teacher.

    torchrun --nproc_per_node=8 18_ofa_width_wandb.py --data /data/imagenet \
        --init runs/ofa_r50_depth/last.pt --teacher ckpt/resnet50_teacher.pt --run-name ofa-r50-width
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet50

from ofa_resnets import OFAResNet50

WIDTH_MULT = [0.65, 0.8, 1.0]
EXPAND = [0.2, 0.25, 0.35]
DEPTH = [0, 1, 2]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", default="runs/ofa_r50_width")
    p.add_argument("--run-name", default=None)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=7.5e-3, help="per 256 images")
    p.add_argument("--n-subnets", type=int, default=4)
    p.add_argument("--kd-ratio", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def loaders(root, bs, workers, rank, world, seed):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = datasets.ImageFolder(os.path.join(root, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(32. / 255., 0.5), transforms.ToTensor(), norm]))
    val = datasets.ImageFolder(os.path.join(root, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train, shuffle=True, seed=seed)
    train_loader = DataLoader(train, bs, sampler=sampler, num_workers=workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val, range(rank, len(val), world)), 200,
                            num_workers=workers, pin_memory=True)
    return train_loader, sampler, val_loader


@torch.no_grad()
def eval_subnet(net, arch, val_loader, device):
    net.set_active_subnet(**arch)
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in val_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        s[0] += (net(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (100 * s[0] / s[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project="ofa-resnet", name=args.run_name, config=vars(args),
               tags=["progressive-shrinking", "elastic-width"])

    train_loader, sampler, val_loader = loaders(args.data, args.batch_size, args.workers, rank, world, args.seed)

    net = OFAResNet50(depth_list=DEPTH, expand_ratio_list=EXPAND, width_mult_list=WIDTH_MULT)
    net.load_state_dict(torch.load(args.init, map_location="cpu")["model"], strict=False)
    net.re_organize_middle_weights(expand_ratio_stage=len(EXPAND) - 1)
    net.to(device)
    teacher = resnet50()
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device).eval().requires_grad_(False)

    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-5)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * iters,
                                                    pct_start=0.0, anneal_strategy="cos")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            step = epoch * iters + it
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                soft = F.softmax(teacher(x), dim=1)
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for k in range(args.n_subnets):
                random.seed(step * 1000 + k)          # identical sample on all ranks
                net.sample_active_subnet()
                out = model(x)
                loss = F.cross_entropy(out, y, label_smoothing=0.1)
                loss = loss + args.kd_ratio * torch.sum(-soft * F.log_softmax(out, dim=1), dim=1).mean()
                loss.backward()
                losses.append(loss.detach())
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            optimizer.step()
            scheduler.step()

            if it % 50 == 0:
                mean_loss = torch.stack(losses).mean()
                dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": mean_loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "epoch": epoch}, step=step)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{iters} loss {mean_loss.item():.4f} {time.time() - t0:.0f}s",
                          flush=True)

        net.set_max_net()
        results = {
            "val/top1_max": eval_subnet(net, dict(d=max(DEPTH), e=max(EXPAND), w=len(WIDTH_MULT) - 1), val_loader, device),
            "val/top1_min": eval_subnet(net, dict(d=min(DEPTH), e=min(EXPAND), w=0), val_loader, device),
        }
        wandb.log(results, step=(epoch + 1) * iters)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
