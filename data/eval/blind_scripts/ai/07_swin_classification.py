# --------------------------------------------------------
# Swin Transformer - ImageNet-1K classification
# --------------------------------------------------------
import argparse
import datetime
import json
import os
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
from timm.data import Mixup, create_transform
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model
from timm.scheduler.cosine_lr import CosineLRScheduler
from timm.utils import AverageMeter, accuracy
from torch import optim
from torchvision import datasets, transforms


def create_logger(output_dir, dist_rank):
    import logging
    logger = logging.getLogger(f"swin.rank{dist_rank}")
    logger.setLevel(logging.DEBUG if dist_rank == 0 else logging.WARNING)
    logger.propagate = False
    fmt = '[%(asctime)s rank%(rank)s] (%(filename)s %(lineno)d): %(levelname)s %(message)s'.replace('%(rank)s', str(dist_rank))
    handler = logging.FileHandler(os.path.join(output_dir, f'log_rank{dist_rank}.txt'), mode='a')
    handler.setFormatter(logging.Formatter(fmt=fmt, datefmt='%Y-%m-%d %H:%M:%S'))
    logger.addHandler(handler)
    if dist_rank == 0:
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter(fmt=fmt, datefmt='%Y-%m-%d %H:%M:%S'))
        logger.addHandler(console)
    return logger


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= dist.get_world_size()
    return rt


def check_keywords_in_name(name, keywords=()):
    return any(keyword in name for keyword in keywords)


def set_weight_decay(model, skip_list=(), skip_keywords=()):
    has_decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1 or name.endswith(".bias") or (name in skip_list) or \
                check_keywords_in_name(name, skip_keywords):
            no_decay.append(param)
        else:
            has_decay.append(param)
    return [{'params': has_decay}, {'params': no_decay, 'weight_decay': 0.}]


def build_optimizer(args, model):
    skip, skip_keywords = {}, {}
    if hasattr(model, 'no_weight_decay'):
        skip = model.no_weight_decay()
    if hasattr(model, 'no_weight_decay_keywords'):
        skip_keywords = model.no_weight_decay_keywords()
    parameters = set_weight_decay(model, skip, skip_keywords)
    return optim.AdamW(parameters, eps=1e-8, betas=(0.9, 0.999), lr=args.base_lr, weight_decay=args.weight_decay)


def build_loader(args):
    transform_train = create_transform(input_size=args.img_size, is_training=True, color_jitter=0.4,
                                       auto_augment='rand-m9-mstd0.5-inc1', re_prob=0.25, interpolation='bicubic')
    transform_val = transforms.Compose([
        transforms.Resize(int(256 / 224 * args.img_size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(args.img_size), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, 'val'), transform_val)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=dist.get_world_size(),
                                                        rank=dist.get_rank(), shuffle=True)
    sampler_val = torch.utils.data.distributed.DistributedSampler(dataset_val, shuffle=False)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=args.batch_size,
                                                  shuffle=False, num_workers=args.num_workers, pin_memory=True, drop_last=False)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode='batch',
                     label_smoothing=args.label_smoothing, num_classes=args.num_classes)
    return dataset_train, dataset_val, data_loader_train, data_loader_val, mixup_fn


