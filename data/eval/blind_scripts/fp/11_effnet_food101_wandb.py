"""EfficientNetV2-S on Food-101 with timm, DDP, W&B tracking.

The W&B run id is the experiment name, so a job restarted by torchrun
(--max-restarts) keeps appending to the same run instead of opening a new one.

    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 \
        11_effnet_food101_wandb.py --exp effv2s-food101-bs512
"""
import argparse
import os
import signal
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from timm.data import create_transform, resolve_data_config
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Food101

STOP = [False]
signal.signal(signal.SIGTERM, lambda *_: STOP.__setitem__(0, True))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--exp", required=True)
    p.add_argument("--data", default="/datasets")
    p.add_argument("--ckpt-root", default="/shared/checkpoints")
    p.add_argument("--model", default="tf_efficientnetv2_s.in21k")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="for global batch 512")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--project", default="food101")
    return p.parse_args()


def run_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            stats += torch.stack([crit(logits.float(), y), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(stats)
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    ckpt_dir = os.path.join(args.ckpt_root, args.exp)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    wandb.init(project=args.project, id=args.exp, name=args.exp, resume="allow", config=vars(args))

    model = timm.create_model(args.model, pretrained=True, num_classes=101, drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ema = ModelEmaV2(model, decay=args.ema_decay)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    val_tf = create_transform(**data_cfg, is_training=False)
    train_ds = Food101(args.data, split="train", transform=train_tf, download=False)
    val_ds = Food101(args.data, split="test", transform=val_tf, download=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=8, pin_memory=True)

    lr = args.lr * args.bs * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch, best_top1 = 0, 0.0
    last = os.path.join(ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best_top1 = ck["epoch"], ck["best_top1"]

    ddp_model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t_epoch = time.time()
        interrupted = False
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(ddp_model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.update(model)

            if rank == 0 and i % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "epoch": epoch + i / len(train_loader)})
            flag = torch.tensor(float(STOP[0]), device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                interrupted = True
                break
        if interrupted:
            # mid-epoch preemption: the partial epoch is simply redone after the restart
            if rank == 0:
                print("SIGTERM received, exiting; resuming from the last epoch checkpoint")
            break

        val_loss, top1 = run_eval(ddp_model, val_loader, device)
        ema_loss, ema_top1 = run_eval(ema.module, val_loader, device)
        best_top1 = max(best_top1, top1, ema_top1)
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/top1": top1, "val/ema_top1": ema_top1,
                       "val/best_top1": best_top1, "epoch_time": time.time() - t_epoch, "epoch": epoch + 1})
            tmp = last + ".tmp"
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1, "best_top1": best_top1}, tmp)
            os.replace(tmp, last)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
