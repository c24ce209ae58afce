"""ImageNet classification recipe (ResNet / RegNet) with repeated augmentation,
MixUp / CutMix and weight EMA. Follows torchvision/references/classification.

    torchrun --nproc_per_node=8 train_cls.py --model resnet50 --batch-size 128 --lr 0.5 \
        --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --label-smoothing 0.1 \
        --mixup-alpha 0.2 --cutmix-alpha 1.0 --ra-sampler --ra-reps 4 --model-ema --amp
"""
import argparse
import datetime
import os
import random
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data.dataloader import default_collate
from torchvision.transforms import v2

import presets
import utils
from sampler import RASampler


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    elif "SLURM_PROCID" in os.environ:
        args.rank = int(os.environ["SLURM_PROCID"])
        args.world_size = int(os.environ["SLURM_NTASKS"])
        args.gpu = int(os.environ["SLURM_LOCALID"])
    else:
        print("Not using distributed mode")
        args.distributed = False
        args.rank, args.world_size, args.gpu = 0, 1, 0
        return

    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()
    utils.setup_for_distributed(args.rank == 0)


def train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema=None, scaler=None):
    model.train()
    metric_logger = utils.MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", utils.SmoothedValue(window_size=1, fmt="{value}"))
    metric_logger.add_meter("img/s", utils.SmoothedValue(window_size=10, fmt="{value}"))

    header = f"Epoch: [{epoch}]"
    for i, (image, target) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        start_time = time.time()
        image, target = image.cuda(non_blocking=True), target.cuda(non_blocking=True)
        with torch.autocast("cuda", enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad_norm is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()

        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                # keep copying the weights during warmup
                model_ema.n_averaged.fill_(0)

        acc1, acc5 = utils.accuracy(output, target, topk=(1, 5))
        batch_size = image.shape[0]
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
        metric_logger.meters["img/s"].update(batch_size / (time.time() - start_time))


def evaluate(model, criterion, data_loader, print_freq=100, log_suffix=""):
    model.eval()
    metric_logger = utils.MetricLogger(delimiter="  ")
    header = f"Test: {log_suffix}"

    num_processed_samples = 0
    with torch.inference_mode():
        for image, target in metric_logger.log_every(data_loader, print_freq, header):
            image = image.cuda(non_blocking=True)
            target = target.cuda(non_blocking=True)
            output = model(image)
            loss = criterion(output, target)

            acc1, acc5 = utils.accuracy(output, target, topk=(1, 5))
            batch_size = image.shape[0]
            metric_logger.update(loss=loss.item())
            metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
            metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
            num_processed_samples += batch_size

    num_processed_samples = utils.reduce_across_processes(num_processed_samples)
    if len(data_loader.dataset) != num_processed_samples and utils.is_main_process():
        warnings.warn(
            f"It looks like the dataset has {len(data_loader.dataset)} samples, but {num_processed_samples} "
            "samples were used for the validation, which might bias the results."
        )

    metric_logger.synchronize_between_processes()
    print(f"{header} Acc@1 {metric_logger.acc1.global_avg:.3f} Acc@5 {metric_logger.acc5.global_avg:.3f}")
    return metric_logger.acc1.global_avg


def build_loaders(args):
    traindir = os.path.join(args.data_path, "train")
    valdir = os.path.join(args.data_path, "val")
    dataset = torchvision.datasets.ImageFolder(
        traindir,
        presets.ClassificationPresetTrain(
            crop_size=args.train_crop_size, auto_augment_policy=args.auto_augment, random_erase_prob=args.random_erase
        ),
    )
    dataset_test = torchvision.datasets.ImageFolder(
        valdir, presets.ClassificationPresetEval(crop_size=args.val_crop_size, resize_size=args.val_resize_size)
    )
    num_classes = len(dataset.classes)

    if args.distributed:
        if args.ra_sampler:
            train_sampler = RASampler(dataset, shuffle=True, repetitions=args.ra_reps)
        else:
            train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)
    else:
        train_sampler = torch.utils.data.RandomSampler(dataset)
        test_sampler = torch.utils.data.SequentialSampler(dataset_test)

    mixup_cutmix = []
    if args.mixup_alpha > 0:
        mixup_cutmix.append(v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes))
    if args.cutmix_alpha > 0:
        mixup_cutmix.append(v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes))
    collate_fn = default_collate
    if mixup_cutmix:
        mixup_or_cutmix = v2.RandomChoice(mixup_cutmix)

        def collate_fn(batch):
            return mixup_or_cutmix(*default_collate(batch))

    data_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
        pin_memory=True, collate_fn=collate_fn, drop_last=True,
    )
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=args.batch_size, sampler=test_sampler, num_workers=args.workers, pin_memory=True
    )
    return data_loader, data_loader_test, train_sampler, num_classes


