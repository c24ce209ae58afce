# MAE linear probing: frozen ViT-B/16 encoder + BN/linear head, LARS, 90 epochs, global batch 16384.
import argparse
import datetime
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torchvision.datasets as datasets
import torchvision.transforms as transforms
from timm.models.layers import trunc_normal_
from timm.utils import accuracy


class LARS(torch.optim.Optimizer):
    """LARS optimizer, no rate scaling or weight decay for parameters <= 1D."""

    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g['params']:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g['weight_decay'])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0., torch.where(update_norm > 0,
                                    (g['trust_coefficient'] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)
                param_state = self.state[p]
                if 'mu' not in param_state:
                    param_state['mu'] = torch.zeros_like(p)
                mu = param_state['mu']
                mu.mul_(g['momentum']).add_(dp)
                p.add_(mu, alpha=-g['lr'])


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
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    elif 'SLURM_PROCID' in os.environ:
        args.rank = int(os.environ['SLURM_PROCID'])
        args.world_size = int(os.environ['SLURM_NTASKS'])
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print('| distributed init (rank {}): {}, gpu {}'.format(args.rank, args.dist_url, args.gpu), flush=True)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


class Meter:
    def __init__(self):
        self.sums = defaultdict(float)
        self.counts = defaultdict(float)

    def update(self, n=1, **kw):
        for k, v in kw.items():
            self.sums[k] += float(v) * n
            self.counts[k] += n

    def synchronize_between_processes(self):
        if get_world_size() == 1:
            return
        keys = sorted(self.sums)
        t = torch.tensor([[self.sums[k], self.counts[k]] for k in keys], dtype=torch.float64, device='cuda')
        dist.barrier()
        dist.all_reduce(t)
        for k, (s, c) in zip(keys, t.tolist()):
            self.sums[k], self.counts[k] = s, c

    def averages(self):
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * \
            (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, args):
    model.train(True)
    meter = Meter()
    for it, (samples, targets) in enumerate(data_loader):
        adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            outputs = model(samples)
            loss = criterion(outputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        if it % 20 == 0:
            print(f"Epoch: [{epoch}] [{it}/{len(data_loader)}] loss {loss.item():.4f}")
    meter.synchronize_between_processes()
    return meter.averages()


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = torch.nn.CrossEntropyLoss()
    meter = Meter()
    model.eval()
    for images, target in data_loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        meter.update(n=images.shape[0], loss=loss.item(), acc1=acc1.item(), acc5=acc5.item())
    meter.synchronize_between_processes()
    stats = meter.averages()
    print('* Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} loss {loss:.3f}'.format(**stats))
    return stats


def get_args_parser():
    parser = argparse.ArgumentParser('MAE linear probing for image classification', add_help=False)
    parser.add_argument('--batch_size', default=512, type=int, help='Batch size per GPU')
    parser.add_argument('--epochs', default=90, type=int)
    parser.add_argument('--accum_iter', default=1, type=int)
    parser.add_argument('--model', default='vit_base_patch16_224', type=str)
    parser.add_argument('--weight_decay', type=float, default=0)
    parser.add_argument('--lr', type=float, default=None)
    parser.add_argument('--blr', type=float, default=0.1)
    parser.add_argument('--min_lr', type=float, default=0.)
    parser.add_argument('--warmup_epochs', type=int, default=10)
    parser.add_argument('--finetune', default='', help='finetune from checkpoint')
    parser.add_argument('--global_pool', action='store_true')
    parser.add_argument('--data_path', default='/datasets01/imagenet_full_size/061417/', type=str)
    parser.add_argument('--nb_classes', default=1000, type=int)
    parser.add_argument('--output_dir', default='./output_dir')
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--resume', default='')
    parser.add_argument('--start_epoch', default=0, type=int)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--dist_url', default='env://')
    return parser


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    torch.manual_seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())

    transform_train = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=3), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    transform_val = transforms.Compose([
        transforms.Resize(256, interpolation=3), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform=transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, 'val'), transform=transform_val)

    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=get_world_size(), rank=get_rank(),
                                                        shuffle=True)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=torch.utils.data.SequentialSampler(dataset_val),
                                                  batch_size=args.batch_size, num_workers=args.num_workers,
                                                  pin_memory=True, drop_last=False)

    model = timm.create_model(args.model, num_classes=args.nb_classes, global_pool='avg' if args.global_pool else 'token')
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location='cpu')
        checkpoint_model = checkpoint['model']
        for k in ['head.weight', 'head.bias']:
            checkpoint_model.pop(k, None)
        msg = model.load_state_dict(checkpoint_model, strict=False)
        print(msg)
    trunc_normal_(model.head.weight, std=0.01)

    # hack: revise model's head with BN
    model.head = torch.nn.Sequential(torch.nn.BatchNorm1d(model.head.in_features, affine=False, eps=1e-6), model.head)
    for _, p in model.named_parameters():
        p.requires_grad = False
    for _, p in model.head.named_parameters():
        p.requires_grad = True
    if args.distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * get_world_size()
    if args.lr is None:
        args.lr = args.blr * eff_batch_size / 256
    print("actual lr: %.2e  effective batch size: %d" % (args.lr, eff_batch_size))
    optimizer = LARS(model_without_ddp.head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    criterion = torch.nn.CrossEntropyLoss()

    if not args.resume and os.path.isfile(os.path.join(args.output_dir, 'checkpoint-last.pth')):
        args.resume = os.path.join(args.output_dir, 'checkpoint-last.pth')
    if args.resume:
        checkpoint = torch.load(args.resume)
        model_without_ddp.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        args.start_epoch = checkpoint['epoch'] + 1
        print("Resume checkpoint %s (epoch %d)" % (args.resume, checkpoint['epoch']))
        del checkpoint

    print(f"Start training for {args.epochs} epochs")
    start_time = time.time()
    max_accuracy = 0.0
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            data_loader_train.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, args)
        if args.output_dir:
            save_on_master({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'epoch': epoch, 'args': args}, os.path.join(args.output_dir, 'checkpoint-last.pth'))
        test_stats = evaluate(data_loader_val, model, device)
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        print(f'Max accuracy: {max_accuracy:.2f}%')
        log_stats = {**{f'train_{k}': v for k, v in train_stats.items()},
                     **{f'test_{k}': v for k, v in test_stats.items()}, 'epoch': epoch}
        if args.output_dir and is_main_process():
            with open(os.path.join(args.output_dir, "log.txt"), mode="a", encoding="utf-8") as f:
                f.write(json.dumps(log_stats) + "\n")

    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    args = get_args_parser().parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
