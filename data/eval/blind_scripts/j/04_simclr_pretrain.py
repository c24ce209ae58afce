"""SimCLR pretraining on ImageNet-100 with cross-GPU negatives + kNN monitor.

torchrun --nnodes=1 --nproc_per_node=8 04_simclr_pretrain.py --data /data/imagenet100 --batch-size 128
"""
import os
import math
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument('--data', default='/data/imagenet100')
p.add_argument('--arch', default='resnet50')
p.add_argument('--batch-size', type=int, default=128, help='per GPU')
p.add_argument('--epochs', type=int, default=200)
p.add_argument('--base-lr', type=float, default=0.3)
p.add_argument('--wd', type=float, default=1e-6)
p.add_argument('--temperature', type=float, default=0.2)
p.add_argument('--warmup-epochs', type=int, default=10)
p.add_argument('--knn-k', type=int, default=200)
p.add_argument('--knn-every', type=int, default=10)
p.add_argument('--workers', type=int, default=10)
p.add_argument('--resume', default='')
p.add_argument('--out', default='./simclr_out')
args = p.parse_args()


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient for the local slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


class TwoCrops:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


class SimCLR(nn.Module):
    def __init__(self, arch, dim=128):
        super().__init__()
        self.backbone = torchvision.models.__dict__[arch](weights=None)
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(feat, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                       nn.Linear(2048, dim))

    def forward(self, x1, x2):
        z = self.projector(self.backbone(torch.cat([x1, x2])))
        return F.normalize(z, dim=1)


def nt_xent(z, temperature):
    # z: [2B, d] local. negatives come from all GPUs
    z1, z2 = z.chunk(2)
    B = z1.size(0)
    all_z1 = torch.cat(GatherLayer.apply(z1))
    all_z2 = torch.cat(GatherLayer.apply(z2))
    rank = dist.get_rank()
    labels = torch.arange(B, device=z.device) + rank * B
    keys = torch.cat([all_z1, all_z2])
    big = all_z1.size(0)
    mask = F.one_hot(labels, 2 * big).bool()
    logits1 = (z1 @ keys.t() / temperature).masked_fill(mask, -1e9)
    mask2 = F.one_hot(labels + big, 2 * big).bool()
    logits2 = (z2 @ keys.t() / temperature).masked_fill(mask2, -1e9)
    return 0.5 * (F.cross_entropy(logits1, labels + big) + F.cross_entropy(logits2, labels))


def adjust_lr(opt, epoch, it, iters, lr):
    t = epoch + it / iters
    if t < args.warmup_epochs:
        cur = lr * t / args.warmup_epochs
    else:
        cur = lr * 0.5 * (1. + math.cos(math.pi * (t - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in opt.param_groups:
        g['lr'] = cur
    return cur


@torch.no_grad()
def gather_variable(x):
    """all_gather for tensors whose first dim differs between ranks: pad, gather, trim."""
    n = torch.tensor([x.size(0)], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    pad = torch.zeros((max(sizes) - x.size(0),) + x.shape[1:], dtype=x.dtype, device=x.device)
    xp = torch.cat([x, pad])
    out = [torch.zeros_like(xp) for _ in sizes]
    dist.all_gather(out, xp)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def knn_monitor(backbone, bank_loader, test_loader, k, t=0.1):
    backbone.eval()
    feats, labels = [], []
    for x, y in bank_loader:
        feats.append(F.normalize(backbone(x.cuda(non_blocking=True)), dim=1))
        labels.append(y.cuda(non_blocking=True))
    bank = gather_variable(torch.cat(feats))
    bank_y = gather_variable(torch.cat(labels))
    correct = torch.zeros(2, device='cuda')
    ncls = int(bank_y.max().item()) + 1
    for x, y in test_loader:
        f = F.normalize(backbone(x.cuda(non_blocking=True)), dim=1)
        y = y.cuda(non_blocking=True)
        sim, idx = (f @ bank.t()).topk(k, dim=1)
        w = (sim / t).exp()
        votes = torch.zeros(f.size(0), ncls, device='cuda').scatter_add_(1, bank_y[idx], w)
        correct[0] += (votes.argmax(1) == y).sum()
        correct[1] += y.numel()
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item() * 100


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl', device_id=torch.device('cuda', local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    aug = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1.)),
                     T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), T.RandomGrayscale(0.2),
                     T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=0.5), T.RandomHorizontalFlip(),
                     T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                       T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, 'train'), TwoCrops(aug))
    bank_set = torchvision.datasets.ImageFolder(os.path.join(args.data, 'train'), plain)
    test_set = torchvision.datasets.ImageFolder(os.path.join(args.data, 'val'), plain)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    # kNN bank/test: shard without duplicates (contiguous, uneven sizes handled by gather_variable)
    bank_idx = torch.arange(len(bank_set)).tensor_split(world)[rank].tolist()
    test_idx = torch.arange(len(test_set)).tensor_split(world)[rank].tolist()
    bank_loader = DataLoader(torch.utils.data.Subset(bank_set, bank_idx), 256, num_workers=4)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_idx), 256, num_workers=4)

    model = SimCLR(args.arch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location='cpu')
        model.module.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        start_epoch = ckpt['epoch'] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stat = torch.zeros(2, device='cuda')
        t0 = time.time()
        for it, ((x1, x2), _) in enumerate(loader):
            cur_lr = adjust_lr(optimizer, epoch, it, len(loader), lr)
            x1, x2 = x1.cuda(non_blocking=True), x2.cuda(non_blocking=True)
            with torch.autocast('cuda', dtype=torch.float16):
                z = model(x1, x2)
            loss = nt_xent(z.float(), args.temperature)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            stat += torch.stack([loss.detach(), torch.ones((), device='cuda')])
        dist.all_reduce(stat)
        msg = 'ep %d loss %.4f lr %.4f time %.0fs' % (epoch, stat[0] / stat[1], cur_lr, time.time() - t0)

        if (epoch + 1) % args.knn_every == 0:
            acc = knn_monitor(model.module.backbone, bank_loader, test_loader, args.knn_k)
            msg += ' knn@%d %.2f' % (args.knn_k, acc)
        if rank == 0:
            print(msg, flush=True)
            torch.save({'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scaler': scaler.state_dict(), 'epoch': epoch}, os.path.join(args.out, 'last.pth'))

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
