#!/usr/bin/env python
# MoCo v2 with shuffling BN, one process per GPU started with mp.spawn.
#
#   python 02_moco_v2_spawn_shufflebn.py --dist-url tcp://localhost:10001 \
#       --world-size 1 --rank 0 --mlp --aug-plus --cos /datasets/imagenet
import argparse
import builtins
import math
import os
import random
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from PIL import ImageFilter

parser = argparse.ArgumentParser(description="MoCo ImageNet pre-training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-j", "--workers", default=32, type=int, help="total loader workers per node")
parser.add_argument("--epochs", default=200, type=int)
parser.add_argument("--start-epoch", default=0, type=int)
parser.add_argument("-b", "--batch-size", default=256, type=int,
                    help="total batch size of all GPUs on all nodes")
parser.add_argument("--lr", default=0.03, type=float)
parser.add_argument("--schedule", default=[120, 160], nargs="*", type=int)
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("-p", "--print-freq", default=10, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://localhost:10001", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--save-dir", default=".", type=str)
parser.add_argument("--moco-dim", default=128, type=int)
parser.add_argument("--moco-k", default=65536, type=int)
parser.add_argument("--moco-m", default=0.999, type=float)
parser.add_argument("--moco-t", default=0.07, type=float)
parser.add_argument("--mlp", action="store_true")
parser.add_argument("--aug-plus", action="store_true")
parser.add_argument("--cos", action="store_true")


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.07, mlp=False):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        if mlp:
            dim_mlp = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", nn.functional.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0
        self.queue[:, ptr:ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.K

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        batch_size_this = x.shape[0]
        x_gather = concat_all_gather(x)
        batch_size_all = x_gather.shape[0]
        num_gpus = batch_size_all // batch_size_this
        # same permutation on every GPU
        idx_shuffle = torch.randperm(batch_size_all).cuda()
        dist.broadcast(idx_shuffle, src=0)
        idx_unshuffle = torch.argsort(idx_shuffle)
        gpu_idx = dist.get_rank()
        idx_this = idx_shuffle.view(num_gpus, -1)[gpu_idx]
        return x_gather[idx_this], idx_unshuffle

    @torch.no_grad()
    def _batch_unshuffle_ddp(self, x, idx_unshuffle):
        batch_size_this = x.shape[0]
        x_gather = concat_all_gather(x)
        batch_size_all = x_gather.shape[0]
        num_gpus = batch_size_all // batch_size_this
        gpu_idx = dist.get_rank()
        idx_this = idx_unshuffle.view(num_gpus, -1)[gpu_idx]
        return x_gather[idx_this]

    def forward(self, im_q, im_k):
        q = nn.functional.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)
            k = nn.functional.normalize(self.encoder_k(im_k), dim=1)
            k = self._batch_unshuffle_ddp(k, idx_unshuffle)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long).cuda()
        self._dequeue_and_enqueue(k)
        return logits, labels


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


class GaussianBlur(object):
    def __init__(self, sigma=[0.1, 2.0]):
        self.sigma = sigma

    def __call__(self, x):
        sigma = random.uniform(self.sigma[0], self.sigma[1])
        return x.filter(ImageFilter.GaussianBlur(radius=sigma))


class TwoCropsTransform:
    def __init__(self, base_transform):
        self.base_transform = base_transform

    def __call__(self, x):
        return [self.base_transform(x), self.base_transform(x)]


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True
    ngpus_per_node = torch.cuda.device_count()
    # one process per GPU on every node
    args.world_size = ngpus_per_node * args.world_size
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if gpu != 0:
        def print_pass(*a, **k):
            pass
        builtins.print = print_pass

    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)

    print(f"=> creating model '{args.arch}'")
    model = MoCo(models.__dict__[args.arch], args.moco_dim, args.moco_k, args.moco_m, args.moco_t, args.mlp)
    model.cuda(args.gpu)
    # per-process batch size and workers
    args.batch_size = int(args.batch_size / ngpus_per_node / (args.world_size // ngpus_per_node))
    args.workers = int((args.workers + ngpus_per_node - 1) / ngpus_per_node)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    criterion = nn.CrossEntropyLoss().cuda(args.gpu)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.wd)

    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=f"cuda:{args.gpu}")
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")

    cudnn.benchmark = True

    traindir = os.path.join(args.data, "train")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    if args.aug_plus:
        augmentation = [
            transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
            transforms.RandomApply([GaussianBlur([0.1, 2.0])], p=0.5),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    else:
        augmentation = [
            transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
            transforms.RandomGrayscale(p=0.2),
            transforms.ColorJitter(0.4, 0.4, 0.4, 0.4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    train_dataset = datasets.ImageFolder(traindir, TwoCropsTransform(transforms.Compose(augmentation)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=train_sampler, drop_last=True)

    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        adjust_learning_rate(optimizer, epoch, args)
        train(train_loader, model, criterion, optimizer, epoch, args)

        if args.rank == 0:
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.state_dict(),
                "optimizer": optimizer.state_dict(),
            }, is_milestone=(epoch + 1) % 20 == 0, save_dir=args.save_dir, epoch=epoch)

    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args):
    losses, top1 = AverageMeter(), AverageMeter()
    model.train()
    end = time.time()
    for i, (images, _) in enumerate(train_loader):
        images[0] = images[0].cuda(args.gpu, non_blocking=True)
        images[1] = images[1].cuda(args.gpu, non_blocking=True)
        output, target = model(im_q=images[0], im_k=images[1])
        loss = criterion(output, target)

        acc1 = (output.argmax(1) == target).float().mean() * 100.0
        losses.update(loss.item(), images[0].size(0))
        top1.update(acc1.item(), images[0].size(0))

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{len(train_loader)}] time {time.time() - end:.3f} "
                  f"loss {losses.val:.4f} ({losses.avg:.4f}) acc@1 {top1.val:.2f} ({top1.avg:.2f})")
        end = time.time()


def save_checkpoint(state, is_milestone, save_dir, epoch):
    os.makedirs(save_dir, exist_ok=True)
    filename = os.path.join(save_dir, "checkpoint.pth.tar")
    torch.save(state, filename)
    if is_milestone:
        shutil.copyfile(filename, os.path.join(save_dir, f"checkpoint_{epoch + 1:04d}.pth.tar"))


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def adjust_learning_rate(optimizer, epoch, args):
    lr = args.lr
    if args.cos:
        lr *= 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
    else:
        for milestone in args.schedule:
            lr *= 0.1 if epoch >= milestone else 1.0
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


if __name__ == "__main__":
    main()
