# BEiT fine-tuning on ImageNet-1k with layer-wise lr decay, mixup/cutmix and gradient accumulation.
import argparse
import contextlib
import datetime
import glob
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from timm.data import Mixup, create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.loss import SoftTargetCrossEntropy
from timm.models import create_model
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


class IndexedImageFolder(datasets.ImageFolder):
    def __getitem__(self, index):
        img, target = super().__getitem__(index)
        return img, target, index


def get_layer_id_for_vit(name, num_layers):
    if name in ("cls_token", "mask_token", "pos_embed") or name.startswith("patch_embed"):
        return 0
    if name.startswith("rel_pos_bias"):
        return num_layers - 1
    if name.startswith("blocks"):
        return int(name.split('.')[1]) + 1
    return num_layers - 1


def param_groups_lrd(model, weight_decay=0.05, no_weight_decay_list=(), layer_decay=.75):
    num_layers = len(model.blocks) + 1
    layer_scales = list(layer_decay ** (num_layers - i) for i in range(num_layers + 1))
    param_groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or n in no_weight_decay_list or n.endswith('.bias'):
            g_decay, this_decay = "no_decay", 0.
        else:
            g_decay, this_decay = "decay", weight_decay
        layer_id = get_layer_id_for_vit(n, num_layers)
        group_name = "layer_%d_%s" % (layer_id, g_decay)
        if group_name not in param_groups:
            param_groups[group_name] = {"lr_scale": layer_scales[layer_id], "weight_decay": this_decay, "params": []}
        param_groups[group_name]["params"].append(p)
    return list(param_groups.values())


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * \
            (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * param_group["lr_scale"]
    return lr


def train_one_epoch(model, criterion, data_loader, optimizer, scaler, device, epoch, mixup_fn, args):
    model.train(True)
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    loss_sum = torch.zeros(2, device=device, dtype=torch.float64)
    for data_iter_step, (samples, targets, _) in enumerate(data_loader):
        if data_iter_step % accum_iter == 0:
            adjust_learning_rate(optimizer, data_iter_step / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        samples, targets = mixup_fn(samples, targets)

        update_grad = (data_iter_step + 1) % accum_iter == 0
        # skip the gradient all-reduce on the accumulation steps
        sync_ctx = model.no_sync if (args.distributed and not update_grad) else contextlib.nullcontext
        with sync_ctx():
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(outputs, targets)
            scaler.scale(loss / accum_iter).backward()
        if update_grad:
            scaler.unscale_(optimizer)
            if args.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        loss_sum += torch.tensor([loss.item(), 1.0], device=device, dtype=torch.float64)
        if data_iter_step % args.print_freq == 0:
            print('Epoch: [{}] [{}/{}] loss: {:.4f} lr: {:.6f}'.format(
                epoch, data_iter_step, len(data_loader), loss.item(), optimizer.param_groups[-1]["lr"]))
    if args.distributed:
        dist.all_reduce(loss_sum)
    return {'loss': (loss_sum[0] / loss_sum[1]).item(), 'lr': optimizer.param_groups[-1]["lr"]}


@torch.no_grad()
def evaluate(data_loader, model, device, num_samples):
    model.eval()
    preds, labels, indices = [], [], []
    for images, target, index in data_loader:
        images = images.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        preds.append(output.argmax(dim=-1).cpu())
        labels.append(target)
        indices.append(index)
    local = (torch.cat(preds), torch.cat(labels), torch.cat(indices))
    if get_world_size() > 1:
        gathered = [None] * get_world_size()
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    # DistributedSampler repeats a few samples to pad the last batch; count every index once
    correct = torch.zeros(num_samples, dtype=torch.bool)
    seen = torch.zeros(num_samples, dtype=torch.bool)
    for p, t, i in gathered:
        correct[i] = p == t
        seen[i] = True
    acc1 = 100.0 * correct.sum().item() / seen.sum().item()
    print('* Acc@1 {:.3f} on {} images'.format(acc1, int(seen.sum())))
    return {'acc1': acc1}


def get_args_parser():
    parser = argparse.ArgumentParser('BEiT fine-tuning for image classification', add_help=False)
    parser.add_argument('--batch_size', default=64, type=int, help='per GPU')
    parser.add_argument('--epochs', default=100, type=int)
    parser.add_argument('--accum_iter', default=2, type=int)
    parser.add_argument('--model', default='beit_base_patch16_224', type=str)
    parser.add_argument('--finetune', default='', help='pre-trained checkpoint')
    parser.add_argument('--drop_path', type=float, default=0.1)
    parser.add_argument('--clip_grad', type=float, default=None)
    parser.add_argument('--weight_decay', type=float, default=0.05)
    parser.add_argument('--lr', type=float, default=None)
    parser.add_argument('--blr', type=float, default=5e-4)
    parser.add_argument('--layer_decay', type=float, default=0.65)
    parser.add_argument('--min_lr', type=float, default=1e-6)
    parser.add_argument('--warmup_epochs', type=int, default=5)
    parser.add_argument('--smoothing', type=float, default=0.1)
    parser.add_argument('--mixup', type=float, default=0.8)
    parser.add_argument('--cutmix', type=float, default=1.0)
    parser.add_argument('--nb_classes', default=1000, type=int)
    parser.add_argument('--data_path', default='/datasets01/imagenet_full_size/061417/', type=str)
    parser.add_argument('--output_dir', default='./output_dir')
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--print_freq', default=50, type=int)
    parser.add_argument('--dist_url', default='env://')
    return parser


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    torch.manual_seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())

    transform_train = create_transform(input_size=224, is_training=True, color_jitter=None, auto_augment='rand-m9-mstd0.5-inc1',
                                       interpolation='bicubic', re_prob=0.25, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    transform_val = transforms.Compose([transforms.Resize(256, interpolation=3), transforms.CenterCrop(224),
                                        transforms.ToTensor(), transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    dataset_train = IndexedImageFolder(os.path.join(args.data_path, 'train'), transform=transform_train)
    dataset_val = IndexedImageFolder(os.path.join(args.data_path, 'val'), transform=transform_val)

    if args.distributed:
        sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True)
        sampler_val = torch.utils.data.DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=args.batch_size,
                                                  num_workers=args.num_workers, pin_memory=True, drop_last=False)
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing, num_classes=args.nb_classes)

    model = create_model(args.model, pretrained=False, num_classes=args.nb_classes, drop_path_rate=args.drop_path,
                         use_rel_pos_bias=True, use_abs_pos_emb=False)
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location='cpu')
        checkpoint_model = checkpoint.get('model', checkpoint)
        checkpoint_model = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in checkpoint_model.items()}
        for k in ['head.weight', 'head.bias']:
            if k in checkpoint_model and checkpoint_model[k].shape != model.state_dict()[k].shape:
                print(f"Removing key {k} from pretrained checkpoint")
                del checkpoint_model[k]
        msg = model.load_state_dict(checkpoint_model, strict=False)
        print(msg)
    model.to(device)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * get_world_size()
    if args.lr is None:
        args.lr = args.blr * eff_batch_size / 256
    print("actual lr: %.2e, effective batch size: %d" % (args.lr, eff_batch_size))

    param_groups = param_groups_lrd(model_without_ddp, args.weight_decay,
                                    no_weight_decay_list=model_without_ddp.no_weight_decay(), layer_decay=args.layer_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy = 0, 0.0
    ckpts = glob.glob(os.path.join(args.output_dir, 'checkpoint-*.pth'))
    if ckpts:
        latest = max(ckpts, key=lambda p: int(p.split('-')[-1].split('.')[0]))
        checkpoint = torch.load(latest, map_location='cpu')
        model_without_ddp.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        scaler.load_state_dict(checkpoint['scaler'])
        start_epoch, max_accuracy = checkpoint['epoch'] + 1, checkpoint.get('max_accuracy', 0.0)
        print("Auto resume from %s" % latest)

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            data_loader_train.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, scaler, device, epoch, mixup_fn, args)
        test_stats = evaluate(data_loader_val, model, device, len(dataset_val))
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        print(f'Max accuracy: {max_accuracy:.2f}%')
        if args.output_dir:
            save_on_master({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'scaler': scaler.state_dict(), 'epoch': epoch, 'max_accuracy': max_accuracy, 'args': args},
                           os.path.join(args.output_dir, 'checkpoint-%d.pth' % epoch))
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
