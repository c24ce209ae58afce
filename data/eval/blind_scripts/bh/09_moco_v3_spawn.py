#!/usr/bin/env python
# MoCo v3 pre-training, ResNet-50 backbone, symmetric contrastive loss, LARS + momentum schedule.
#
# Single node, 8 GPUs:
#   python 09_moco_v3_spawn.py --dist-url tcp://localhost:10001 --world-size 1 --rank 0 /data/imagenet
# Two nodes: same command with --world-size 2 and --rank 0 / --rank 1 and the first node's address.
import argparse
import builtins
import math
import os
import random
import time
from functools import partial

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as datasets
import torchvision.models as torchvision_models
import torchvision.transforms as transforms
from PIL import ImageFilter, ImageOps

parser = argparse.ArgumentParser(description="MoCo v3 ImageNet Pre-Training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-j", "--workers", default=32, type=int)
parser.add_argument("--epochs", default=100, type=int)
parser.add_argument("--start-epoch", default=0, type=int)
parser.add_argument("-b", "--batch-size", default=4096, type=int, help="total batch size of all GPUs on all nodes")
parser.add_argument("--lr", default=0.6, type=float, help="base lr (lr = base_lr * batch_size / 256)")
parser.add_argument("--wd", "--weight-decay", default=1e-6, type=float, dest="weight_decay")
parser.add_argument("-p", "--print-freq", default=10, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://localhost:10001", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--moco-dim", default=256, type=int)
parser.add_argument("--moco-mlp-dim", default=4096, type=int)
parser.add_argument("--moco-m", default=0.99, type=float)
parser.add_argument("--moco-t", default=1.0, type=float)
parser.add_argument("--warmup-epochs", default=10, type=int)
parser.add_argument("--output-dir", default="./moco_v3_r50")


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


class MoCoResNet(nn.Module):
    def __init__(self, base_encoder, dim=256, mlp_dim=4096, T=1.0):
        super().__init__()
        self.T = T
        self.base_encoder = base_encoder(num_classes=mlp_dim)
        self.momentum_encoder = base_encoder(num_classes=mlp_dim)
        hidden_dim = self.base_encoder.fc.weight.shape[1]
        del self.base_encoder.fc, self.momentum_encoder.fc
        self.base_encoder.fc = self._build_mlp(2, hidden_dim, mlp_dim, dim)
        self.momentum_encoder.fc = self._build_mlp(2, hidden_dim, mlp_dim, dim)
        self.predictor = self._build_mlp(2, dim, mlp_dim, dim, last_bn=False)
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    @staticmethod
    def _build_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True):
        mlp = []
        for l in range(num_layers):
            dim1 = input_dim if l == 0 else mlp_dim
            dim2 = output_dim if l == num_layers - 1 else mlp_dim
            mlp.append(nn.Linear(dim1, dim2, bias=False))
            if l < num_layers - 1:
                mlp.append(nn.BatchNorm1d(dim2))
                mlp.append(nn.ReLU(inplace=True))
            elif last_bn:
                mlp.append(nn.BatchNorm1d(dim2, affine=False))
        return nn.Sequential(*mlp)

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1.0 - m)

    def contrastive_loss(self, q, k):
        q = F.normalize(q, dim=1)
        k = F.normalize(k, dim=1)
        k = concat_all_gather(k)
        logits = torch.einsum("nc,mc->nm", [q, k]) / self.T
        N = logits.shape[0]
        labels = (torch.arange(N, dtype=torch.long) + N * dist.get_rank()).cuda()
        return nn.CrossEntropyLoss()(logits, labels) * (2 * self.T)

    def forward(self, x1, x2, m):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:  # if not normalization gamma/beta or bias
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, (g["trust_coefficient"] * param_norm / update_norm), one),
                                    one)
                    dp = dp.mul(q)
                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class Solarize:
    def __call__(self, x):
        return ImageOps.solarize(x)


class TwoCropsTransform:
    def __init__(self, t1, t2):
        self.t1, self.t2 = t1, t2

    def __call__(self, x):
        return [self.t1(x), self.t2(x)]


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if gpu != 0:
        builtins.print = lambda *a, **k: None

    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    print(f"=> creating model '{args.arch}', world size {args.world_size}")

    model = MoCoResNet(partial(torchvision_models.__dict__[args.arch], zero_init_residual=True),
                       args.moco_dim, args.moco_mlp_dim, args.moco_t)
    args.lr = args.lr * args.batch_size / 256
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda(args.gpu)
    args.batch_size = int(args.batch_size / args.world_size)
    args.workers = int((args.workers + ngpus_per_node - 1) / ngpus_per_node)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    optimizer = LARS(model.parameters(), args.lr, weight_decay=args.weight_decay, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()

    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=f"cuda:{args.gpu}")
        args.start_epoch = checkpoint["epoch"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
        del checkpoint

    cudnn.benchmark = True
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    base = [transforms.RandomResizedCrop(224, scale=(0.08, 1.)),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2)]
    aug1 = base + [transforms.RandomApply([GaussianBlur()], p=1.0), transforms.RandomHorizontalFlip(),
                   transforms.ToTensor(), normalize]
    aug2 = base + [transforms.RandomApply([GaussianBlur()], p=0.1), transforms.RandomApply([Solarize()], p=0.2),
                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"),
                                         TwoCropsTransform(transforms.Compose(aug1), transforms.Compose(aug2)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=train_sampler, drop_last=True)

    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, optimizer, scaler, epoch, args)
        if args.rank == 0:
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.output_dir, "checkpoint_%04d.pth.tar" % epoch))

    dist.destroy_process_group()


def train(train_loader, model, optimizer, scaler, epoch, args):
    model.train()
    iters_per_epoch = len(train_loader)
    moco_m = args.moco_m
    end = time.time()
    for i, (images, _) in enumerate(train_loader):
        lr = adjust_learning_rate(optimizer, epoch + i / iters_per_epoch, args)
        moco_m = adjust_moco_momentum(epoch + i / iters_per_epoch, args)
        images[0] = images[0].cuda(args.gpu, non_blocking=True)
        images[1] = images[1].cuda(args.gpu, non_blocking=True)

        with torch.cuda.amp.autocast(True):
            loss = model(images[0], images[1], moco_m)

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        if i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{iters_per_epoch}] loss {loss.item():.4f} lr {lr:.4f} "
                  f"m {moco_m:.4f} time {time.time() - end:.3f}")
        end = time.time()


def adjust_learning_rate(optimizer, epoch, args):
    """Linear warm-up then half-cycle cosine, evaluated per iteration."""
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.lr * 0.5 * (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def adjust_moco_momentum(epoch, args):
    return 1. - 0.5 * (1. + math.cos(math.pi * epoch / args.epochs)) * (1. - args.moco_m)


if __name__ == "__main__":
    main()
