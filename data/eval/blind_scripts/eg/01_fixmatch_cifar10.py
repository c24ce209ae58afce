#!/usr/bin/env python
"""FixMatch on CIFAR-10 with WideResNet-28-2, multi-GPU with DDP.

Paper setting: 64 labelled images per step (mu=7 unlabelled ratio), lr 0.03,
2^20 steps. With 4 GPUs use --batch-size 16 (per GPU) to keep the global batch.
"""
import argparse
import logging
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

logger = logging.getLogger("fixmatch")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2471, 0.2435, 0.2616)


def get_args():
    p = argparse.ArgumentParser("FixMatch CIFAR-10")
    p.add_argument("--data-root", default="./data")
    p.add_argument("--num-labeled", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=16, help="labelled batch per GPU")
    p.add_argument("--mu", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--total-steps", type=int, default=2 ** 20)
    p.add_argument("--eval-step", type=int, default=1024)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--out", default="runs/fixmatch_c10")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


# ----------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop_rate=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, momentum=0.001)
        self.relu1 = nn.LeakyReLU(0.1, inplace=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=0.001)
        self.relu2 = nn.LeakyReLU(0.1, inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop_rate = drop_rate
        self.shortcut = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, 0, bias=False)

    def forward(self, x):
        o = self.relu1(self.bn1(x))
        y = self.relu2(self.bn2(self.conv1(o)))
        if self.drop_rate > 0:
            y = F.dropout(y, p=self.drop_rate, training=self.training)
        y = self.conv2(y)
        return (x if self.shortcut is None else self.shortcut(o)) + y


class WideResNet(nn.Module):
    def __init__(self, num_classes=10, depth=28, widen=2, drop_rate=0.0):
        super().__init__()
        ch = [16, 16 * widen, 32 * widen, 64 * widen]
        n = (depth - 4) // 6
        self.conv1 = nn.Conv2d(3, ch[0], 3, 1, 1, bias=False)
        self.block1 = self._group(ch[0], ch[1], n, 1, drop_rate)
        self.block2 = self._group(ch[1], ch[2], n, 2, drop_rate)
        self.block3 = self._group(ch[2], ch[3], n, 2, drop_rate)
        self.bn = nn.BatchNorm2d(ch[3], momentum=0.001)
        self.relu = nn.LeakyReLU(0.1, inplace=True)
        self.fc = nn.Linear(ch[3], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="leaky_relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    @staticmethod
    def _group(cin, cout, n, stride, drop_rate):
        return nn.Sequential(*[BasicBlock(cin if i == 0 else cout, cout, stride if i == 0 else 1, drop_rate)
                               for i in range(n)])

    def forward(self, x):
        x = self.block3(self.block2(self.block1(self.conv1(x))))
        x = F.adaptive_avg_pool2d(self.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


class ModelEMA:
    def __init__(self, model, decay):
        self.ema = deepcopy(model)
        self.ema.eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)
            else:
                v.copy_(msd[k])


# ----------------------------------------------------------------------------- data
class TransformFixMatch:
    def __init__(self):
        flip_crop = [transforms.RandomHorizontalFlip(),
                     transforms.RandomCrop(32, padding=4, padding_mode="reflect")]
        self.weak = transforms.Compose(flip_crop)
        self.strong = transforms.Compose(flip_crop + [transforms.RandAugment(num_ops=2, magnitude=10)])
        self.norm = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])

    def __call__(self, img):
        return self.norm(self.weak(img)), self.norm(self.strong(img))


class CIFAR10SSL(datasets.CIFAR10):
    def __init__(self, root, indexs, transform, train=True):
        super().__init__(root, train=train, transform=transform, download=False)
        if indexs is not None:
            self.data = self.data[indexs]
            self.targets = np.array(self.targets)[indexs]

    def __getitem__(self, i):
        img = Image.fromarray(self.data[i])
        return self.transform(img), int(self.targets[i])


def x_u_split(labels, num_labeled, num_classes, expand_to):
    labels = np.array(labels)
    per_class = num_labeled // num_classes
    labeled_idx = []
    for c in range(num_classes):
        idx = np.where(labels == c)[0]
        labeled_idx.extend(np.random.choice(idx, per_class, replace=False))
    labeled_idx = np.array(labeled_idx)
    if expand_to > len(labeled_idx):
        labeled_idx = np.tile(labeled_idx, math.ceil(expand_to / len(labeled_idx)))
    np.random.shuffle(labeled_idx)
    return labeled_idx, np.arange(len(labels))


