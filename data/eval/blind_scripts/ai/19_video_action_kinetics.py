"""
Action recognition on Kinetics-400 with an R(2+1)D-18 backbone (frames pre-extracted to JPEG folders).
Clip sampling: 16 frames, stride 4; train on random clips, validate on the centre clip of each video.
"""
import argparse
import datetime
import json
import os
import random
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


class SmoothedValue(object):
    def __init__(self, window_size=20):
        self.deque = deque(maxlen=window_size)
        self.total, self.count = 0.0, 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        if not is_dist_avail_and_initialized():
            return
        t = torch.tensor([self.count, self.total], dtype=torch.float64, device='cuda')
        dist.barrier()
        dist.all_reduce(t)
        self.count, self.total = int(t[0].item()), t[1].item()

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    def __str__(self):
        return "{:.4f} ({:.4f})".format(float(np.median(list(self.deque))), self.global_avg)


class MetricLogger(object):
    def __init__(self, delimiter="  "):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, n=1, **kwargs):
        for k, v in kwargs.items():
            self.meters[k].update(v.item() if isinstance(v, torch.Tensor) else v, n=n)

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def __str__(self):
        return self.delimiter.join("{}: {}".format(k, str(m)) for k, m in self.meters.items())


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


class KineticsFrames(Dataset):
    """List file lines: `<video_dir> <num_frames> <label>`."""

    def __init__(self, root, list_file, num_frames=16, stride=4, train=True, crop=112):
        with open(list_file) as f:
            self.samples = [(os.path.join(root, p), int(n), int(y)) for p, n, y in (line.split() for line in f)]
        self.num_frames, self.stride, self.train = num_frames, stride, train
        norm = transforms.Normalize([0.43216, 0.394666, 0.37645], [0.22803, 0.22145, 0.216989])
        if train:
            self.transform = transforms.Compose([transforms.Resize((128, 171)), transforms.RandomCrop(crop), norm])
        else:
            self.transform = transforms.Compose([transforms.Resize((128, 171)), transforms.CenterCrop(crop), norm])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, n, label = self.samples[idx]
        span = self.num_frames * self.stride
        start = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        ids = [min(start + i * self.stride, n - 1) for i in range(self.num_frames)]
        frames = [transforms.functional.pil_to_tensor(Image.open(os.path.join(path, f'img_{i + 1:05d}.jpg')).convert('RGB'))
                  for i in ids]
        clip = torch.stack(frames).float() / 255.0  # T, C, H, W
        if self.train and random.random() < 0.5:
            clip = clip.flip(-1)
        clip = self.transform(clip)
        return clip.permute(1, 0, 2, 3), label  # C, T, H, W


def train_one_epoch(model, criterion, data_loader, optimizer, scaler, lr_schedule, epoch, device, print_freq=50):
    model.train()
    metric_logger = MetricLogger()
    t0 = time.time()
    for i, (clips, targets) in enumerate(data_loader):
        it = epoch * len(data_loader) + i
        for g in optimizer.param_groups:
            g['lr'] = lr_schedule[it]
        clips, targets = clips.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(clips)
            loss = criterion(output, targets)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        acc1 = (output.argmax(1) == targets).float().mean() * 100
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]['lr'])
        metric_logger.update(n=clips.size(0), acc1=acc1.item())
        if i % print_freq == 0:
            print(f'Epoch: [{epoch}] [{i}/{len(data_loader)}] {metric_logger} ({time.time() - t0:.0f}s)')
    metric_logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = nn.CrossEntropyLoss()
    metric_logger = MetricLogger()
    model.eval()
    for clips, target in data_loader:
        clips, target = clips.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(clips)
            loss = criterion(output, target)
        top5 = output.topk(5, 1).indices
        bs = clips.size(0)
        metric_logger.update(loss=loss.item())
        metric_logger.update(n=bs, acc1=(top5[:, 0] == target).float().mean().item() * 100,
                             acc5=(top5 == target[:, None]).any(1).float().mean().item() * 100)
    metric_logger.synchronize_between_processes()
    print('* Acc@1 {:.3f} Acc@5 {:.3f} loss {:.3f}'.format(metric_logger.meters['acc1'].global_avg,
                                                          metric_logger.meters['acc5'].global_avg,
                                                          metric_logger.meters['loss'].global_avg))
    return {k: m.global_avg for k, m in metric_logger.meters.items()}


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    torch.backends.cudnn.benchmark = True

    dataset_train = KineticsFrames(args.data_root, args.train_list, train=True)
    dataset_val = KineticsFrames(args.data_root, args.val_list, train=False)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True) if args.distributed else \
        torch.utils.data.RandomSampler(dataset_train)
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = DataLoader(dataset_val, sampler=torch.utils.data.SequentialSampler(dataset_val),
                                 batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    model = torchvision.models.video.r2plus1d_18(weights=None, num_classes=args.num_classes)
    if args.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    args.lr = args.lr * args.batch_size * get_world_size() / 64
    optimizer = torch.optim.SGD(model_without_ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    iters = len(data_loader_train)
    warmup = np.linspace(args.lr * 0.01, args.lr, args.warmup_epochs * iters)
    steps = np.arange((args.epochs - args.warmup_epochs) * iters)
    lr_schedule = np.concatenate([warmup, 0.5 * args.lr * (1 + np.cos(np.pi * steps / len(steps)))])

    start_epoch, max_accuracy = 0, 0.0
    ckpt_path = os.path.join(args.output_dir, 'checkpoint.pth')
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location='cpu')
        model_without_ddp.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        start_epoch, max_accuracy = ckpt['epoch'] + 1, ckpt.get('max_accuracy', 0.0)

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, scaler, lr_schedule, epoch, device)
        save_on_master({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scaler': scaler.state_dict(), 'epoch': epoch, 'max_accuracy': max_accuracy}, ckpt_path)
        if is_main_process() and (epoch % args.eval_freq == 0 or epoch == args.epochs - 1):
            # the full validation set on one GPU keeps the numbers comparable with single-GPU runs
            test_stats = evaluate(data_loader_val, model, device)
            max_accuracy = max(max_accuracy, test_stats['acc1'])
            print(f'Max accuracy: {max_accuracy:.2f}%')
            with open(os.path.join(args.output_dir, 'log.txt'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, **{f'train_{k}': v for k, v in train_stats.items()},
                                    **{f'test_{k}': v for k, v in test_stats.items()}}) + '\n')

    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('Kinetics-400 action recognition')
    parser.add_argument('--data_root', default='/data/kinetics400/rawframes')
    parser.add_argument('--train_list', default='/data/kinetics400/train_list_rawframes.txt')
    parser.add_argument('--val_list', default='/data/kinetics400/val_list_rawframes.txt')
    parser.add_argument('--num_classes', default=400, type=int)
    parser.add_argument('--batch_size', default=16, type=int)
    parser.add_argument('--epochs', default=45, type=int)
    parser.add_argument('--warmup_epochs', default=5, type=int)
    parser.add_argument('--lr', default=0.01, type=float, help='for a total batch of 64 clips')
    parser.add_argument('--weight_decay', default=1e-4, type=float)
    parser.add_argument('--eval_freq', default=5, type=int)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--output_dir', default='./work_dirs/r2plus1d_k400')
    parser.add_argument('--dist_url', default='env://')
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)
