# Copyright (c) 2015-present, Facebook, Inc.
# All rights reserved.
"""
DeiT with a distillation token: training on ImageNet (optionally with a RegNetY teacher), EMA, mixup/cutmix.
"""
import argparse
import datetime
import json
import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.models import create_model
from timm.models.layers import trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from timm.scheduler import create_scheduler
from timm.optim import create_optimizer
from timm.utils import NativeScaler, ModelEma, accuracy
from torchvision import datasets, transforms


class DistilledVisionTransformer(VisionTransformer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dist_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        num_patches = self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 2, self.embed_dim))
        self.head_dist = nn.Linear(self.embed_dim, self.num_classes) if self.num_classes > 0 else nn.Identity()
        trunc_normal_(self.dist_token, std=.02)
        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.head_dist.weight, std=.02)
        nn.init.zeros_(self.head_dist.bias)

    def forward_features(self, x):
        B = x.shape[0]
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(B, -1, -1), self.dist_token.expand(B, -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return x[:, 0], x[:, 1]

    def forward(self, x):
        x, x_dist = self.forward_features(x)
        x, x_dist = self.head(x), self.head_dist(x_dist)
        if self.training:
            return x, x_dist
        # during inference, return the average of both classifier predictions
        return (x + x_dist) / 2


MODELS = {
    'deit_tiny_distilled_patch16_224': dict(embed_dim=192, depth=12, num_heads=3),
    'deit_small_distilled_patch16_224': dict(embed_dim=384, depth=12, num_heads=6),
    'deit_base_distilled_patch16_224': dict(embed_dim=768, depth=12, num_heads=12),
}


class DistillationLoss(nn.Module):
    def __init__(self, base_criterion, teacher_model, distillation_type, alpha, tau):
        super().__init__()
        self.base_criterion, self.teacher_model = base_criterion, teacher_model
        assert distillation_type in ['none', 'soft', 'hard']
        self.distillation_type, self.alpha, self.tau = distillation_type, alpha, tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == 'none':
            return base_loss
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == 'soft':
            T = self.tau
            distillation_loss = F.kl_div(F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                                         reduction='sum', log_target=True) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    elif 'SLURM_PROCID' in os.environ:
        args.rank, args.world_size = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS'])
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print('| distributed init (rank {}): {}'.format(args.rank, args.dist_url), flush=True)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler, model_ema, mixup_fn, clip_grad):
    model.train()
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    t0 = time.time()
    for i, (samples, targets) in enumerate(data_loader):
        samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.cuda.amp.autocast():
            outputs = model(samples)
            loss = criterion(samples, outputs, targets)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=clip_grad, parameters=model.parameters())
        torch.cuda.synchronize()
        if model_ema is not None:
            model_ema.update(model)
        stats += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=device)
        if i % 100 == 0:
            print(f'Epoch: [{epoch}] [{i}/{len(data_loader)}] loss: {loss.item():.4f} '
                  f'lr: {optimizer.param_groups[0]["lr"]:.6f} ({time.time() - t0:.0f}s)')
    if get_world_size() > 1:
        dist.all_reduce(stats)
    return {'loss': (stats[0] / stats[1]).item(), 'lr': optimizer.param_groups[0]["lr"]}


@torch.no_grad()
def evaluate(data_loader, model, device):
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for images, target in data_loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        bs = images.shape[0]
        stats += torch.tensor([acc1.item() * bs, acc5.item() * bs, bs], dtype=torch.float64, device=device)
    if get_world_size() > 1:
        dist.all_reduce(stats)
    res = {'acc1': (stats[0] / stats[2]).item(), 'acc5': (stats[1] / stats[2]).item()}
    print('* Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}'.format(**res))
    return res


