"""Once-for-All progressive shrinking, elastic-depth phase.

Starts from the elastic-kernel supernet and adds depth choices, distilling
from the full network (teacher). Can be resumed from the last checkpoint of
this phase.

    torchrun --nproc_per_node=8 10_ofa_elastic_depth.py \
        --data /datasets/imagenet --init exp/kernel/checkpoint/model_best.pth.tar \
        --teacher exp/teacher/ofa_mbv3_d4_e6_k7.pth --path exp/kernel2kernel_depth
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ofa_lite.nets import OFAMobileNetV3, MobileNetV3Large
from ofa_lite.data import imagenet_train_set, imagenet_val_set
from ofa_lite.utils import set_running_statistics, cross_entropy_loss_with_soft_target


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--init", default=None, help="weights of the previous phase")
    p.add_argument("--teacher", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--depth-list", default="2,3,4")
    p.add_argument("--n-epochs", type=int, default=125)
    p.add_argument("--warmup-epochs", type=int, default=0)
    p.add_argument("--base-lr", type=float, default=2.5e-3, help="per 256 images")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--kd-ratio", type=float, default=1.0)
    p.add_argument("--dynamic-batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--manual-seed", type=int, default=0)
    return p


def lr_at(args, epoch, it, iters, base):
    t = epoch * iters + it
    T = args.n_epochs * iters
    if epoch < args.warmup_epochs:
        return base * t / (args.warmup_epochs * iters)
    return 0.5 * base * (1 + torch.cos(torch.tensor(t / T * 3.141592653589793)).item())


@torch.no_grad()
def validate_subnets(net, val_loader, calib_loader, device, depth_list):
    results = {}
    for d in (min(depth_list), max(depth_list)):
        net.set_active_subnet(ks=7, e=6, d=d)
        subnet = net.get_active_subnet(preserve_weight=True).to(device)
        set_running_statistics(subnet, calib_loader)
        subnet.eval()
        stats = torch.zeros(2, device=device)
        for images, labels in val_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            stats[0] += (subnet(images).argmax(1) == labels).sum()
            stats[1] += labels.numel()
        dist.all_reduce(stats)
        results[f"d{d}"] = (100.0 * stats[0] / stats[1]).item()
    net.set_max_net()
    return results


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.manual_seed)
    random.seed(args.manual_seed)
    depth_list = [int(d) for d in args.depth_list.split(",")]

    train_set = imagenet_train_set(args.data)
    val_set = imagenet_val_set(args.data)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.manual_seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=200, num_workers=args.workers, pin_memory=True)
    # BN calibration: 2000 fixed training images, the same on every rank
    g = torch.Generator().manual_seed(937162211)
    calib_idx = torch.randperm(len(train_set), generator=g)[:2000].tolist()
    calib_loader = DataLoader(torch.utils.data.Subset(train_set, calib_idx), batch_size=100,
                              num_workers=args.workers, pin_memory=True)

    net = OFAMobileNetV3(n_classes=1000, dropout_rate=0.1, width_mult=1.2,
                         ks_list=[3, 5, 7], expand_ratio_list=[6], depth_list=depth_list).to(device)
    teacher = MobileNetV3Large(n_classes=1000, dropout_rate=0, width_mult=1.2, ks=7, expand_ratio=6, depth_param=4)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu")["state_dict"])
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    no_wd_keys = ("bn", "bias")
    params = [{"params": [p for n, p in net.named_parameters() if not any(k in n for k in no_wd_keys)],
               "weight_decay": 3e-5},
              {"params": [p for n, p in net.named_parameters() if any(k in n for k in no_wd_keys)],
               "weight_decay": 0.0}]
    base_lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(params, lr=base_lr, momentum=0.9, nesterov=True)

    start_epoch, best_acc = 0, 0.0
    ckpt_dir = os.path.join(args.path, "checkpoint")
    latest = os.path.join(ckpt_dir, "checkpoint.pth.tar")
    if args.resume and os.path.isfile(latest):
        checkpoint = torch.load(latest)
        net.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
        best_acc = checkpoint["best_acc"]
        if rank == 0:
            print(f"=> resumed from epoch {checkpoint['epoch']}", flush=True)
    elif args.init:
        init = torch.load(args.init, map_location="cpu")["state_dict"]
        net.load_state_dict(init, strict=False)

    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    iters = len(train_loader)

    for epoch in range(start_epoch, args.n_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, labels) in enumerate(train_loader):
            lr = lr_at(args, epoch, it, iters, base_lr)
            for gp in optimizer.param_groups:
                gp["lr"] = lr
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.no_grad():
                soft = F.softmax(teacher(images), dim=1)

            optimizer.zero_grad()
            for k in range(args.dynamic_batch_size):
                # seed so that all ranks pick the same subnet
                subnet_seed = int("%d%.3d%.3d" % (epoch * iters + it, k, 0))
                random.seed(subnet_seed)
                net.sample_active_subnet()
                logits = model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
                if args.kd_ratio > 0:
                    loss = loss + args.kd_ratio * cross_entropy_loss_with_soft_target(logits, soft)
                loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            optimizer.step()

            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} [{it}/{iters}] loss {loss.item():.4f} lr {lr:.5f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        net.set_max_net()
        accs = validate_subnets(net, val_loader, calib_loader, device, depth_list)
        mean_acc = sum(accs.values()) / len(accs)
        is_best = mean_acc > best_acc
        best_acc = max(best_acc, mean_acc)
        if rank == 0:
            print(f"epoch {epoch} val {json.dumps(accs)} best {best_acc:.2f}", flush=True)
            os.makedirs(ckpt_dir, exist_ok=True)
            state = {"epoch": epoch, "state_dict": net.state_dict(),
                     "optimizer": optimizer.state_dict(), "best_acc": best_acc}
            torch.save(state, latest)
            if is_best:
                torch.save({"state_dict": net.state_dict()}, os.path.join(ckpt_dir, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