def main(args):
    init_distributed_mode(args)
    if args.output_dir and utils.is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
    print(args)

    # different augmentation streams per process; DDP broadcasts rank 0's weights anyway
    seed = args.seed + args.rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    torch.backends.cudnn.benchmark = True

    data_loader, data_loader_test, train_sampler, num_classes = build_loaders(args)

    model = torchvision.models.get_model(args.model, weights=args.weights, num_classes=num_classes)
    if args.distributed and args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda()

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # --lr is given for a total batch of 1024 images
    total_batch = args.batch_size * args.world_size
    lr = args.lr * total_batch / 1024
    parameters = utils.set_weight_decay(model, args.weight_decay, norm_weight_decay=args.norm_weight_decay)
    optimizer = torch.optim.SGD(parameters, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay, nesterov=True)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None

    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs - args.lr_warmup_epochs, eta_min=args.lr_min
    )
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs
    )
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[args.lr_warmup_epochs]
    )

    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    model_ema = None
    if args.model_ema:
        # decay is defined per image seen; EMA is updated every model_ema_steps iterations on the global batch
        adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
        alpha = 1.0 - args.model_ema_decay
        alpha = min(1.0, alpha * adjust)
        model_ema = utils.ExponentialMovingAverage(model_without_ddp, device=torch.device("cuda"), decay=1.0 - alpha)

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(checkpoint["model"])
        if not args.test_only:
            optimizer.load_state_dict(checkpoint["optimizer"])
            lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema:
            model_ema.load_state_dict(checkpoint["model_ema"])
        if scaler:
            scaler.load_state_dict(checkpoint["scaler"])

    if args.test_only:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        if model_ema:
            evaluate(model_ema, criterion, data_loader_test, log_suffix="EMA")
        else:
            evaluate(model, criterion, data_loader_test)
        return

    print("Start training")
    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema, scaler)
        lr_scheduler.step()
        evaluate(model, criterion, data_loader_test)
        if model_ema:
            evaluate(model_ema, criterion, data_loader_test, log_suffix="EMA")
        if args.output_dir:
            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": args,
            }
            if model_ema:
                checkpoint["model_ema"] = model_ema.state_dict()
            if scaler:
                checkpoint["scaler"] = scaler.state_dict()
            utils.save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            utils.save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))

    total_time = time.time() - start_time
    print(f"Training time {datetime.timedelta(seconds=int(total_time))}")


def get_args_parser():
    parser = argparse.ArgumentParser(description="PyTorch Classification Training")
    parser.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--model", default="resnet50", type=str)
    parser.add_argument("-b", "--batch-size", default=128, type=int, help="images per gpu")
    parser.add_argument("--epochs", default=600, type=int)
    parser.add_argument("-j", "--workers", default=10, type=int)
    parser.add_argument("--lr", default=0.5, type=float, help="learning rate for a total batch of 1024")
    parser.add_argument("--lr-min", default=0.0, type=float)
    parser.add_argument("--lr-warmup-epochs", default=5, type=int)
    parser.add_argument("--lr-warmup-decay", default=0.01, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=2e-5, type=float, dest="weight_decay")
    parser.add_argument("--norm-weight-decay", default=0.0, type=float)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--mixup-alpha", default=0.2, type=float)
    parser.add_argument("--cutmix-alpha", default=1.0, type=float)
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    parser.add_argument("--auto-augment", default="ta_wide", type=str)
    parser.add_argument("--random-erase", default=0.1, type=float)
    parser.add_argument("--train-crop-size", default=176, type=int)
    parser.add_argument("--val-crop-size", default=224, type=int)
    parser.add_argument("--val-resize-size", default=232, type=int)
    parser.add_argument("--ra-sampler", action="store_true")
    parser.add_argument("--ra-reps", default=4, type=int)
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--model-ema-steps", default=32, type=int)
    parser.add_argument("--model-ema-decay", default=0.99998, type=float)
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--weights", default=None, type=str)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--print-freq", default=50, type=int)
    parser.add_argument("--output-dir", default="./runs/cls", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--test-only", action="store_true")
    parser.add_argument("--dist-url", default="env://", type=str)
    return parser


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
    if args.distributed:
        dist.destroy_process_group()
