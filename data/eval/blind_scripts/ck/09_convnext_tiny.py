"""ConvNeXt-T ImageNet-1k training from scratch, logged to Weights & Biases.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    09_convnext_tiny.py --data_path /mnt/imagenet --output_dir /mnt/exp/convnext_t
"""
import argparse
import datetime
import os
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3


def get_args_parser():
    parser = argparse.ArgumentParser("ConvNeXt training and evaluation script", add_help=False)
    parser.add_argument("--batch_size", default=128, type=int, help="Per GPU batch size")
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--update_freq", default=1, type=int)
    parser.add_argument("--model", default="convnext_tiny", type=str)
    parser.add_argument("--drop_path", type=float, default=0.1)
    parser.add_argument("--input_size", default=224, type=int)
    parser.add_argument("--model_ema_decay", type=float, default=0.9999)
    parser.add_argument("--opt", default="adamw", type=str)
    parser.add_argument("--clip_grad", type=float, default=None)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=4e-3, help="for a total batch of 4096")
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--warmup_epochs", type=int, default=20)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--reprob", type=float, default=0.25)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--data_path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--output_dir", default="", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--wandb_project", default="convnext-in1k", type=str)
    parser.add_argument("--seed", default=0, type=int)
    return parser


def build_dataset(is_train, args):
    t = create_transform(input_size=args.input_size, is_training=is_train,
                         auto_augment="rand-m9-mstd0.5-inc1" if is_train else None,
                         re_prob=args.reprob if is_train else 0.0, interpolation="bicubic",
                         crop_pct=None if is_train else 0.875)
    return datasets.ImageFolder(os.path.join(args.data_path, "train" if is_train else "val"), transform=t)


@torch.no_grad()
def evaluate(data_loader, model, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in data_loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        top5 = output.topk(5, dim=1).indices
        s[0] += (top5[:, 0] == target).sum()
        s[1] += (top5 == target[:, None]).sum()
        s[2] += target.numel()
    dist.all_reduce(s)
    return {"acc1": 100 * (s[0] / s[2]).item(), "acc5": 100 * (s[1] / s[2]).item()}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    cudnn.benchmark = True

    wandb.init(project=args.wandb_project, name=os.path.basename(args.output_dir.rstrip("/")), config=vars(args))

    dataset_train = build_dataset(True, args)
    dataset_val = build_dataset(False, args)
    sampler_train = DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = DataLoader(Subset(dataset_val, range(rank, len(dataset_val), world_size)),
                                 batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers,
                                 pin_memory=True, drop_last=False)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)
    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device, memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV3(model_without_ddp, decay=args.model_ema_decay, use_warmup=True)

    total_batch_size = args.batch_size * args.update_freq * world_size
    lr = args.lr * total_batch_size / 4096
    num_training_steps_per_epoch = len(data_loader_train) // args.update_freq
    optimizer = create_optimizer_v2(model_without_ddp, opt=args.opt, lr=lr, weight_decay=args.weight_decay)
    lr_schedule = CosineLRScheduler(optimizer, t_initial=args.epochs * num_training_steps_per_epoch,
                                    lr_min=args.min_lr, warmup_t=args.warmup_epochs * num_training_steps_per_epoch,
                                    warmup_lr_init=0.0, t_in_epochs=False)
    loss_scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy, max_accuracy_ema = 0, 0.0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        model_ema.module.load_state_dict(checkpoint["model_ema"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
    if rank == 0 and args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        for data_iter_step, (samples, targets) in enumerate(data_loader_train):
            step = data_iter_step // args.update_freq
            it = epoch * num_training_steps_per_epoch + step
            samples = samples.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets) / args.update_freq
            loss_scaler.scale(loss).backward()
            if (data_iter_step + 1) % args.update_freq == 0:
                if args.clip_grad is not None:
                    loss_scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                loss_scaler.step(optimizer)
                loss_scaler.update()
                optimizer.zero_grad()
                model_ema.update(model_without_ddp, step=it)
                lr_schedule.step_update(num_updates=it + 1)
            if data_iter_step % 100 == 0:
                wandb.log({"train/loss": loss.item() * args.update_freq,
                           "train/lr": optimizer.param_groups[0]["lr"],
                           "train/loss_scale": loss_scaler.get_scale()}, step=it)

        test_stats = evaluate(data_loader_val, model_without_ddp, device)
        ema_stats = evaluate(data_loader_val, model_ema.module, device)
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        max_accuracy_ema = max(max_accuracy_ema, ema_stats["acc1"])
        wandb.log({"val/acc1": test_stats["acc1"], "val/acc5": test_stats["acc5"],
                   "val/ema_acc1": ema_stats["acc1"], "epoch": epoch},
                  step=(epoch + 1) * num_training_steps_per_epoch)
        if rank == 0:
            print(f"Epoch {epoch}: acc1 {test_stats['acc1']:.2f} (max {max_accuracy:.2f}) "
                  f"ema acc1 {ema_stats['acc1']:.2f} (max {max_accuracy_ema:.2f})")
            if args.output_dir:
                torch.save({"model": model_without_ddp.state_dict(), "model_ema": model_ema.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": loss_scaler.state_dict(),
                            "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, "checkpoint-last.pth"))

    if rank == 0:
        print("Training time", datetime.timedelta(seconds=int(time.time() - start_time)))
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("ConvNeXt training", parents=[get_args_parser()])
    main(parser.parse_args())