def train_one_epoch(args, model, criterion, data_loader, optimizer, epoch, mixup_fn, lr_scheduler, scaler, logger):
    model.train()
    optimizer.zero_grad()
    num_steps = len(data_loader)
    batch_time, loss_meter, norm_meter = AverageMeter(), AverageMeter(), AverageMeter()
    start = end = time.time()
    for idx, (samples, targets) in enumerate(data_loader):
        samples = samples.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.cuda.amp.autocast(enabled=args.amp):
            outputs = model(samples)
        loss = criterion(outputs, targets) / args.accumulation_steps
        scaler.scale(loss).backward()
        if (idx + 1) % args.accumulation_steps == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            lr_scheduler.step_update((epoch * num_steps + idx) // args.accumulation_steps)
            norm_meter.update(grad_norm.item())
        torch.cuda.synchronize()
        loss_meter.update(loss.item() * args.accumulation_steps, targets.size(0))
        batch_time.update(time.time() - end)
        end = time.time()
        if idx % args.print_freq == 0:
            lr = optimizer.param_groups[0]['lr']
            memory_used = torch.cuda.max_memory_allocated() / (1024.0 * 1024.0)
            etas = batch_time.avg * (num_steps - idx)
            logger.info(f'Train: [{epoch}/{args.epochs}][{idx}/{num_steps}]\t'
                        f'eta {datetime.timedelta(seconds=int(etas))} lr {lr:.6f}\t'
                        f'loss {loss_meter.val:.4f} ({loss_meter.avg:.4f})\t'
                        f'grad_norm {norm_meter.val:.4f} ({norm_meter.avg:.4f})\tmem {memory_used:.0f}MB')
    logger.info(f"EPOCH {epoch} training takes {datetime.timedelta(seconds=int(time.time() - start))}")


@torch.no_grad()
def validate(args, data_loader, model, logger):
    criterion = torch.nn.CrossEntropyLoss()
    model.eval()
    acc1_meter, acc5_meter, loss_meter = AverageMeter(), AverageMeter(), AverageMeter()
    for idx, (images, target) in enumerate(data_loader):
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.cuda.amp.autocast(enabled=args.amp):
            output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        acc1, acc5, loss = reduce_tensor(acc1), reduce_tensor(acc5), reduce_tensor(loss)
        loss_meter.update(loss.item(), target.size(0))
        acc1_meter.update(acc1.item(), target.size(0))
        acc5_meter.update(acc5.item(), target.size(0))
    logger.info(f' * Acc@1 {acc1_meter.avg:.3f} Acc@5 {acc5_meter.avg:.3f}')
    return acc1_meter.avg, acc5_meter.avg, loss_meter.avg


def parse_option():
    parser = argparse.ArgumentParser('Swin Transformer training and evaluation script', add_help=False)
    parser.add_argument('--model', default='swin_tiny_patch4_window7_224', type=str)
    parser.add_argument('--batch-size', dest='batch_size', type=int, default=128, help="batch size for single GPU")
    parser.add_argument('--data-path', dest='data_path', type=str, default='imagenet')
    parser.add_argument('--img-size', dest='img_size', type=int, default=224)
    parser.add_argument('--num-classes', dest='num_classes', type=int, default=1000)
    parser.add_argument('--epochs', type=int, default=300)
    parser.add_argument('--warmup-epochs', dest='warmup_epochs', type=int, default=20)
    parser.add_argument('--base-lr', dest='base_lr', type=float, default=5e-4)
    parser.add_argument('--warmup-lr', dest='warmup_lr', type=float, default=5e-7)
    parser.add_argument('--min-lr', dest='min_lr', type=float, default=5e-6)
    parser.add_argument('--weight-decay', dest='weight_decay', type=float, default=0.05)
    parser.add_argument('--clip-grad', dest='clip_grad', type=float, default=5.0)
    parser.add_argument('--drop-path', dest='drop_path', type=float, default=0.2)
    parser.add_argument('--label-smoothing', dest='label_smoothing', type=float, default=0.1)
    parser.add_argument('--accumulation-steps', dest='accumulation_steps', type=int, default=1)
    parser.add_argument('--amp', action='store_true', default=True)
    parser.add_argument('--num-workers', dest='num_workers', type=int, default=8)
    parser.add_argument('--output', default='output', type=str)
    parser.add_argument('--tag', default='default')
    parser.add_argument('--print-freq', dest='print_freq', type=int, default=10)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--auto-resume', dest='auto_resume', action='store_true', default=True)
    args = parser.parse_args()
    args.output = os.path.join(args.output, args.model, args.tag)
    return args


def main(args, logger):
    dataset_train, dataset_val, data_loader_train, data_loader_val, mixup_fn = build_loader(args)
    logger.info(f"Creating model:{args.model}")
    model = create_model(args.model, pretrained=False, num_classes=args.num_classes, drop_path_rate=args.drop_path)
    model.cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank], broadcast_buffers=False)
    model_without_ddp = model.module
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(f"number of params: {n_parameters}")

    optimizer = build_optimizer(args, model)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    n_iter_per_epoch = len(data_loader_train) // args.accumulation_steps
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=(args.epochs - args.warmup_epochs) * n_iter_per_epoch,
                                     lr_min=args.min_lr, warmup_lr_init=args.warmup_lr,
                                     warmup_t=args.warmup_epochs * n_iter_per_epoch, cycle_limit=1, t_in_epochs=False,
                                     warmup_prefix=True)
    criterion = SoftTargetCrossEntropy() if mixup_fn is not None else LabelSmoothingCrossEntropy(args.label_smoothing)

    max_accuracy, start_epoch = 0.0, 0
    resume_file = os.path.join(args.output, 'ckpt_latest.pth')
    if args.auto_resume and os.path.isfile(resume_file):
        logger.info(f"auto resuming from {resume_file}")
        checkpoint = torch.load(resume_file, map_location='cpu')
        msg = model_without_ddp.load_state_dict(checkpoint['model'], strict=False)
        logger.info(msg)
        optimizer.load_state_dict(checkpoint['optimizer'])
        lr_scheduler.load_state_dict(checkpoint['lr_scheduler'])
        scaler.load_state_dict(checkpoint['scaler'])
        start_epoch = checkpoint['epoch'] + 1
        max_accuracy = checkpoint.get('max_accuracy', 0.0)
        del checkpoint
        torch.cuda.empty_cache()

    logger.info("Start training")
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        data_loader_train.sampler.set_epoch(epoch)
        train_one_epoch(args, model, criterion, data_loader_train, optimizer, epoch, mixup_fn, lr_scheduler, scaler, logger)
        if dist.get_rank() == 0:
            save_state = {'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                          'lr_scheduler': lr_scheduler.state_dict(), 'scaler': scaler.state_dict(),
                          'max_accuracy': max_accuracy, 'epoch': epoch, 'args': vars(args)}
            torch.save(save_state, resume_file)
            logger.info(f"{resume_file} saved !!!")

        acc1, acc5, loss = validate(args, data_loader_val, model, logger)
        logger.info(f"Accuracy of the network on the {len(dataset_val)} test images: {acc1:.1f}%")
        max_accuracy = max(max_accuracy, acc1)
        logger.info(f'Max accuracy: {max_accuracy:.2f}%')
        if dist.get_rank() == 0:
            with open(os.path.join(args.output, 'log.txt'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, 'acc1': acc1, 'acc5': acc5, 'loss': loss}) + '\n')

    logger.info('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))


if __name__ == '__main__':
    args = parse_option()
    args.local_rank = int(os.environ['LOCAL_RANK'])
    rank, world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
    print(f"RANK and WORLD_SIZE in environ: {rank}/{world_size}")
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend='nccl', init_method='env://', world_size=world_size, rank=rank)
    dist.barrier()

    seed = args.seed + dist.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    cudnn.benchmark = True

    # linear scale the learning rate according to total batch size
    total_batch = args.batch_size * dist.get_world_size() * args.accumulation_steps
    args.base_lr = args.base_lr * total_batch / 512.0
    args.warmup_lr = args.warmup_lr * total_batch / 512.0
    args.min_lr = args.min_lr * total_batch / 512.0

    os.makedirs(args.output, exist_ok=True)
    logger = create_logger(output_dir=args.output, dist_rank=dist.get_rank())
    if dist.get_rank() == 0:
        with open(os.path.join(args.output, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    main(args, logger)
    dist.destroy_process_group()