def get_args_parser():
    parser = argparse.ArgumentParser('DeiT training and evaluation script', add_help=False)
    parser.add_argument('--batch-size', default=128, type=int)
    parser.add_argument('--epochs', default=300, type=int)
    parser.add_argument('--model', default='deit_small_distilled_patch16_224', type=str, choices=list(MODELS))
    parser.add_argument('--input-size', default=224, type=int)
    parser.add_argument('--drop-path', type=float, default=0.1)
    parser.add_argument('--model-ema-decay', type=float, default=0.99996)
    parser.add_argument('--opt', default='adamw', type=str)
    parser.add_argument('--clip-grad', type=float, default=None)
    parser.add_argument('--weight-decay', type=float, default=0.05)
    parser.add_argument('--sched', default='cosine', type=str)
    parser.add_argument('--lr', type=float, default=5e-4)
    parser.add_argument('--warmup-lr', type=float, default=1e-6)
    parser.add_argument('--min-lr', type=float, default=1e-5)
    parser.add_argument('--warmup-epochs', type=int, default=5)
    parser.add_argument('--cooldown-epochs', type=int, default=10)
    parser.add_argument('--smoothing', type=float, default=0.1)
    parser.add_argument('--teacher-model', default='regnety_160', type=str)
    parser.add_argument('--teacher-path', type=str, default='')
    parser.add_argument('--distillation-type', default='none', choices=['none', 'soft', 'hard'], type=str)
    parser.add_argument('--distillation-alpha', default=0.5, type=float)
    parser.add_argument('--distillation-tau', default=1.0, type=float)
    parser.add_argument('--data-path', default='/datasets01/imagenet_full_size/061417/', type=str)
    parser.add_argument('--output_dir', default='')
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--dist_url', default='env://')
    return parser


def main(args):
    init_distributed_mode(args)
    print(args)
    device = torch.device('cuda')
    torch.manual_seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())

    transform_train = create_transform(input_size=args.input_size, is_training=True, color_jitter=0.4,
                                       auto_augment='rand-m9-mstd0.5-inc1', interpolation='bicubic', re_prob=0.25)
    transform_val = transforms.Compose([
        transforms.Resize(256, interpolation=3), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform=transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, 'val'), transform=transform_val)
    nb_classes = len(dataset_train.classes)

    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=get_world_size(), rank=get_rank(),
                                                        shuffle=True)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=torch.utils.data.SequentialSampler(dataset_val),
                                                  batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers,
                                                  pin_memory=True, drop_last=False)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=args.smoothing, num_classes=nb_classes)

    model = DistilledVisionTransformer(patch_size=16, mlp_ratio=4, qkv_bias=True, num_classes=nb_classes,
                                       norm_layer=partial(nn.LayerNorm, eps=1e-6), drop_path_rate=args.drop_path,
                                       **MODELS[args.model])
    model.to(device)
    model_ema = ModelEma(model, decay=args.model_ema_decay, device='', resume='')
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    args.lr = args.lr * args.batch_size * get_world_size() / 512.0
    optimizer = create_optimizer(args, model_without_ddp)
    loss_scaler = NativeScaler()
    lr_scheduler, _ = create_scheduler(args, optimizer)

    teacher_model = None
    if args.distillation_type != 'none':
        assert args.teacher_path, 'need to specify teacher-path when using distillation'
        teacher_model = create_model(args.teacher_model, pretrained=False, num_classes=nb_classes, global_pool='avg')
        checkpoint = torch.load(args.teacher_path, map_location='cpu')
        teacher_model.load_state_dict(checkpoint['model'])
        teacher_model.to(device)
        teacher_model.eval()
    criterion = DistillationLoss(SoftTargetCrossEntropy(), teacher_model, args.distillation_type,
                                 args.distillation_alpha, args.distillation_tau)

    output_dir = Path(args.output_dir)
    start_epoch, max_accuracy = 0, 0.0
    if args.output_dir and (output_dir / 'checkpoint.pth').exists():
        checkpoint = torch.load(output_dir / 'checkpoint.pth', map_location='cpu')
        model_without_ddp.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        lr_scheduler.load_state_dict(checkpoint['lr_scheduler'])
        model_ema.ema.load_state_dict(checkpoint['model_ema'])
        loss_scaler.load_state_dict(checkpoint['scaler'])
        start_epoch, max_accuracy = checkpoint['epoch'] + 1, checkpoint.get('max_accuracy', 0.0)

    print(f"Start training for {args.epochs} epochs")
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            data_loader_train.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, loss_scaler,
                                      model_ema, mixup_fn, args.clip_grad)
        lr_scheduler.step(epoch)
        test_stats = evaluate(data_loader_val, model, device)
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        print(f'Max accuracy: {max_accuracy:.2f}%')
        if args.output_dir:
            save_on_master({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'lr_scheduler': lr_scheduler.state_dict(), 'epoch': epoch,
                            'model_ema': model_ema.ema.state_dict(), 'scaler': loss_scaler.state_dict(),
                            'max_accuracy': max_accuracy, 'args': args}, output_dir / 'checkpoint.pth')
        log_stats = {**{f'train_{k}': v for k, v in train_stats.items()},
                     **{f'test_{k}': v for k, v in test_stats.items()}, 'epoch': epoch}
        if args.output_dir and is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")

    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('DeiT training and evaluation script', parents=[get_args_parser()])
    args = parser.parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
