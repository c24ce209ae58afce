"""SimCLR on ImageNet-100 with a weighted k-NN monitor (InstDisc style) every few epochs.

    torchrun --nproc_per_node=4 16_simclr_knn_monitor.py --root /data/imagenet100 --epochs 400 --batch-size 128

Negatives come from all GPUs (gathered with gradient); the k-NN monitor uses features
from the whole train set as the memory bank.
"""
import argparse
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
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient for the local slice"""

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


def nt_xent(z1, z2, temperature):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    z1_all = torch.cat(GatherLayer.apply(z1))
    z2_all = torch.cat(GatherLayer.apply(z2))
    z = torch.cat([z1_all, z2_all])
    n = z1_all.size(0)
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(-1e9)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    # only rows that belong to this rank contribute to its loss
    b, r = z1.size(0), dist.get_rank()
    rows = torch.cat([torch.arange(r * b, (r + 1) * b), torch.arange(n + r * b, n + (r + 1) * b)]).to(z.device)
    return F.cross_entropy(sim[rows], targets[rows])


class SimCLR(nn.Module):
    def __init__(self, arch='resnet18', proj_dim=128):
        super().__init__()
        enc = getattr(torchvision.models, arch)(weights=None)
        dim = enc.fc.in_features
        enc.fc = nn.Identity()
        self.encoder = enc
        self.proj = nn.Sequential(nn.Linear(dim, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                  nn.Linear(2048, proj_dim))

    def forward(self, x):
        return self.proj(self.encoder(x))


class Pair:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


@torch.no_grad()
def gather_features(encoder, loader, device):
    feats, labels = [], []
    for x, y in loader:
        feats.append(F.normalize(encoder(x.to(device, non_blocking=True)), dim=1))
        labels.append(y.to(device, non_blocking=True))
    feats, labels = torch.cat(feats), torch.cat(labels)
    ws = dist.get_world_size()
    f_list = [torch.zeros_like(feats) for _ in range(ws)]
    l_list = [torch.zeros_like(labels) for _ in range(ws)]
    dist.all_gather(f_list, feats)
    dist.all_gather(l_list, labels)
    return torch.cat(f_list), torch.cat(l_list)


@torch.no_grad()
def knn_monitor(encoder, bank_loader, test_loader, n_cls, device, k=200, t=0.1):
    encoder.eval()
    bank, bank_y = gather_features(encoder, bank_loader, device)
    test, test_y = gather_features(encoder, test_loader, device)
    correct = 0
    for i in range(0, test.size(0), 1024):
        sim = test[i:i + 1024] @ bank.t()
        w, idx = sim.topk(k, dim=1)
        w = (w / t).exp()
        one_hot = F.one_hot(bank_y[idx], n_cls).float()
        pred = (one_hot * w[..., None]).sum(1).argmax(1)
        correct += (pred == test_y[i:i + 1024]).sum().item()
    encoder.train()
    return correct / test.size(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', default='/data/imagenet100')
    ap.add_argument('--arch', default='resnet18')
    ap.add_argument('--epochs', type=int, default=400)
    ap.add_argument('--batch-size', type=int, default=128, help='per GPU')
    ap.add_argument('--lr', type=float, default=0.5, help='for a global batch of 256')
    ap.add_argument('--wd', type=float, default=1e-4)
    ap.add_argument('--temperature', type=float, default=0.2)
    ap.add_argument('--knn-every', type=int, default=10)
    ap.add_argument('--out', default='runs/simclr')
    ap.add_argument('--resume', action='store_true')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    aug = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
                     T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), T.RandomGrayscale(0.2),
                     T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=0.5),
                     T.ToTensor(), T.Normalize(mean, std)])
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    train_set = ImageFolder(os.path.join(args.root, 'train'), transform=Pair(aug))
    bank_set = ImageFolder(os.path.join(args.root, 'train'), transform=plain)
    test_set = ImageFolder(os.path.join(args.root, 'val'), transform=plain)
    n_cls = len(train_set.classes)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # DistributedSampler would pad with repeated images, which biases the k-NN bank -> strided split
    bank_loader = DataLoader(Subset(bank_set, range(rank, len(bank_set), world)), batch_size=256, num_workers=8)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=256, num_workers=8)

    model = SimCLR(args.arch).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    warmup = 10

    start = 0
    ckpt_file = os.path.join(args.out, 'last.pth')
    if args.resume and os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck['model'])
        opt.load_state_dict(ck['opt'])
        start = ck['epoch'] + 1

    writer = SummaryWriter(os.path.join(args.out, 'tb')) if rank == 0 else None
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for i, ((x1, x2), _) in enumerate(train_loader):
            e = epoch + i / len(train_loader)
            cur = lr * e / warmup if e < warmup else lr * 0.5 * (1 + math.cos(math.pi * (e - warmup) / (args.epochs - warmup)))
            for g in opt.param_groups:
                g['lr'] = cur
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            z1, z2 = model(torch.cat([x1, x2])).chunk(2)
            loss = nt_xent(z1, z2, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f'epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} lr {cur:.4f} {time.time() - t0:.0f}s', flush=True)
            writer.add_scalar('train/loss', (tot[0] / tot[1]).item(), epoch)

        if (epoch + 1) % args.knn_every == 0:
            acc = knn_monitor(model.module.encoder, bank_loader, test_loader, n_cls, device)
            if rank == 0:
                print(f'  kNN top-1 {acc * 100:.2f}')
                writer.add_scalar('eval/knn_top1', acc, epoch)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({'model': model.module.state_dict(), 'opt': opt.state_dict(), 'epoch': epoch}, ckpt_file)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
