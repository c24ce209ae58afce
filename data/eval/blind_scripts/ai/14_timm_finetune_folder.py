"""
Fine-tune an ImageNet-pretrained timm backbone on a single image folder (one sub-folder per class),
holding out a fraction of the images for validation.

torchrun --nproc_per_node=4 14_timm_finetune_folder.py --data-path /data/stanford_dogs/Images --model resnet50.a1_in1k
"""
import argparse
import datetime
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def setup_for_distributed(is_master):
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop('force', False)
        if is_master or force:
            builtin_print(*args, **kwargs)
    __builtin__.print = print


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank = int(os.environ['RANK'])
        args.world_size = int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
        args.distributed = True
    else:
        args.rank, args.world_size, args.gpu, args.distributed = 0, 1, 0, False
        return
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method='env://', world_size=args.world_size, rank=args.rank)
    dist.barrier()
    setup_for_distributed(args.rank == 0)


def build_datasets(args):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.input_size, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.1)])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.input_size / 0.875)),
        transforms.CenterCrop(args.input_size),
        transforms.ToTensor(),
        transforms.Normalize(mean, std)])
    train_full = datasets.ImageFolder(args.data_path, transform=train_tf)
    val_full = datasets.ImageFolder(args.data_path, transform=val_tf)
    n_val = int(len(train_full) * args.val_ratio)
    perm = torch.randperm(len(train_full)).tolist()
    dataset_train = Subset(train_full, perm[n_val:])
    dataset_val = Subset(val_full, perm[:n_val])
    return dataset_train, dataset_val, len(train_full.classes)


def train_one_epoch(model, criterion, loader, optimizer, scaler, lr_scheduler, epoch, args):
    model.train()
    num_updates = epoch * len(loader)
    stats = torch.zeros(3, device='cuda', dtype=torch.float64)
    t0 = time.time()
    for i, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        with torch.autocast(device_type='cuda', dtype=torch.float16, enabled=args.amp):
            outputs = model(images)
            loss = criterion(outputs, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        num_updates += 1
        lr_scheduler.step_update(num_updates=num_updates)
        stats += torch.tensor([loss.item() * images.size(0), (outputs.argmax(1) == targets).sum().item(), images.size(0)],
                              device='cuda', dtype=torch.float64)
        if i % args.log_interval == 0:
            print(f'Epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} '
                  f'lr {optimizer.param_groups[0]["lr"]:.2e} ({time.time() - t0:.0f}s)')
    if args.distributed:
        dist.all_reduce(stats)
    return {'loss': (stats[0] / stats[2]).item(), 'acc': (100 * stats[1] / stats[2]).item()}


@torch.no_grad()
def validate(model, loader, args):
    model.eval()
    stats = torch.zeros(3, device='cuda', dtype=torch.float64)
    criterion = nn.CrossEntropyLoss(reduction='sum')
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        with torch.autocast(device_type='cuda', dtype=torch.float16, enabled=args.amp):
            outputs = model(images)
        stats += torch.tensor([criterion(outputs.float(), targets).item(), (outputs.argmax(1) == targets).sum().item(),
                               images.size(0)], device='cuda', dtype=torch.float64)
    if args.distributed:
        dist.all_reduce(stats)
    return {'loss': (stats[0] / stats[2]).item(), 'acc1': (100 * stats[1] / stats[2]).item()}


def main():
    parser = argparse.ArgumentParser('timm fine-tuning on an image folder')
    parser.add_argument('--data-path', required=True)
    parser.add_argument('--val-ratio', type=float, default=0.1)
    parser.add_argument('--model', default='resnet50.a1_in1k')
    parser.add_argument('--input-size', type=int, default=224)
    parser.add_argument('--batch-size', type=int, default=64, help='per GPU')
    parser.add_argument('--epochs', type=int, default=50)
    parser.add_argument('--lr', type=float, default=1e-3, help='for a global batch of 256')
    parser.add_argument('--weight-decay', type=float, default=0.02)
    parser.add_argument('--warmup-epochs', type=int, default=3)
    parser.add_argument('--smoothing', type=float, default=0.1)
    parser.add_argument('--clip-grad', type=float, default=None)
    parser.add_argument('--amp', action='store_true', default=True)
    parser.add_argument('--workers', type=int, default=8)
    parser.add_argument('--log-interval', type=int, default=50)
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--output-dir', default='./output')
    args = parser.parse_args()

    init_distributed_mode(args)
    torch.manual_seed(args.seed + args.rank)
    np.random.seed(args.seed + args.rank)
    torch.backends.cudnn.benchmark = True

    dataset_train, dataset_val, num_classes = build_datasets(args)
    print(f'{len(dataset_train)} train / {len(dataset_val)} val images, {num_classes} classes')
    if args.distributed:
        sampler_train = DistributedSampler(dataset_train, shuffle=True)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
    loader_train = DataLoader(dataset_train, batch_size=args.batch_size, sampler=sampler_train,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    loader_val = DataLoader(dataset_val, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes, drop_path_rate=0.05)
    if args.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda()
    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    args.lr = args.lr * args.batch_size * args.world_size / 256
    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(loader_train)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=1e-6,
                                     warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-6,
                                     t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)

    os.makedirs(args.output_dir, exist_ok=True)
    best_acc, start = 0.0, time.time()
    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, scaler, lr_scheduler, epoch, args)
        val_stats = validate(model, loader_val, args)
        print(f'Epoch {epoch}: train {train_stats} val {val_stats}')
        if args.rank == 0:
            ckpt = {'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                    'scaler': scaler.state_dict(), 'epoch': epoch, 'args': vars(args)}
            torch.save(ckpt, os.path.join(args.output_dir, 'last.pth'))
            if val_stats['acc1'] > best_acc:
                best_acc = val_stats['acc1']
                torch.save(ckpt, os.path.join(args.output_dir, 'best.pth'))
            with open(os.path.join(args.output_dir, 'log.jsonl'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, **{f'train_{k}': v for k, v in train_stats.items()},
                                    **{f'val_{k}': v for k, v in val_stats.items()}}) + '\n')

    print(f'best val acc {best_acc:.2f}, total time {datetime.timedelta(seconds=int(time.time() - start))}')
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
