"""FixMatch on CIFAR-10 with a small labelled split, multi-GPU via torchrun.

    torchrun --nproc_per_node=4 01_fixmatch_cifar10.py --num-labeled 4000 --out runs/fm4000
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

logger = logging.getLogger("fixmatch")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2471, 0.2435, 0.2616)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/fixmatch")
    p.add_argument("--num-labeled", type=int, default=4000)
    p.add_argument("--total-steps", type=int, default=2 ** 20)
    p.add_argument("--eval-step", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16, help="labelled batch per GPU")
    p.add_argument("--mu", type=int, default=7, help="unlabelled/labelled ratio")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, momentum=0.001)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=0.001)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.leaky_relu(self.bn1(x), 0.1)
        y = self.conv1(o)
        y = self.conv2(F.leaky_relu(self.bn2(y), 0.1))
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, num_classes=10, depth=28, widen=2):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        layers = []
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(w[i] if j == 0 else w[i + 1], w[i + 1], stride if j == 0 else 1))
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(w[3], momentum=0.001)
        self.fc = nn.Linear(w[3], num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.leaky_relu(self.bn(x), 0.1)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class TransformFixMatch:
    def __init__(self):
        norm = [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
        base = [transforms.RandomHorizontalFlip(),
                transforms.RandomCrop(32, padding=4, padding_mode="reflect")]
        self.weak = transforms.Compose(base + norm)
        self.strong = transforms.Compose(base + [transforms.RandAugment(2, 10)] + norm
                                         + [transforms.RandomErasing(p=1.0, scale=(0.02, 0.15))])

    def __call__(self, x):
        return self.weak(x), self.strong(x)


class UnlabeledView(Dataset):
    def __init__(self, base, indices, transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        img, _ = self.base[self.indices[i]]
        return self.transform(img)


def split_labeled(targets, num_labeled, num_classes, seed):
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    per_class = num_labeled // num_classes
    labeled = []
    for c in range(num_classes):
        idx = np.where(targets == c)[0]
        labeled.extend(rng.choice(idx, per_class, replace=False))
    return np.array(labeled), np.arange(len(targets))


class ModelEMA:
    def __init__(self, model, decay):
        import copy
        self.ema = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1 - self.decay)
            else:
                v.copy_(msd[k])


def cosine_lr(optimizer, warmup, total, cycles=7.0 / 16.0):
    def fn(step):
        if step < warmup:
            return float(step) / max(1, warmup)
        prog = float(step - warmup) / max(1, total - warmup)
        return max(0.0, math.cos(math.pi * cycles * prog))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()

    base = datasets.CIFAR10(args.data, train=True)
    lab_idx, unl_idx = split_labeled(base.targets, args.num_labeled, 10, args.seed)
    # repeat the small labelled set so one pass covers eval_step batches
    reps = math.ceil(args.batch_size * world * args.eval_step / len(lab_idx))
    lab_idx = np.tile(lab_idx, reps)
    weak = transforms.Compose([transforms.RandomHorizontalFlip(),
                               transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                               transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    labeled_set = Subset(datasets.CIFAR10(args.data, train=True, transform=weak), lab_idx)
    unlabeled_set = UnlabeledView(base, unl_idx, TransformFixMatch())
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]))

    lab_sampler = DistributedSampler(labeled_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unlabeled_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(labeled_set, args.batch_size, sampler=lab_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unlabeled_set, args.batch_size * args.mu, sampler=unl_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 256, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers)

    model = WideResNet(10).to(device)
    ema = ModelEMA(model, args.ema_decay)
    no_decay = ["bias", "bn"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.wd},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, nesterov=True)
    scheduler = cosine_lr(optimizer, 0, args.total_steps)
    model = DDP(model, device_ids=[local_rank])

    writer = SummaryWriter(args.out) if rank == 0 else None
    os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    epochs = math.ceil(args.total_steps / args.eval_step)
    lab_epoch = unl_epoch = 0
    lab_sampler.set_epoch(0)
    unl_sampler.set_epoch(0)
    lab_iter, unl_iter = iter(lab_loader), iter(unl_loader)

    for epoch in range(epochs):
        model.train()
        t0 = time.time()
        meter = torch.zeros(4, device=device)
        for step in range(args.eval_step):
            try:
                inputs_x, targets_x = next(lab_iter)
            except StopIteration:
                lab_epoch += 1
                lab_sampler.set_epoch(lab_epoch)
                lab_iter = iter(lab_loader)
                inputs_x, targets_x = next(lab_iter)
            try:
                inputs_u_w, inputs_u_s = next(unl_iter)
            except StopIteration:
                unl_epoch += 1
                unl_sampler.set_epoch(unl_epoch)
                unl_iter = iter(unl_loader)
                inputs_u_w, inputs_u_s = next(unl_iter)

            bs = inputs_x.size(0)
            inputs = torch.cat([inputs_x, inputs_u_w, inputs_u_s]).to(device, non_blocking=True)
            targets_x = targets_x.to(device, non_blocking=True)
            logits = model(inputs)
            logits_x = logits[:bs]
            logits_u_w, logits_u_s = logits[bs:].chunk(2)

            Lx = F.cross_entropy(logits_x, targets_x)
            with torch.no_grad():
                probs_u = torch.softmax(logits_u_w.detach(), dim=-1)
                max_probs, targets_u = probs_u.max(dim=-1)
                mask = max_probs.ge(args.threshold)
            if not mask.any():
                continue
            Lu = F.cross_entropy(logits_u_s[mask], targets_u[mask])
            loss = Lx + args.lambda_u * Lu

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model.module)

            meter += torch.stack([loss.detach(), Lx.detach(), Lu.detach(), mask.float().mean()])
            if rank == 0 and step % 100 == 0:
                logger.info("ep %d it %d/%d loss %.4f Lx %.4f Lu %.4f mask %.3f lr %.5f",
                            epoch, step, args.eval_step, loss.item(), Lx.item(), Lu.item(),
                            mask.float().mean().item(), scheduler.get_last_lr()[0])

        dist.all_reduce(meter)
        meter /= world * args.eval_step
        test_loss, test_acc = evaluate(ema.ema, test_loader, device)
        if rank == 0:
            for name, v in zip(["loss", "Lx", "Lu", "mask"], meter.tolist()):
                writer.add_scalar(f"train/{name}", v, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            writer.add_scalar("test/loss", test_loss, epoch)
            is_best = test_acc > best_acc
            best_acc = max(best_acc, test_acc)
            state = {"epoch": epoch + 1, "model": model.module.state_dict(),
                     "ema": ema.ema.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best_acc": best_acc}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pth"))
            logger.info("epoch %d acc %.2f best %.2f (%.0fs)", epoch, test_acc, best_acc, time.time() - t0)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
