"""PGD adversarial training, WRN-34-10 on CIFAR-10/SVHN, DDP. latest.pth is rewritten
after every epoch so that a job killed at the 24h limit can be restarted with
--resume.

    torchrun --nproc_per_node=4 15_pgd_resume.py --dataset cifar10 --exp wrn34_pgd \
        --resume checkpoints/wrn34_pgd/latest.pth
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from robustbench_models import wrn34_10

log = logging.getLogger("pgd")


def build_data(args):
    tf_train = [transforms.RandomCrop(32, padding=4)]
    if args.dataset == "cifar10":
        tf_train.append(transforms.RandomHorizontalFlip())
    tf_train = transforms.Compose(tf_train + [transforms.ToTensor()])
    tf_test = transforms.ToTensor()
    if args.dataset == "cifar10":
        train = datasets.CIFAR10(args.data, train=True, transform=tf_train)
        test = datasets.CIFAR10(args.data, train=False, transform=tf_test)
    else:
        train = datasets.SVHN(args.data, split="train", transform=tf_train)
        test = datasets.SVHN(args.data, split="test", transform=tf_test)
    return train, test


class PGD:
    def __init__(self, eps, alpha, steps):
        self.eps, self.alpha, self.steps = eps, alpha, steps

    def __call__(self, model, x, y):
        x_adv = (x + torch.empty_like(x).uniform_(-self.eps, self.eps)).clamp(0, 1)
        for _ in range(self.steps):
            x_adv.requires_grad_(True)
            loss = F.cross_entropy(model(x_adv), y)
            grad, = torch.autograd.grad(loss, x_adv)
            x_adv = x_adv.detach() + self.alpha * grad.sign()
            x_adv = torch.min(torch.max(x_adv, x - self.eps), x + self.eps).clamp(0, 1)
        return x_adv.detach()


class Trainer:
    def __init__(self, args, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.ckpt_dir = os.path.join("checkpoints", args.exp)
        train, test = build_data(args)
        self.train_sampler = DistributedSampler(train, shuffle=True)
        self.train_loader = DataLoader(train, batch_size=args.batch_size // world, sampler=self.train_sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)
        self.test_loader = DataLoader(test, batch_size=256, sampler=DistributedSampler(test, shuffle=False),
                                      num_workers=args.workers, pin_memory=True)
        self.model = DDP(wrn34_10(num_classes=10).to(device), device_ids=[device.index])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9,
                                   weight_decay=args.wd, nesterov=True)
        total_steps = args.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=args.lr, total_steps=total_steps,
                                                         pct_start=0.25, anneal_strategy="linear")
        self.train_attack = PGD(args.eps, args.eps / 4, args.steps)
        self.test_attack = PGD(args.eps, args.eps / 8, 20)
        self.epoch = 0
        self.best = 0.0

    def save(self, name):
        if self.rank != 0:
            return
        os.makedirs(self.ckpt_dir, exist_ok=True)
        path = os.path.join(self.ckpt_dir, name)
        torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "epoch": self.epoch, "best": self.best},
                   path + ".tmp")
        os.replace(path + ".tmp", path)

    def load(self, path):
        ckpt = torch.load(path)
        self.model.module.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        self.epoch, self.best = ckpt["epoch"], ckpt["best"]
        log.info("resumed from %s (epoch %d, best %.4f)", path, self.epoch, self.best)

    def train_epoch(self):
        self.model.train()
        self.train_sampler.set_epoch(self.epoch)
        m = torch.zeros(3, device=self.device)
        for x, y in self.train_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            x_adv = self.train_attack(self.model, x, y)
            out = self.model(x_adv)
            loss = F.cross_entropy(out, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            m += torch.stack([loss.detach() * len(y), (out.argmax(1) == y).sum().float(),
                              torch.tensor(float(len(y)), device=self.device)])
        dist.all_reduce(m)
        return (m[0] / m[2]).item(), (m[1] / m[2]).item()

    def evaluate(self):
        self.model.eval()
        m = torch.zeros(3, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device), y.to(self.device)
            x_adv = self.test_attack(self.model, x, y)
            with torch.no_grad():
                m[0] += (self.model(x).argmax(1) == y).sum()
                m[1] += (self.model(x_adv).argmax(1) == y).sum()
            m[2] += len(y)
        dist.all_reduce(m)
        return (m[0] / m[2]).item(), (m[1] / m[2]).item()

    def fit(self):
        while self.epoch < self.args.epochs:
            t0 = time.time()
            loss, adv_acc = self.train_epoch()
            clean, robust = self.evaluate()
            self.epoch += 1
            log.info("epoch %d | loss %.4f adv-train %.4f | clean %.4f pgd20 %.4f | %.0fs",
                     self.epoch, loss, adv_acc, clean, robust, time.time() - t0)
            if robust > self.best:
                self.best = robust
                self.save("best.pth")
            self.save("latest.pth")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "svhn"])
    p.add_argument("--data", default="./data")
    p.add_argument("--exp", default="wrn34_pgd")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256, help="global")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--eps", type=float, default=8 / 255)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--resume", default="")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [rank %(process)d] %(message)s")
    torch.manual_seed(0)

    trainer = Trainer(args, rank, world, device)
    if args.resume and os.path.isfile(args.resume):
        trainer.load(args.resume)
    trainer.fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
