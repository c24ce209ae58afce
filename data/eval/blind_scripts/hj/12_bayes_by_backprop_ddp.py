"""Mean-field variational inference (Bayes by Backprop) for a VGG-style CNN.

Gaussian posteriors over all conv / linear weights, trained with the local
reparameterisation trick and the ELBO = NLL + KL / N. KL annealing over the
first epochs. Test-time predictive = average over S weight samples.

Launch (single node, 4 GPUs):
    torchrun --nproc_per_node=4 12_bayes_by_backprop_ddp.py --dataset cifar10 --epochs 150
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


class _BayesMixin:
    def _init_posterior(self, shape, prior_sigma, rho_init):
        self.w_mu = nn.Parameter(torch.empty(shape))
        self.w_rho = nn.Parameter(torch.full(shape, rho_init))
        nn.init.kaiming_normal_(self.w_mu, nonlinearity="relu")
        self.prior_sigma = prior_sigma

    @property
    def w_sigma(self):
        return F.softplus(self.w_rho)

    def kl(self):
        s2 = self.w_sigma ** 2
        p2 = self.prior_sigma ** 2
        return 0.5 * (s2 / p2 + self.w_mu ** 2 / p2 - 1.0 - torch.log(s2 / p2)).sum()


class BayesConv2d(nn.Module, _BayesMixin):
    def __init__(self, cin, cout, k, padding=1, prior_sigma=0.1, rho_init=-5.0):
        super().__init__()
        self._init_posterior((cout, cin, k, k), prior_sigma, rho_init)
        self.bias = nn.Parameter(torch.zeros(cout))
        self.padding = padding

    def forward(self, x):
        mu = F.conv2d(x, self.w_mu, self.bias, padding=self.padding)
        var = F.conv2d(x ** 2, self.w_sigma ** 2, padding=self.padding)
        return mu + var.clamp_min(1e-16).sqrt() * torch.randn_like(mu)


class BayesLinear(nn.Module, _BayesMixin):
    def __init__(self, din, dout, prior_sigma=0.1, rho_init=-5.0):
        super().__init__()
        self._init_posterior((dout, din), prior_sigma, rho_init)
        self.bias = nn.Parameter(torch.zeros(dout))

    def forward(self, x):
        mu = F.linear(x, self.w_mu, self.bias)
        var = F.linear(x ** 2, self.w_sigma ** 2)
        return mu + var.clamp_min(1e-16).sqrt() * torch.randn_like(mu)


class BayesVGG(nn.Module):
    CFG = [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M"]

    def __init__(self, num_classes, prior_sigma):
        super().__init__()
        layers, cin = [], 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [BayesConv2d(cin, v, 3, prior_sigma=prior_sigma), nn.BatchNorm2d(v), nn.ReLU(True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = BayesLinear(512 * 2 * 2, num_classes, prior_sigma=prior_sigma)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))

    def kl(self):
        return sum(m.kl() for m in self.modules() if isinstance(m, _BayesMixin))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
    p.add_argument("--data-root", default="/data")
    p.add_argument("--out", default="runs/bbb_vgg")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prior-sigma", type=float, default=0.1)
    p.add_argument("--kl-anneal-epochs", type=int, default=20)
    p.add_argument("--test-samples", type=int, default=20)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, S):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        probs = torch.stack([F.softmax(model(x), -1) for _ in range(S)]).mean(0)
        stats[0] += y.numel()
        stats[1] += probs.argmax(1).eq(y).sum()
        stats[2] += F.nll_loss(probs.clamp_min(1e-12).log(), y, reduction="sum")
    dist.all_reduce(stats)
    return (stats[1] / stats[0]).item(), (stats[2] / stats[0]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    DS = datasets.CIFAR10 if args.dataset == "cifar10" else datasets.CIFAR100
    ncls = 10 if args.dataset == "cifar10" else 100
    norm = transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
    root = os.path.join(args.data_root, args.dataset)
    train_set = DS(root, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = DS(root, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    n_train = len(train_set)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=args.workers, pin_memory=True)

    model = BayesVGG(ncls, args.prior_sigma).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        ddp.train()
        beta = min(1.0, (epoch + 1) / max(args.kl_anneal_epochs, 1))
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            nll = F.cross_entropy(ddp(x), y)
            kl = model.kl() / n_train
            loss = nll + beta * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([nll.detach(), kl.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            acc, nll_te = evaluate(ddp, test_loader, device, args.test_samples)
            if rank == 0:
                print(f"ep {epoch} beta {beta:.2f} nll {(tot[0] / tot[2]).item():.4f} "
                      f"kl/N {(tot[1] / tot[2]).item():.4f} | test acc {acc:.4f} nll {nll_te:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                state = {"model": model.state_dict(), "epoch": epoch, "acc": acc, "args": vars(args)}
                torch.save(state, os.path.join(args.out, "last.pt"))
                if acc > best:
                    best = acc
                    torch.save(state, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
