"""ConvNeXt-B fine-tuning (IN-22k -> IN-1k @ 384) with timm: Mixup/CutMix, EMA, layer decay, bf16, compile.

    torchrun --nproc_per_node=8 15_convnext_finetune.py --data /datasets/imagenet --out /shared/ft/cnx_b_384
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import wandb
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="convnext_base.fb_in22k")
    p.add_argument("--img-size", type=int, default=384)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-5, help="for global batch 512")
    p.add_argument("--layer-decay", type=float, default=0.8)
    p.add_argument("--wd", type=float, default=1e-8)
    p.add_argument("--drop-path", type=float, default=0.2)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--warmup-epochs", type=int, default=0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--wandb-project", default="convnext-ft")
    return p.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(-1)
        c[0] += (pred == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item() * 100


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)
    torch.backends.cudnn.benchmark = True

    run = wandb.init(project=args.wandb_project, name=os.path.basename(args.out), config=vars(args))

    model = timm.create_model(args.model, pretrained=True, num_classes=1000, drop_path_rate=args.drop_path)
    data_cfg = resolve_data_config({"input_size": (3, args.img_size, args.img_size)}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, re_mode="pixel")
    eval_tf = create_transform(**data_cfg, is_training=False, crop_pct=1.0)
    train_ds = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), eval_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                        num_workers=args.workers, pin_memory=True)

    model = model.to(device, memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    ema = ModelEmaV3(model, decay=args.ema_decay)  # after DDP so it copies rank 0's head init
    fwd = torch.compile(ddp)

    lr = args.lr * args.bs * world / 512
    opt = create_optimizer_v2(model, opt="adamw", lr=lr, weight_decay=args.wd, layer_decay=args.layer_decay,
                              foreach=True)
    steps_per_epoch = len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups],
                                                total_steps=args.epochs * steps_per_epoch,
                                                pct_start=max(args.warmup_epochs / args.epochs, 0.02),
                                                anneal_strategy="cos")
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(fwd(x), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            ema.update(model, step=step)
            loss_sum += loss.detach()
            step += 1

            if (i + 1) % 50 == 0:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / 50
                metrics = {"train/loss": loss_sum.item() / 50, "train/lr": opt.param_groups[-1]["lr"],
                           "perf/img_per_s": args.bs * world / dt, "epoch": epoch}
                wandb.log(metrics, step=step)
                if rank == 0:
                    print(f"ep {epoch} {i + 1}/{steps_per_epoch} loss {metrics['train/loss']:.4f} "
                          f"{metrics['perf/img_per_s']:.0f} img/s", flush=True)
                loss_sum.zero_()
                t0 = time.perf_counter()

        acc = evaluate(model, val_dl, device)
        acc_ema = evaluate(ema.module, val_dl, device)
        wandb.log({"val/top1": acc, "val/top1_ema": acc_ema}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.2f} ema {acc_ema:.2f}", flush=True)
            ck = {"model": model.state_dict(), "ema": ema.module.state_dict(), "opt": opt.state_dict(),
                  "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pth"))
            if max(acc, acc_ema) > best:
                best = max(acc, acc_ema)
                torch.save(ck, os.path.join(args.out, "best.pth"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
