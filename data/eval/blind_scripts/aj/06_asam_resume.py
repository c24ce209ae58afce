"""ASAM (adaptive sharpness-aware minimization, Kwon et al. 2021) on CIFAR-100.

Preemptible cluster jobs: the script checkpoints every epoch and resumes with
--resume auto.

    torchrun --nproc_per_node=8 06_asam_resume.py --cfg cfg/asam_pyramidnet.yaml --resume auto
"""
import argparse
import glob
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from timm.models import create_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class ASAM:
    def __init__(self, optimizer, model, rho=0.5, eta=0.01):
        self.optimizer = optimizer
        self.model = model
        self.rho = rho
        self.eta = eta
        self.state = defaultdict(dict)

    @torch.no_grad()
    def ascent_step(self):
        wgrads = []
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eps")
            if t_w is None:
                t_w = torch.clone(p).detach()
                self.state[p]["eps"] = t_w
            if "weight" in n:
                t_w[...] = p[...]
                t_w.abs_().add_(self.eta)
                p.grad.mul_(t_w)
            wgrads.append(torch.norm(p.grad, p=2))
        wgrad_norm = torch.norm(torch.stack(wgrads), p=2) + 1e-12
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eps")
            if "weight" in n:
                p.grad.mul_(t_w)
            eps = t_w
            eps[...] = p.grad[...]
            eps.mul_(self.rho / wgrad_norm)
            p.add_(eps)
        self.optimizer.zero_grad()

    @torch.no_grad()
    def descent_step(self):
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            p.sub_(self.state[p]["eps"])
        self.optimizer.step()
        self.optimizer.zero_grad()


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default="", help="path, or 'auto' for the latest in out_dir")
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = args.resume
    return cfg


def make_loaders(cfg):
    mean, std = [0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.AutoAugment(transforms.AutoAugmentPolicy.CIFAR10),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = datasets.CIFAR100(cfg["data_root"], train=True, transform=train_tf)
    test_ds = datasets.CIFAR100(cfg["data_root"], train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg.get("workers", 6), pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=512, shuffle=False, num_workers=4)
    return train_dl, test_dl, train_sampler


def find_latest(out_dir):
    ckpts = sorted(glob.glob(os.path.join(out_dir, "epoch_*.pth")))
    return ckpts[-1] if ckpts else ""


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_dl, test_dl, train_sampler = make_loaders(cfg)

    model = create_model(cfg["arch"], num_classes=100, drop_rate=cfg.get("dropout", 0.0))
    if cfg.get("sync_bn", True):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    # cfg lr is given for the total batch of the paper (batch_size * 8 GPUs = 128 * 8)
    lr = cfg["lr"] * cfg["batch_size"] * world / (128 * 8)
    base_opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                               weight_decay=cfg["weight_decay"])
    minimizer = ASAM(base_opt, model, rho=cfg["rho"], eta=cfg.get("eta", 0.01))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(base_opt, T_max=cfg["epochs"])
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.get("smoothing", 0.1))

    start_epoch, best = 0, 0.0
    resume = find_latest(cfg["out_dir"]) if cfg["resume"] == "auto" else cfg["resume"]
    if resume:
        checkpoint = torch.load(resume)
        model.module.load_state_dict(checkpoint["model"])
        base_opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best = checkpoint["best"]
        if rank == 0:
            print(f"resumed from {resume} at epoch {start_epoch}")

    writer = None
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg["out_dir"], "tb"))

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        for x, y in train_dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            out = model(x)
            loss = criterion(out, y)
            loss.backward()
            minimizer.ascent_step()

            criterion(model(x), y).backward()
            minimizer.descent_step()

            stats[0] += loss.detach() * y.size(0)
            stats[1] += (out.argmax(1) == y).sum()
            stats[2] += y.size(0)
        scheduler.step()
        dist.all_reduce(stats)

        if rank == 0:
            net = model.module
            net.eval()
            correct = 0
            with torch.no_grad():
                for x, y in test_dl:
                    correct += (net(x.to(device)).argmax(1).cpu() == y).sum().item()
            acc = 100.0 * correct / len(test_dl.dataset)
            best = max(best, acc)
            writer.add_scalar("train/loss", (stats[0] / stats[2]).item(), epoch)
            writer.add_scalar("train/acc", (100 * stats[1] / stats[2]).item(), epoch)
            writer.add_scalar("test/acc", acc, epoch)
            print(f"epoch {epoch}: test acc {acc:.2f} (best {best:.2f})")
            torch.save({
                "model": model.module.state_dict(),
                "optimizer": base_opt.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best": best,
                "cfg": cfg,
            }, os.path.join(cfg["out_dir"], f"epoch_{epoch:03d}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
