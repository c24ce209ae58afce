# ConvNeXt ImageNet-1K training (convnext_tiny, 300 epochs, AdamW, EMA, mixup/cutmix).
import argparse
import datetime
import json
import math
import os
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.models import create_model
from timm.utils import ModelEmaV2, accuracy
from torchvision import datasets, transforms


class SmoothedValue(object):
    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total, self.count = 0.0, 0
        self.fmt = fmt or "{median:.4f} ({global_avg:.4f})"

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        if not (dist.is_available() and dist.is_initialized()):
            return
        t = torch.tensor([self.count, self.total], dtype=torch.float64, device='cuda')
        dist.barrier()
        dist.all_reduce(t)
        self.count, self.total = int(t[0].item()), t[1].item()

    @property
    def global_avg(self):
        return self.total / self.count

    def __str__(self):
        return self.fmt.format(median=float(np.median(list(self.deque))), global_avg=self.global_avg)


class MetricLogger(object):
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if v is None:
                continue
            self.meters[k].update(v.item() if isinstance(v, torch.Tensor) else v)

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def __str__(self):
        return self.delimiter.join("{}: {}".format(name, str(meter)) for name, meter in self.meters.items())

    def log_every(self, iterable, print_freq, header=''):
        start_time = time.time()
        for i, obj in enumerate(iterable):
            yield obj
            if i % print_freq == 0 or i == len(iterable) - 1:
                eta = (time.time() - start_time) / (i + 1) * (len(iterable) - i - 1)
                print('{} [{}/{}] eta: {} {}'.format(header, i, len(iterable),
                                                    datetime.timedelta(seconds=int(eta)), str(self)))


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
    print('| distributed init (rank {}): {}, gpu {}'.format(args.rank, args.dist_url, args.gpu), flush=True)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = np.array([final_value + 0.5 * (base_value - final_value) * (1 + math.cos(math.pi * i / (len(iters))))
                         for i in iters])
    return np.concatenate((warmup_schedule, schedule))


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler, model_ema, mixup_fn,
                    start_steps, lr_schedule_values, wd_schedule_values, update_freq):
    model.train(True)
    metric_logger = MetricLogger(delimiter="  ")
    optimizer.zero_grad()
    for data_iter_step, (samples, targets) in enumerate(metric_logger.log_every(data_loader, 200, f'Epoch: [{epoch}]')):
        it = start_steps + data_iter_step // update_freq
        if data_iter_step % update_freq == 0:
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_schedule_values[it] * param_group.get("lr_scale", 1.0)
                if param_group["weight_decay"] > 0:
                    param_group["weight_decay"] = wd_schedule_values[it]
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.cuda.amp.autocast():
            output = model(samples)
            loss = criterion(output, targets)
        loss_value = loss.item()
        loss /= update_freq
        loss_scaler.scale(loss).backward()
        if (data_iter_step + 1) % update_freq == 0:
            loss_scaler.step(optimizer)
            loss_scaler.update()
            optimizer.zero_grad()
            if model_ema is not None:
                model_ema.update(model)
        torch.cuda.synchronize()
        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"])
    metric_logger.synchronize_between_processes()
    print("Averaged stats:", metric_logger)
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = torch.nn.CrossEntropyLoss()
    metric_logger = MetricLogger(delimiter="  ")
    model.eval()
    for images, target in metric_logger.log_every(data_loader, 50, 'Test:'):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = images.shape[0]
        metric_logger.update(loss=loss.item())
        metric_logger.meters['acc1'].update(acc1.item(), n=batch_size)
        metric_logger.meters['acc5'].update(acc5.item(), n=batch_size)
    print('* Acc@1 {top1.global_avg:.3f} Acc@5 {top5.global_avg:.3f} loss {losses.global_avg:.3f}'
          .format(top1=metric_logger.meters['acc1'], top5=metric_logger.meters['acc5'], losses=metric_logger.meters['loss']))
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def get_args_parser():
    parser = argparse.ArgumentParser('ConvNeXt training and evaluation script for image classification', add_help=False)
    parser.add_argument('--batch_size', default=128, type=int, help='Per GPU batch size')
    parser.add_argument('--epochs', default=300, type=int)
    parser.add_argument('--update_freq', default=1, type=int, help='gradient accumulation steps')
    parser.add_argument('--model', default='convnext_tiny', type=str)
    parser.add_argument('--drop_path', type=float, default=0.1)
    parser.add_argument('--model_ema_decay', type=float, default=0.9999)
    parser.add_argument('--weight_decay', type=float, default=0.05)
    parser.add_argument('--weight_decay_end', type=float, default=None)
    parser.add_argument('--lr', type=float, default=4e-3, help='learning rate for a total batch size of 4096')
    parser.add_argument('--min_lr', type=float, default=1e-6)
    parser.add_argument('--warmup_epochs', type=int, default=20)
    parser.add_argument('--smoothing', type=float, default=0.1)
    parser.add_argument('--data_path', default='/datasets01/imagenet_full_size/061417/', type=str)
    parser.add_argument('--nb_classes', default=1000, type=int)
    parser.add_argument('--output_dir', default='')
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--auto_resume', type=bool, default=True)
    parser.add_argument('--dist_eval', type=bool, default=True)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--dist_url', default='env://')
    return parser


