"""Sandwich-rule supernet training with in-place distillation (BigNAS recipe),
elastic depth / width / kernel / resolution.

One step = max child (hard labels) + min child + N random children (soft
labels from the max child). Each child does its own forward/backward, so
gradients accumulate in .grad and one optimizer step follows.

    torchrun --nproc_per_node=8 17_bignas_sandwich_kd.py --data /datasets/imagenet \
        --work-dir work/bignas --epochs 360 --amp
"""
import argparse
import logging
import math
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

from elastic.supernet import ElasticMobileNet
from elastic.data import imagenet_train, imagenet_val

RESOLUTIONS = [192, 224, 256, 288]

log = logging.getLogger("bignas")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", default="work/bignas")
    p.add_argument("--epochs", type=int, default=360)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--num-random", type=int, default=2)
    p.add_argument("--calib-batches", type=int, default=32)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def resize(x, r):
    return x if x.shape[-1] == r else F.interpolate(x, size=(r, r), mode="bilinear", align_corners=False)


@torch.no_grad()
def calibrate_and_eval(supernet, cfg, train_loader, val_loader, n_calib, device):
    """BN statistics of the chosen child, averaged over ranks, then top-1 on the val shard."""
    supernet.set_active_subnet(cfg)
    bns = [m for m in supernet.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    supernet.train()
    for i, (x, _) in enumerate(train_loader):
        if i == n_calib:
            break
        supernet(resize(x.to(device, non_blocking=True), cfg["resolution"]))
    for m in bns:
        # each rank saw the same number of calibration batches, so a plain mean is right
        dist.all_reduce(m.running_mean, op=dist.ReduceOp.AVG)
        dist.all_reduce(m.running_var, op=dist.ReduceOp.AVG)
    supernet.eval()
    acc = torch.zeros(2, device=device)
    for x, y in val_loader:
        x, y = resize(x.to(device, non_blocking=True), cfg["resolution"]), y.to(device, non_blocking=True)
        acc[0] += (supernet(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (100.0 * acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    train_set, val_set = imagenet_train(args.data, max(RESOLUTIONS)), imagenet_val(args.data, max(RESOLUTIONS))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=200, num_workers=10, pin_memory=True)

    supernet = ElasticMobileNet().to(device)
    # Children skip blocks (elastic depth) -> unused parameters. Buffers are not
    # broadcast: each child's forward would otherwise overwrite BN stats in place.
    model = DDP(supernet, device_ids=[local_rank], find_unused_parameters=True, broadcast_buffers=False)

    decay = [p for n, p in supernet.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in supernet.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr * args.batch_size * world / 256, momentum=0.9, nesterov=True)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_epochs * iters, args.epochs * iters))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch = 0
    last_ckpt = os.path.join(args.work_dir, "last.pth")
    if os.path.exists(last_ckpt):
        ckpt = torch.load(last_ckpt, map_location="cpu")
        supernet.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        log.info("resumed from epoch %d", ckpt["epoch"])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            # same children on every rank
            rng = random.Random(args.seed * 1_000_003 + epoch * iters + it)
            optimizer.zero_grad(set_to_none=True)

            max_cfg = supernet.max_config()
            supernet.set_active_subnet(max_cfg)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                t_logits = model(resize(images, max_cfg["resolution"]))
                loss = F.cross_entropy(t_logits, target, label_smoothing=0.1)
            scaler.scale(loss).backward()
            soft = F.softmax(t_logits.detach().float(), dim=1)

            children = [supernet.min_config()] + [supernet.random_config(rng, RESOLUTIONS)
                                                  for _ in range(args.num_random)]
            for cfg in children:
                supernet.set_active_subnet(cfg)
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    s_logits = model(resize(images, cfg["resolution"]))
                kd = F.kl_div(F.log_softmax(s_logits.float(), dim=1), soft, reduction="batchmean")
                scaler.scale(kd).backward()

            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(supernet.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.3f kd %.3f lr %.4f %.0fs", epoch, it, iters, loss.item(),
                         kd.item(), scheduler.get_last_lr()[0], time.time() - tic)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            for name, cfg in (("min", supernet.min_config()), ("max", supernet.max_config())):
                top1 = calibrate_and_eval(supernet, cfg, train_loader, val_loader, args.calib_batches, device)
                log.info("epoch %d %s child top1 %.2f", epoch, name, top1)

        if rank == 0:
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": supernet.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       last_ckpt + ".tmp")
            os.replace(last_ckpt + ".tmp", last_ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
