"""
End-to-end fine-tuning of CLIP ViT-B/16 on ImageNet with a zero-shot initialised head, followed by
WiSE-FT weight-space ensembling of the zero-shot and fine-tuned weights.
"""
import argparse
import copy
import json
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets

from imagenet_classnames import CLASSNAMES, TEMPLATES


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
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        args.rank, args.world_size, args.gpu, args.distributed = 0, 1, 0, False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method='env://', world_size=args.world_size, rank=args.rank)
    dist.barrier()


class StridedSampler(Sampler):
    def __init__(self, n):
        self.idx = list(range(get_rank(), n, get_world_size()))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class ImageClassifier(nn.Module):
    def __init__(self, clip_model, weights):
        super().__init__()
        self.image_encoder = clip_model.visual
        self.logit_scale = clip_model.logit_scale.exp().item()
        self.head = nn.Linear(weights.shape[1], weights.shape[0], bias=True)
        self.head.weight.data.copy_(weights * self.logit_scale)
        self.head.bias.data.zero_()

    def forward(self, images):
        features = F.normalize(self.image_encoder(images), dim=-1)
        return self.head(features)


@torch.no_grad()
def zeroshot_weights(clip_model, tokenizer, device):
    clip_model.eval()
    weights = []
    for classname in CLASSNAMES:
        texts = tokenizer([t(classname) for t in TEMPLATES]).to(device)
        emb = F.normalize(clip_model.encode_text(texts), dim=-1).mean(dim=0)
        weights.append(F.normalize(emb, dim=0))
    return torch.stack(weights, dim=0)


def cosine_lr(optimizer, base_lr, warmup, total_steps):
    def _lr_adjuster(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup))) * base_lr
        for g in optimizer.param_groups:
            g['lr'] = lr
        return lr
    return _lr_adjuster


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast('cuda', dtype=torch.float16):
            logits = model(images)
        correct += torch.tensor([(logits.argmax(1) == labels).sum().item(), labels.numel()], device=device)
    if get_world_size() > 1:
        dist.all_reduce(correct)
    return 100.0 * (correct[0] / correct[1]).item()


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda', args.gpu)
    torch.manual_seed(args.seed + args.rank)

    clip_model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    clip_model.to(device)
    model = ImageClassifier(clip_model, zeroshot_weights(clip_model, tokenizer, device)).to(device)
    del clip_model.transformer
    zeroshot_state = copy.deepcopy({k: v.cpu() for k, v in model.state_dict().items()})

    train_set = datasets.ImageFolder(os.path.join(args.data_location, 'train'), transform=preprocess_train)
    val_set = datasets.ImageFolder(os.path.join(args.data_location, 'val'), transform=preprocess_val)
    train_sampler = DistributedSampler(train_set, shuffle=True) if args.distributed else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, shuffle=train_sampler is None,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=StridedSampler(len(val_set)), num_workers=args.workers)

    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)
    total_steps = args.epochs * len(train_loader)
    scheduler = cosine_lr(optimizer, args.lr, args.warmup_length, total_steps)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.ls)

    start_epoch = 0
    ckpt_path = os.path.join(args.save, 'checkpoint_latest.pt')
    if os.path.isfile(ckpt_path):
        checkpoint = torch.load(ckpt_path, map_location='cpu')
        model_without_ddp.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        scaler.load_state_dict(checkpoint['scaler'])
        start_epoch = checkpoint['epoch'] + 1
        print(f'=> resumed from {ckpt_path} (epoch {checkpoint["epoch"]})')

    for epoch in range(start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, labels) in enumerate(train_loader):
            step = i + epoch * len(train_loader)
            scheduler(step)
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast('cuda', dtype=torch.float16):
                loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()
            if i % 100 == 0 and is_main_process():
                print(f"Train Epoch: {epoch} [{i}/{len(train_loader)}]\tLoss: {loss.item():.6f}\t"
                      f"lr {optimizer.param_groups[0]['lr']:.2e}\t{time.time() - t0:.1f}s", flush=True)

        top1 = evaluate(model_without_ddp, val_loader, device)
        if is_main_process():
            print(f'epoch {epoch}: ImageNet top-1 {top1:.2f}')
            with open(os.path.join(args.save, 'results.jsonl'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, 'top1': top1}) + '\n')
        save_on_master({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scaler': scaler.state_dict(), 'epoch': epoch}, ckpt_path)

    # WiSE-FT: interpolate zero-shot and fine-tuned weights
    finetuned_state = {k: v.cpu() for k, v in model_without_ddp.state_dict().items()}
    for alpha in args.alpha:
        theta = {k: (1 - alpha) * zeroshot_state[k] + alpha * finetuned_state[k] for k in zeroshot_state}
        model_without_ddp.load_state_dict(theta)
        top1 = evaluate(model_without_ddp, val_loader, device)
        if is_main_process():
            print(f'WiSE-FT alpha={alpha:.1f}: top-1 {top1:.2f}')
            torch.save(theta, os.path.join(args.save, f'wise_ft_alpha{alpha:.1f}.pt'))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--data-location', default='/data/imagenet')
    parser.add_argument('--model', default='ViT-B-16')
    parser.add_argument('--pretrained', default='openai')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--lr', type=float, default=3e-5)
    parser.add_argument('--wd', type=float, default=0.1)
    parser.add_argument('--ls', type=float, default=0.0)
    parser.add_argument('--warmup-length', type=int, default=500)
    parser.add_argument('--alpha', type=float, nargs='+', default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument('--workers', type=int, default=8)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--save', default='./checkpoints/ViT-B-16_imagenet')
    args = parser.parse_args()
    os.makedirs(args.save, exist_ok=True)
    main(args)
