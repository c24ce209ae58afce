"""Mean Teacher with the ConvLarge (CNN-13) network on SVHN, 1000 labels.

Run:  torchrun --nproc_per_node=2 10_mean_teacher_svhn.py --epochs 300 --labels 1000
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

LOG = logging.getLogger("mt-svhn")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/svhn")
    ap.add_argument("--out", default="results/mt_svhn")
    ap.add_argument("--labels", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--iters-per-epoch", type=int, default=400)
    ap.add_argument("--lb-bs", type=int, default=32)
    ap.add_argument("--ulb-bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--cons-weight", type=float, default=8.0)
    ap.add_argument("--rampup", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=10)
    return ap.parse_args()


class GaussianNoise(nn.Module):
    def __init__(self, std=0.15):
        super().__init__()
        self.std = std

    def forward(self, x):
        if self.training:
            return x + torch.randn_like(x) * self.std
        return x


def conv(cin, cout, k, pad):
    return nn.Sequential(weight_norm(nn.Conv2d(cin, cout, k, padding=pad)), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))


class ConvLarge(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.net = nn.Sequential(
            GaussianNoise(0.15),
            conv(3, 128, 3, 1), conv(128, 128, 3, 1), conv(128, 128, 3, 1),
            nn.MaxPool2d(2, 2), nn.Dropout(0.5),
            conv(128, 256, 3, 1), conv(256, 256, 3, 1), conv(256, 256, 3, 1),
            nn.MaxPool2d(2, 2), nn.Dropout(0.5),
            conv(256, 512, 3, 0), conv(512, 256, 1, 0), conv(256, 128, 1, 0),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = weight_norm(nn.Linear(128, num_classes))

    def forward(self, x):
        return self.fc(self.net(x))


def rampup(epoch, length):
    if epoch >= length:
        return 1.0
    t = 1.0 - epoch / length
    return float(np.exp(-5.0 * t * t))


def repeat_loader(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for b in loader:
            yield b
        ep += 1


def accuracy(model, loader, device):
    model.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device, non_blocking=True)).argmax(1).cpu()
            correct += (pred == y).sum().item()
            total += y.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    return 100.0 * stats[0].item() / stats[1].item()


def main():
    args = cli()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")
    torch.manual_seed(0)

    tf = transforms.Compose([transforms.RandomCrop(32, padding=2), transforms.ToTensor(),
                             transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    train = datasets.SVHN(args.data, split="train", transform=tf)
    test = datasets.SVHN(args.data, split="test", transform=tf_test)
    rs = np.random.RandomState(0)
    lbl_idx = np.concatenate([rs.choice(np.where(train.labels == c)[0], args.labels // 10, replace=False)
                              for c in range(10)])
    lb_set = Subset(train, lbl_idx)

    lb_sampler = DistributedSampler(lb_set, shuffle=True)
    ulb_sampler = DistributedSampler(train, shuffle=True)
    lb_stream = repeat_loader(DataLoader(lb_set, args.lb_bs, sampler=lb_sampler, num_workers=2,
                                         drop_last=True, pin_memory=True), lb_sampler)
    ulb_stream = repeat_loader(DataLoader(train, args.ulb_bs, sampler=ulb_sampler, num_workers=6,
                                          drop_last=True, pin_memory=True), ulb_sampler)
    test_loader = DataLoader(test, 1000, sampler=DistributedSampler(test, shuffle=False), num_workers=4)

    student = ConvLarge().to(device)
    teacher = ConvLarge().to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    student = DDP(student, device_ids=[local_rank])
    opt = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.iters_per_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        student.train()
        teacher.train()
        w = args.cons_weight * rampup(epoch, args.rampup)
        for i in range(args.iters_per_epoch):
            xl, yl = next(lb_stream)
            xu, _ = next(ulb_stream)
            x = torch.cat([xl, xu]).to(device, non_blocking=True)
            yl = yl.to(device, non_blocking=True)

            out_s = student(x)
            with torch.no_grad():
                out_t = teacher(x)
            loss_cls = F.cross_entropy(out_s[: yl.size(0)], yl)
            loss_cons = F.mse_loss(out_s.softmax(1), out_t.softmax(1))
            loss = loss_cls + w * loss_cons

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            decay = min(1.0 - 1.0 / (step + 1), args.ema)
            with torch.no_grad():
                for tp, sp in zip(teacher.parameters(), student.module.parameters()):
                    tp.mul_(decay).add_(sp.detach(), alpha=1.0 - decay)
                for tb, sb in zip(teacher.buffers(), student.module.buffers()):
                    tb.copy_(sb)

            if i % 100 == 0:
                LOG.info("ep %d it %d cls %.4f cons %.5f w %.2f lr %.4f", epoch, i,
                         loss_cls.item(), loss_cons.item(), w, sched.get_last_lr()[0])

        acc_s = accuracy(student.module, test_loader, device)
        acc_t = accuracy(teacher, test_loader, device)
        LOG.info("epoch %d  student %.2f%%  teacher %.2f%%", epoch, acc_s, acc_t)
        if rank == 0 and (epoch + 1) % args.save_every == 0:
            torch.save({"epoch": epoch + 1, "student": student.module.state_dict(),
                        "teacher": teacher.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                       os.path.join(args.out, f"ckpt_{epoch + 1:04d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