def main(args):
    init_distributed_mode(args)
    print(args)
    device = torch.device('cuda')
    torch.manual_seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())
    cudnn.benchmark = True

    transform_train = create_transform(input_size=224, is_training=True, color_jitter=0.4, auto_augment='rand-m9-mstd0.5-inc1',
                                       interpolation='bicubic', re_prob=0.25, re_mode='pixel', re_count=1)
    transform_val = transforms.Compose([transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
                                        transforms.CenterCrop(224), transforms.ToTensor(),
                                        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform=transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, 'val'), transform=transform_val)

    num_tasks, global_rank = get_world_size(), get_rank()
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=num_tasks, rank=global_rank,
                                                        shuffle=True, seed=args.seed)
    if args.dist_eval:
        sampler_val = torch.utils.data.DistributedSampler(dataset_val, num_replicas=num_tasks, rank=global_rank, shuffle=False)
    else:
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=int(1.5 * args.batch_size),
                                                  num_workers=args.num_workers, pin_memory=True, drop_last=False)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode='batch',
                     label_smoothing=args.smoothing, num_classes=args.nb_classes)

    model = create_model(args.model, pretrained=False, num_classes=args.nb_classes, drop_path_rate=args.drop_path)
    model.to(device)
    model_ema = ModelEmaV2(model, decay=args.model_ema_decay)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    total_batch_size = args.batch_size * args.update_freq * num_tasks
    num_training_steps_per_epoch = len(data_loader_train) // args.update_freq
    args.lr = args.lr * total_batch_size / 4096
    args.min_lr = args.min_lr * total_batch_size / 4096
    print("LR = %.8f, Batch size = %d, Update frequent = %d, Number of training steps per epoch = %d" %
          (args.lr, total_batch_size, args.update_freq, num_training_steps_per_epoch))

    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loss_scaler = torch.cuda.amp.GradScaler()
    lr_schedule_values = cosine_scheduler(args.lr, args.min_lr, args.epochs, num_training_steps_per_epoch,
                                          warmup_epochs=args.warmup_epochs)
    wd_schedule_values = cosine_scheduler(args.weight_decay, args.weight_decay_end or args.weight_decay, args.epochs,
                                          num_training_steps_per_epoch)
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy = 0, 0.0
    if args.auto_resume and args.output_dir and os.path.exists(os.path.join(args.output_dir, 'checkpoint-latest.pth')):
        checkpoint = torch.load(os.path.join(args.output_dir, 'checkpoint-latest.pth'), map_location='cpu')
        model_without_ddp.load_state_dict(checkpoint['model'])
        model_ema.module.load_state_dict(checkpoint['model_ema'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        loss_scaler.load_state_dict(checkpoint['scaler'])
        start_epoch, max_accuracy = checkpoint['epoch'] + 1, checkpoint['max_accuracy']
        print("Resume from epoch %d" % start_epoch)

    print("Start training for %d epochs" % args.epochs)
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        data_loader_train.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, loss_scaler, model_ema,
                                      mixup_fn, epoch * num_training_steps_per_epoch, lr_schedule_values,
                                      wd_schedule_values, args.update_freq)
        test_stats = evaluate(data_loader_val, model, device)
        print(f"Accuracy of the model on the {len(dataset_val)} test images: {test_stats['acc1']:.1f}%")
        test_stats_ema = evaluate(data_loader_val, model_ema.module, device)
        print(f"Accuracy of the model EMA on {len(dataset_val)} test images: {test_stats_ema['acc1']:.1f}%")
        is_best = test_stats["acc1"] > max_accuracy
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        if args.output_dir:
            to_save = {'model': model_without_ddp.state_dict(), 'model_ema': model_ema.module.state_dict(),
                       'optimizer': optimizer.state_dict(), 'scaler': loss_scaler.state_dict(), 'epoch': epoch,
                       'max_accuracy': max_accuracy, 'args': args}
            save_on_master(to_save, os.path.join(args.output_dir, 'checkpoint-latest.pth'))
            if is_best:
                save_on_master(to_save, os.path.join(args.output_dir, 'checkpoint-best.pth'))
        print(f'Max accuracy: {max_accuracy:.2f}%')
        log_stats = {**{f'train_{k}': v for k, v in train_stats.items()},
                     **{f'test_{k}': v for k, v in test_stats.items()},
                     **{f'test_ema_{k}': v for k, v in test_stats_ema.items()}, 'epoch': epoch}
        if args.output_dir and is_main_process():
            with open(os.path.join(args.output_dir, "log.txt"), mode="a", encoding="utf-8") as f:
                f.write(json.dumps(log_stats) + "\n")

    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('ConvNeXt training and evaluation script', parents=[get_args_parser()])
    args = parser.parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
