"""MoCo v3 pre-training, ResNet-50, LARS, 4096 batch (SyncBN in backbone, projector and predictor)."""
import argparse
import math
import os
import random
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as torchvision_models
from PIL import ImageFilter, ImageOps
from torchvision import datasets, transforms


def get_parser():
    parser = argparse.ArgumentParser(description="MoCo v3 ImageNet Pre-Training")
    parser.add_argument("data", metavar="DIR")
    parser.add_argument("-j", "--workers", default=32, type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("-b", "--batch-size", default=4096, type=int, help="total batch size over all GPUs")
    parser.add_argument("--lr", default=0.6, type=float, help="base lr for batch 256")
    parser.add_argument("--wd", default=1e-6, type=float)
    parser.add_argument("--warmup-epochs", default=10, type=int)
    parser.add_argument("--moco-dim", default=256, type=int)
    parser.add_argument("--moco-mlp-dim", default=4096, type=int)
    parser.add_argument("--moco-m", default=0.99, type=float)
    parser.add_argument("--moco-t", default=1.0, type=float)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--print-freq", default=10, type=int)
    parser.add_argument("--output-dir", default=".", type=str)
    return parser


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


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:  # no weight decay / LARS adaptation for biases and BN
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, (g["trust_coefficient"] * param_norm / update_norm),
                                                one), one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


def build_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True):
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


class MoCoResNet(nn.Module):
    def __init__(self, dim=256, mlp_dim=4096, T=1.0):
        super().__init__()
        self.T = T
        self.base_encoder = torchvision_models.resnet50(zero_init_residual=True)
        self.momentum_encoder = torchvision_models.resnet50(zero_init_residual=True)
        hidden_dim = self.base_encoder.fc.weight.shape[1]
        del self.base_encoder.fc, self.momentum_encoder.fc
        self.base_encoder.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
        self.momentum_encoder.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
        self.predictor = build_mlp(2, dim, mlp_dim, dim, False)
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1. - m)

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


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.lr * 0.5 * (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def adjust_moco_momentum(epoch, args):
    return 1. - 0.5 * (1. + math.cos(math.pi * epoch / args.epochs)) * (1. - args.moco_m)


def main():
    args = get_parser().parse_args()
    gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = MoCoResNet(args.moco_dim, args.moco_mlp_dim, args.moco_t)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    args.lr = args.lr * args.batch_size / 256
    model.cuda(gpu)
    args.batch_size = int(args.batch_size / world_size)
    args.workers = int((args.workers + world_size - 1) / world_size)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])

    optimizer = LARS(model.parameters(), args.lr, weight_decay=args.wd, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()

    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=f"cuda:{gpu}")
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        if rank == 0:
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    augmentation1 = [
        transforms.RandomResizedCrop(224, scale=(0.08, 1.)),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([GaussianBlur([.1, 2.])], p=1.0),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]
    augmentation2 = [
        transforms.RandomResizedCrop(224, scale=(0.08, 1.)),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([GaussianBlur([.1, 2.])], p=0.1),
        transforms.RandomApply([Solarize()], p=0.2),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"),
                                         TwoCropsTransform(transforms.Compose(augmentation1),
                                                           transforms.Compose(augmentation2)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                                               num_workers=args.workers, pin_memory=True, sampler=train_sampler,
                                               drop_last=True)

    iters_per_epoch = len(train_loader)
    for epoch in range(args.start_epoch, args.epochs):
        model.train()
        end = time.time()
        loss_sum = torch.zeros(2, device="cuda")
        for i, (images, _) in enumerate(train_loader):
            lr = adjust_learning_rate(optimizer, epoch + i / iters_per_epoch, args)
            moco_m = adjust_moco_momentum(epoch + i / iters_per_epoch, args)
            images[0] = images[0].cuda(gpu, non_blocking=True)
            images[1] = images[1].cuda(gpu, non_blocking=True)
            with torch.cuda.amp.autocast(True):
                loss = model(images[0], images[1], moco_m)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device="cuda")])
            if rank == 0 and i % args.print_freq == 0:
                print(f"Epoch: [{epoch}][{i}/{iters_per_epoch}] loss {loss.item():.4f} lr {lr:.4f} "
                      f"m {moco_m:.4f} time {time.time() - end:.3f}", flush=True)
            end = time.time()

        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"Epoch {epoch} mean loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            filename = os.path.join(args.output_dir, f"checkpoint_{epoch:04d}.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": "resnet50", "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, filename)
            shutil.copyfile(filename, os.path.join(args.output_dir, "checkpoint_last.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
