"""MART (Wang et al., ICLR 2020) on CIFAR-10 with a WRN-34-10, DDP.

The natural and adversarial halves go through the network in one forward pass.
Model selection keeps the checkpoint with the best PGD-20 test accuracy.

    torchrun --nproc_per_node=4 06_mart_cifar.py --config configs/mart_wrn34.yaml
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

from models.wideresnet import WideResNet

DEFAULTS = dict(
    data_root="./data",
    out_dir="./runs/mart_wrn34",
    epochs=120,
    batch_size=128,          # global
    lr=0.01,
    momentum=0.9,
    weight_decay=3.5e-3,
    epsilon=8 / 255,
    step_size=2 / 255,
    num_steps=10,
    beta=6.0,
    eval_steps=20,
    workers=4,
    milestones=[75, 90, 100],
)


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if args.out_dir:
        cfg["out_dir"] = args.out_dir
    return argparse.Namespace(**cfg)


def mart_loss(model, x_natural, y, step_size, epsilon, perturb_steps, beta):
    kl = nn.KLDivLoss(reduction="none")
    model.eval()
    bs = x_natural.size(0)
    x_adv = x_natural.detach() + 0.001 * torch.randn_like(x_natural)
    for _ in range(perturb_steps):
        x_adv.requires_grad_()
        loss_ce = F.cross_entropy(model(x_adv), y)
        grad = torch.autograd.grad(loss_ce, [x_adv])[0]
        x_adv = x_adv.detach() + step_size * torch.sign(grad.detach())
        x_adv = torch.min(torch.max(x_adv, x_natural - epsilon), x_natural + epsilon)
        x_adv = torch.clamp(x_adv, 0.0, 1.0)
    model.train()
    x_adv = x_adv.detach()

    logits_all = model(torch.cat([x_natural, x_adv], dim=0))
    logits, logits_adv = logits_all[:bs], logits_all[bs:]

    adv_probs = F.softmax(logits_adv, dim=1)
    tmp1 = torch.argsort(adv_probs, dim=1)[:, -2:]
    new_y = torch.where(tmp1[:, -1] == y, tmp1[:, -2], tmp1[:, -1])
    loss_adv = F.cross_entropy(logits_adv, y) + F.nll_loss(torch.log(1.0001 - adv_probs + 1e-12), new_y)

    nat_probs = F.softmax(logits, dim=1)
    true_probs = torch.gather(nat_probs, 1, y.unsqueeze(1).long()).squeeze(1)
    loss_robust = (1.0 / bs) * torch.sum(
        torch.sum(kl(torch.log(adv_probs + 1e-12), nat_probs), dim=1) * (1.0000001 - true_probs))
    return loss_adv + float(beta) * loss_robust


def pgd_whitebox(model, x, y, epsilon, num_steps, step_size):
    x_pgd = x + torch.empty_like(x).uniform_(-epsilon, epsilon)
    x_pgd = x_pgd.clamp(0, 1)
    for _ in range(num_steps):
        x_pgd.requires_grad_(True)
        loss = F.cross_entropy(model(x_pgd), y)
        grad, = torch.autograd.grad(loss, [x_pgd])
        x_pgd = x_pgd.detach() + step_size * grad.sign()
        x_pgd = torch.min(torch.max(x_pgd, x - epsilon), x + epsilon).clamp(0, 1)
    return x_pgd.detach()


def evaluate(model, loader, cfg, device):
    model.eval()
    nat_correct, rob_correct, total = 0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.no_grad():
            nat_correct += (model(x).argmax(1) == y).sum().item()
        x_adv = pgd_whitebox(model, x, y, cfg.epsilon, cfg.eval_steps, cfg.step_size)
        with torch.no_grad():
            rob_correct += (model(x_adv).argmax(1) == y).sum().item()
        total += y.size(0)
    return nat_correct / total, rob_correct / total


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(vars(cfg), f)

    tr = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor()])
    trainset = datasets.CIFAR10(cfg.data_root, train=True, transform=tr)
    testset = datasets.CIFAR10(cfg.data_root, train=False, transform=transforms.ToTensor())
    train_sampler = DistributedSampler(trainset)
    test_sampler = DistributedSampler(testset, shuffle=False)
    train_loader = DataLoader(trainset, batch_size=cfg.batch_size // world, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(testset, batch_size=100, sampler=test_sampler,
                             num_workers=cfg.workers, pin_memory=True)

    model = DDP(WideResNet(depth=34, widen_factor=10).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.milestones, gamma=0.1)

    best_rob = 0.0
    global_step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for batch_idx, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = mart_loss(model, x, y, cfg.step_size, cfg.epsilon, cfg.num_steps, cfg.beta)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
            global_step += 1
        scheduler.step()
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        nat_acc, rob_acc = evaluate(model, test_loader, cfg, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) loss {train_loss:.4f} "
                  f"nat {nat_acc:.4f} pgd{cfg.eval_steps} {rob_acc:.4f}", flush=True)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("test/natural_acc", nat_acc, epoch)
            writer.add_scalar("test/pgd_acc", rob_acc, epoch)
            writer.add_scalar("lr", optimizer.param_groups[0]["lr"], epoch)
            ckpt = {"epoch": epoch + 1, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if rob_acc > best_rob:
                best_rob = rob_acc
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))

    if rank == 0:
        writer.close()
        print(f"best PGD-{cfg.eval_steps} accuracy: {best_rob:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
