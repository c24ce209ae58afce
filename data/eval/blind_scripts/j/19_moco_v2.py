#!/usr/bin/env python
# MoCo v2 pretraining (shuffle-BN, momentum key encoder, 65536 queue)
# single node, 8 GPUs:
#   python 19_moco_v2.py -a resnet50 --lr 0.03 --batch-size 256 --dist-url tcp://localhost:10001 \
#       --world-size 1 --rank 0 --mlp --aug-plus --cos /data/imagenet
import os
import math
import time
import random
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.backends.cudnn as cudnn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from PIL import ImageFilter

parser = argparse.ArgumentParser(description='MoCo v2 ImageNet pre-training')
parser.add_argument('data', metavar='DIR')
parser.add_argument('-a', '--arch', default='resnet50')
parser.add_argument('-j', '--workers', default=32, type=int)
parser.add_argument('--epochs', default=200, type=int)
parser.add_argument('-b', '--batch-size', default=256, type=int, help='total over all GPUs of all nodes')
parser.add_argument('--lr', default=0.03, type=float)
parser.add_argument('--momentum', default=0.9, type=float)
parser.add_argument('--wd', default=1e-4, type=float)
parser.add_argument('--resume', default='', type=str)
parser.add_argument('--world-size', default=1, type=int, help='number of nodes')
parser.add_argument('--rank', default=0, type=int, help='node rank')
parser.add_argument('--dist-url', default='tcp://localhost:10001', type=str)
parser.add_argument('--seed', default=None, type=int)
parser.add_argument('--moco-dim', default=128, type=int)
parser.add_argument('--moco-k', default=65536, type=int)
parser.add_argument('--moco-m', default=0.999, type=float)
parser.add_argument('--moco-t', default=0.2, type=float)
parser.add_argument('--mlp', action='store_true')
parser.add_argument('--aug-plus', action='store_true')
parser.add_argument('--cos', action='store_true')


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.07, mlp=False):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        if mlp:
            d = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(d, d), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(d, d), nn.ReLU(), self.encoder_k.fc)
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer('queue', nn.functional.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer('queue_ptr', torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data = pk.data * self.m + pq.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        bs = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % bs == 0
        self.queue[:, ptr:ptr + bs] = keys.T
        self.queue_ptr[0] = (ptr + bs) % self.K

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        bs_this = x.shape[0]
        x_gather = concat_all_gather(x)
        num_gpus = x_gather.shape[0] // bs_this
        idx_shuffle = torch.randperm(x_gather.shape[0]).cuda()
        dist.broadcast(idx_shuffle, src=0)
        idx_unshuffle = torch.argsort(idx_shuffle)
        idx_this = idx_shuffle.view(num_gpus, -1)[dist.get_rank()]
        return x_gather[idx_this], idx_unshuffle

    @torch.no_grad()
    def _batch_unshuffle_ddp(self, x, idx_unshuffle):
        bs_this = x.shape[0]
        x_gather = concat_all_gather(x)
        num_gpus = x_gather.shape[0] // bs_this
        return x_gather[idx_unshuffle.view(num_gpus, -1)[dist.get_rank()]]

    def forward(self, im_q, im_k):
        q = nn.functional.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)
            k = nn.functional.normalize(self.encoder_k(im_k), dim=1)
            k = self._batch_unshuffle_ddp(k, idx_unshuffle)
        l_pos = torch.einsum('nc,nc->n', [q, k]).unsqueeze(-1)
        l_neg = torch.einsum('nc,ck->nk', [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        self._dequeue_and_enqueue(k)
        return logits, labels


class TwoCropsTransform:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return [self.t(x), self.t(x)]


class GaussianBlur:
    def __init__(self, sigma=(.1, 2.)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.world_size
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    if args.rank % ngpus_per_node != 0:
        def print_pass(*a, **k):
            pass
        import builtins
        builtins.print = print_pass

    model = MoCo(models.__dict__[args.arch], args.moco_dim, args.moco_k, args.moco_m, args.moco_t, args.mlp)
    model.cuda(args.gpu)
    args.batch_size = int(args.batch_size / ngpus_per_node)
    args.workers = int((args.workers + ngpus_per_node - 1) / ngpus_per_node)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    criterion = nn.CrossEntropyLoss().cuda(args.gpu)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.wd)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location='cuda:{}'.format(args.gpu))
        start_epoch = checkpoint['epoch']
        model.load_state_dict(checkpoint['state_dict'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        print("=> loaded checkpoint '{}' (epoch {})".format(args.resume, start_epoch))
    cudnn.benchmark = True

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    aug = [transforms.RandomResizedCrop(224, scale=(0.2, 1.)),
           transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
           transforms.RandomGrayscale(p=0.2)]
    if args.aug_plus:
        aug.append(transforms.RandomApply([GaussianBlur([.1, 2.])], p=0.5))
    aug += [transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    train_dataset = datasets.ImageFolder(os.path.join(args.data, 'train'), TwoCropsTransform(transforms.Compose(aug)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                                               num_workers=args.workers, pin_memory=True, sampler=train_sampler,
                                               drop_last=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        lr = args.lr * (0.5 * (1. + math.cos(math.pi * epoch / args.epochs)) if args.cos else
                        0.1 ** sum(epoch >= m for m in (120, 160)))
        for g in optimizer.param_groups:
            g['lr'] = lr
        model.train()
        end = time.time()
        for i, (images, _) in enumerate(train_loader):
            images[0] = images[0].cuda(args.gpu, non_blocking=True)
            images[1] = images[1].cuda(args.gpu, non_blocking=True)
            output, target = model(im_q=images[0], im_k=images[1])
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % 100 == 0:
                acc1 = (output.argmax(1) == target).float().mean() * 100
                stats = torch.stack([loss.detach(), acc1.detach()])
                dist.all_reduce(stats)
                stats /= args.world_size
                print('Epoch [%d][%d/%d] loss %.4f acc@1 %.2f lr %.4f time %.3f' % (
                    epoch, i, len(train_loader), stats[0].item(), stats[1].item(), lr, time.time() - end))
            end = time.time()

        if args.rank == 0:
            torch.save({'epoch': epoch + 1, 'arch': args.arch, 'state_dict': model.state_dict(),
                        'optimizer': optimizer.state_dict()}, 'checkpoint_{:04d}.pth.tar'.format(epoch))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