def interleave(x, size):
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def de_interleave(x, size):
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def cosine_schedule(optimizer, warmup, total, cycles=7.0 / 16.0):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        prog = (step - warmup) / max(1, total - warmup)
        return max(0.0, math.cos(math.pi * cycles * prog))
    return LambdaLR(optimizer, f)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    return 100.0 * correct / max(1, total)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    if rank != 0:
        dist.barrier()
    base = datasets.CIFAR10(args.data_root, train=True, download=True)
    if rank == 0:
        dist.barrier()

    global_labeled_bs = args.batch_size * world_size
    labeled_idx, unlabeled_idx = x_u_split(base.targets, args.num_labeled, 10,
                                           expand_to=global_labeled_bs * args.eval_step)
    norm = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    labeled_tf = transforms.Compose([transforms.RandomHorizontalFlip(),
                                     transforms.RandomCrop(32, padding=4, padding_mode="reflect"), norm])
    labeled_ds = CIFAR10SSL(args.data_root, labeled_idx, labeled_tf)
    unlabeled_ds = CIFAR10SSL(args.data_root, unlabeled_idx, TransformFixMatch())
    test_ds = datasets.CIFAR10(args.data_root, train=False, transform=norm)

    labeled_sampler = DistributedSampler(labeled_ds, shuffle=True, drop_last=True)
    labeled_loader = DataLoader(labeled_ds, batch_size=args.batch_size, sampler=labeled_sampler,
                                num_workers=args.num_workers, pin_memory=True, drop_last=True)
    unlabeled_loader = DataLoader(unlabeled_ds, batch_size=args.batch_size * args.mu, shuffle=True,
                                  num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=256, shuffle=False, num_workers=args.num_workers)

    model = WideResNet(num_classes=10).to(device)
    ema = ModelEMA(model, args.ema_decay)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "bn")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.wd},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, nesterov=True)
    scheduler = cosine_schedule(optimizer, 0, args.total_steps)

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"], ckpt["best_acc"]
        logger.info("resumed from %s (epoch %d)", args.resume, start_epoch)

    writer = SummaryWriter(args.out) if rank == 0 else None
    os.makedirs(args.out, exist_ok=True)
    epochs = math.ceil(args.total_steps / args.eval_step)

    labeled_epoch = 0
    labeled_iter, unlabeled_iter = iter(labeled_loader), iter(unlabeled_loader)
    for epoch in range(start_epoch, epochs):
        model.train()
        t0 = time.time()
        meter = {"loss": 0.0, "lx": 0.0, "lu": 0.0, "mask": 0.0}
        for step in range(args.eval_step):
            try:
                x_l, y_l = next(labeled_iter)
            except StopIteration:
                labeled_epoch += 1
                labeled_sampler.set_epoch(labeled_epoch)
                labeled_iter = iter(labeled_loader)
                x_l, y_l = next(labeled_iter)
            try:
                (u_w, u_s), _ = next(unlabeled_iter)
            except StopIteration:
                unlabeled_iter = iter(unlabeled_loader)
                (u_w, u_s), _ = next(unlabeled_iter)

            bs = x_l.size(0)
            inputs = interleave(torch.cat((x_l, u_w, u_s)), 2 * args.mu + 1).to(device, non_blocking=True)
            y_l = y_l.to(device, non_blocking=True)
            logits = de_interleave(model(inputs), 2 * args.mu + 1)
            logits_x = logits[:bs]
            logits_u_w, logits_u_s = logits[bs:].chunk(2)

            lx = F.cross_entropy(logits_x, y_l)
            probs = torch.softmax(logits_u_w.detach() / args.T, dim=-1)
            max_probs, targets_u = probs.max(dim=-1)
            mask = max_probs.ge(args.threshold).float()
            lu = (F.cross_entropy(logits_u_s, targets_u, reduction="none") * mask).mean()
            loss = lx + args.lambda_u * lu

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model.module)

            meter["loss"] += loss.item()
            meter["lx"] += lx.item()
            meter["lu"] += lu.item()
            meter["mask"] += mask.mean().item()

        if rank == 0:
            for k in meter:
                meter[k] /= args.eval_step
            acc = evaluate(ema.ema, test_loader, device)
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            logger.info("epoch %d | loss %.4f lx %.4f lu %.4f mask %.3f | top1 %.2f best %.2f | %.0fs",
                        epoch, meter["loss"], meter["lx"], meter["lu"], meter["mask"], acc, best_acc,
                        time.time() - t0)
            for k, v in meter.items():
                writer.add_scalar(f"train/{k}", v, epoch)
            writer.add_scalar("test/top1", acc, epoch)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], epoch)
            state = {"model": model.module.state_dict(), "ema": ema.ema.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "epoch": epoch + 1, "best_acc": best_acc}
            torch.save(state, os.path.join(args.out, "checkpoint.pth.tar"))
            if is_best:
                torch.save(state, os.path.join(args.out, "model_best.pth.tar"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
