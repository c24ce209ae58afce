# Swin-B fine-tuning at 384x384 on iNaturalist-2018 (or any ImageFolder) from ImageNet-22K weights.
# Activation checkpointing keeps the 384px batch in memory; repeated augmentation + EMA.
import argparse
import datetime
import json
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2
from torch.utils.data import Sampler
from torchvision import datasets, transforms


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
        args.rank, args.world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    elif 'SLURM_PROCID' in os.environ:
        args.rank, args.world_size = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS'])
        args.gpu = int(os.environ['SLURM_LOCALID'])
    else:
        print('Not using distributed mode')
        args.rank, args.world_size, args.distributed = 0, 1, False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


class RASampler(Sampler):
    """Repeated augmentation: each image appears num_repeats times per epoch, on different ranks."""

    def __init__(self, dataset, num_replicas, rank, num_repeats=3):
        self.dataset, self.num_replicas, self.rank, self.num_repeats = dataset, num_replicas, rank, num_repeats
        self.epoch = 0
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected_samples = int(math.floor(len(dataset) // 256 * 256 / num_replicas))

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        indices = torch.randperm(len(self.dataset), generator=g)
        indices = torch.repeat_interleave(indices, repeats=self.num_repeats, dim=0).tolist()
        indices += indices[:self.total_size - len(indices)]
        indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(indices[:self.num_selected_samples])

    def __len__(self):
        return self.num_selected_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


class SequentialDistributedSampler(Sampler):
    """Contiguous, evenly sized shards of the eval set; the wrap-around tail is cut off after gathering."""

    def __init__(self, dataset, batch_size, num_replicas, rank):
        self.num_samples = int(math.ceil(len(dataset) * 1.0 / batch_size / num_replicas)) * batch_size
        self.total_size = self.num_samples * num_replicas
        indices = list(range(len(dataset)))
        indices = (indices * math.ceil(self.total_size / len(indices)))[:self.total_size]
        self.indices = indices[rank * self.num_samples:(rank + 1) * self.num_samples]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


def distributed_concat(tensor, num_total_examples):
    output_tensors = [tensor.clone() for _ in range(get_world_size())]
    dist.all_gather(output_tensors, tensor)
    return torch.cat(output_tensors, dim=0)[:num_total_examples]


@torch.no_grad()
def evaluate(model, data_loader, num_examples, device):
    model.eval()
    preds, labels = [], []
    for images, target in data_loader:
        with torch.cuda.amp.autocast():
            output = model(images.to(device, non_blocking=True))
        preds.append(output.topk(5, dim=1).indices)
        labels.append(target.to(device))
    preds, labels = torch.cat(preds), torch.cat(labels)
    if get_world_size() > 1:
        preds, labels = distributed_concat(preds, num_examples), distributed_concat(labels, num_examples)
    acc1 = (preds[:, 0] == labels).float().mean().item() * 100
    acc5 = (preds == labels[:, None]).any(dim=1).float().mean().item() * 100
    return {'acc1': acc1, 'acc5': acc5}


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    torch.manual_seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())

    transform_train = create_transform(args.input_size, is_training=True, auto_augment='rand-m9-mstd0.5-inc1',
                                       interpolation='bicubic', re_prob=0.25)
    transform_val = transforms.Compose([
        transforms.Resize((args.input_size, args.input_size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, 'val'), transform_val)
    num_classes = len(dataset_train.classes)

    sampler_train = RASampler(dataset_train, get_world_size(), get_rank()) if args.repeated_aug else \
        torch.utils.data.DistributedSampler(dataset_train, num_replicas=get_world_size(), rank=get_rank(), shuffle=True)
    sampler_val = SequentialDistributedSampler(dataset_val, args.batch_size, get_world_size(), get_rank())
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=args.batch_size,
                                                  num_workers=args.num_workers, pin_memory=True)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=num_classes)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes, drop_path_rate=args.drop_path)
    model.set_grad_checkpointing(True)
    model.to(device)
    model_ema = ModelEmaV2(model, decay=args.ema_decay)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    skip = model_without_ddp.no_weight_decay() if hasattr(model_without_ddp, 'no_weight_decay') else set()
    decay, no_decay = [], []
    for name, p in model_without_ddp.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip or 'relative_position_bias_table' in name else decay).append(p)
    args.lr = args.blr * args.batch_size * get_world_size() / 512
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                                   {'params': no_decay, 'weight_decay': 0.}], lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()
    total_steps = args.epochs * len(data_loader_train)
    warmup_steps = args.warmup_epochs * len(data_loader_train)

    start_epoch, best_acc = 0, 0.0
    resume = os.path.join(args.output_dir, 'checkpoint.pth')
    if os.path.isfile(resume):
        ckpt = torch.load(resume, map_location='cpu')
        model_without_ddp.load_state_dict(ckpt['model'])
        model_ema.module.load_state_dict(ckpt['model_ema'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        start_epoch, best_acc = ckpt['epoch'] + 1, ckpt['best_acc']
        print(f'resumed from epoch {ckpt["epoch"]}')

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        for it, (samples, targets) in enumerate(data_loader_train):
            step = epoch * len(data_loader_train) + it
            lr = args.lr * step / warmup_steps if step < warmup_steps else \
                1e-6 + (args.lr - 1e-6) * 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))
            for g in optimizer.param_groups:
                g['lr'] = lr
            samples, targets = mixup_fn(samples.to(device, non_blocking=True), targets.to(device, non_blocking=True))
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            model_ema.update(model_without_ddp)
            if it % 50 == 0:
                print(f'Epoch [{epoch}] [{it}/{len(data_loader_train)}] loss {loss.item():.4f} lr {lr:.2e}')

        stats = evaluate(model, data_loader_val, len(dataset_val), device)
        stats_ema = evaluate(model_ema.module, data_loader_val, len(dataset_val), device)
        best_acc = max(best_acc, stats['acc1'], stats_ema['acc1'])
        print(f'Epoch {epoch}: acc1 {stats["acc1"]:.2f} ema acc1 {stats_ema["acc1"]:.2f} best {best_acc:.2f}')
        save_on_master({'model': model_without_ddp.state_dict(), 'model_ema': model_ema.module.state_dict(),
                        'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(), 'epoch': epoch,
                        'best_acc': best_acc}, resume)
        if is_main_process():
            with open(os.path.join(args.output_dir, 'log.txt'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, **stats, **{f'ema_{k}': v for k, v in stats_ema.items()}}) + '\n')

    print('Training time {}'.format(datetime.timedelta(seconds=int(time.time() - start_time))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('Swin 384 fine-tuning')
    parser.add_argument('--model', default='swin_base_patch4_window12_384.ms_in22k')
    parser.add_argument('--data_path', default='/data/inat2018')
    parser.add_argument('--input_size', default=384, type=int)
    parser.add_argument('--batch_size', default=32, type=int)
    parser.add_argument('--epochs', default=100, type=int)
    parser.add_argument('--warmup_epochs', default=5, type=int)
    parser.add_argument('--blr', default=2e-4, type=float, help='lr for a global batch of 512')
    parser.add_argument('--weight_decay', default=1e-8, type=float)
    parser.add_argument('--drop_path', default=0.2, type=float)
    parser.add_argument('--ema_decay', default=0.9998, type=float)
    parser.add_argument('--repeated_aug', action='store_true')
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--output_dir', default='./output/swin_b_384_inat')
    parser.add_argument('--dist_url', default='env://')
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)
