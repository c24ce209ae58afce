"""BYOL pre-training on STL-10 (unlabeled + train) with DDP.

    torchrun --nproc_per_node=4 01_byol_pretrain.py --data /datasets/stl10 --epochs 200

Online network = encoder + projector + predictor, target = EMA of encoder + projector.
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--data', default='/datasets/stl10')
    p.add_argument('--arch', default='resnet18')
    p.add_argument('--epochs', type=int, default=200)
    p.add_argument('--warmup-epochs', type=int, default=10)
    p.add_argument('--batch-size', type=int, default=128, help='per GPU')
    p.add_argument('--base-lr', type=float, default=0.3, help='lr for a global batch of 256')
    p.add_argument('--wd', type=float, default=1.5e-6)
    p.add_argument('--tau', type=float, default=0.996)
    p.add_argument('--workers', type=int, default=8)
    p.add_argument('--out', default='./runs/byol_stl10')
    p.add_argument('--resume', default='')
    p.add_argument('--save-every', type=int, default=10)
    p.add_argument('--print-freq', type=int, default=50)
    return p.parse_args()


class TwoCrops:
    def __init__(self, t1, t2):
        self.t1, self.t2 = t1, t2

    def __call__(self, x):
        return self.t1(x), self.t2(x)


def byol_transforms(size=96):
    normalize = T.Normalize((0.43, 0.42, 0.39), (0.27, 0.26, 0.27))
    base = [
        T.RandomResizedCrop(size, scale=(0.08, 1.0)),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        T.RandomGrayscale(0.2),
    ]
    t1 = T.Compose(base + [T.GaussianBlur(9, (0.1, 2.0)), T.ToTensor(), normalize])
    t2 = T.Compose(base + [T.RandomApply([T.GaussianBlur(9, (0.1, 2.0))], p=0.1),
                           T.RandomSolarize(0.5, p=0.2), T.ToTensor(), normalize])
    return TwoCrops(t1, t2)


class MLP(nn.Module):
    def __init__(self, dim_in, hidden=4096, dim_out=256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, dim_out))

    def forward(self, x):
        return self.net(x)


class BYOLNet(nn.Module):
    def __init__(self, arch='resnet18'):
        super().__init__()
        backbone = getattr(torchvision.models, arch)(weights=None)
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        # STL-10 is 96x96, keep more resolution in the stem
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        self.backbone = backbone
        self.projector = MLP(feat_dim)
        self.predictor = MLP(256)

    def project(self, x):
        return self.projector(self.backbone(x))

    def forward(self, x):
        return self.predictor(self.project(x))


def regression_loss(p, z):
    p = F.normalize(p, dim=-1)
    z = F.normalize(z, dim=-1)
    return 2 - 2 * (p * z).sum(dim=-1)


@torch.no_grad()
def update_target(online, target, tau):
    for po, pt in zip(online.parameters(), target.parameters()):
        pt.mul_(tau).add_(po.detach(), alpha=1 - tau)
    for bo, bt in zip(online.buffers(), target.buffers()):
        bt.copy_(bo)


def adjust_lr(optimizer, lr, epoch_f, args):
    if epoch_f < args.warmup_epochs:
        cur = lr * epoch_f / args.warmup_epochs
    else:
        cur = lr * 0.5 * (1. + math.cos(math.pi * (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g['lr'] = cur
    return cur


def main():
    args = get_args()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    torch.backends.cudnn.benchmark = True

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, 'tb'))
        print(vars(args))

    dataset = torchvision.datasets.STL10(args.data, split='train+unlabeled', transform=byol_transforms(), download=False)
    train_sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    model = BYOLNet(args.arch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    # target is built from the already broadcast online weights -> same on all ranks
    target = copy.deepcopy(model.module)
    del target.predictor
    for p in target.parameters():
        p.requires_grad = False

    lr = args.base_lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt['online'])
        target.load_state_dict(ckpt['target'])
        optimizer.load_state_dict(ckpt['optimizer'])
        start_epoch = ckpt['epoch'] + 1
        if rank == 0:
            print(f'=> resumed from {args.resume} (epoch {ckpt["epoch"]})')

    iters_per_epoch = len(loader)
    total_steps = args.epochs * iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        target.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for it, ((x1, x2), _) in enumerate(loader):
            step = epoch * iters_per_epoch + it
            cur_lr = adjust_lr(optimizer, lr, epoch + it / iters_per_epoch, args)
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)

            p1, p2 = model(torch.cat([x1, x2])).chunk(2)
            with torch.no_grad():
                z1, z2 = target.project(torch.cat([x1, x2])).chunk(2)
            loss = (regression_loss(p1, z2) + regression_loss(p2, z1)).mean()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            # cosine increase of the momentum, as in the paper
            tau = 1 - (1 - args.tau) * (math.cos(math.pi * step / total_steps) + 1) / 2
            update_target(model.module, target, tau)

            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
            if rank == 0 and it % args.print_freq == 0:
                print(f'ep {epoch} [{it}/{iters_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.4f} tau {tau:.5f}')
                writer.add_scalar('train/loss_step', loss.item(), step)
                writer.add_scalar('train/lr', cur_lr, step)

        dist.all_reduce(loss_meter)
        epoch_loss = (loss_meter[0] / loss_meter[1]).item()
        if rank == 0:
            print(f'epoch {epoch} done, loss {epoch_loss:.4f}, {time.time() - t0:.0f}s')
            writer.add_scalar('train/loss_epoch', epoch_loss, epoch)
            state = {
                'epoch': epoch,
                'online': model.module.state_dict(),
                'target': target.state_dict(),
                'optimizer': optimizer.state_dict(),
                'args': vars(args),
            }
            torch.save(state, os.path.join(args.out, 'last.pth'))
            if (epoch + 1) % args.save_every == 0:
                torch.save({'backbone': target.backbone.state_dict()},
                           os.path.join(args.out, f'backbone_ep{epoch + 1:04d}.pth'))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
