"""Self-distillation from an EMA teacher on Tiny-ImageNet (ResNet-50).

loss = CE(student, y) + lambda(t) * T^2 * KL(teacher_T || student_T); the teacher
is an exponential moving average of the student. Supports resuming.

    torchrun --nproc_per_node=4 18_ema_self_distill.py --data /data/tiny-imagenet-200 \
        --out runs/ema_sd --resume runs/ema_sd/last.pth
"""
import argparse
import copy
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


class EMA:
    def __init__(self, model, decay=0.999):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1 - self.decay)
            else:
                v.copy_(msd[k])

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, sd):
        self.module.load_state_dict(sd)


def build_model(num_classes=200):
    net = torchvision.models.resnet50(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)  # 64x64 inputs
    net.maxpool = nn.Identity()
    return net


def distill_weight(epoch, args):
    return args.kd_weight * min(1.0, epoch / max(1, args.kd_rampup))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t[0] += (net(x).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (100 * t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.2, help="for a global batch of 256")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--kd-weight", type=float, default=1.0)
    ap.add_argument("--kd-rampup", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--out", default="runs/ema_sd")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    log = logging.getLogger(__name__)

    norm = T.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282))
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), T.Compose([
        T.RandomResizedCrop(64, scale=(0.35, 1)), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    # val/ reorganised into class folders by prepare_tiny_imagenet.py
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose([T.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=500,
                            num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        log.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    model = DDP(model, device_ids=[local_rank])
    # teacher starts from the broadcast (rank 0) weights
    ema = EMA(model.module, args.ema_decay)
    if args.resume and os.path.isfile(args.resume):
        ema.load_state_dict(ckpt["ema"])

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)

    T_kd = args.temperature
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        w_kd = distill_weight(epoch, args)
        tic = time.time()
        tot = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            with torch.no_grad():
                t_logits = ema.module(x)
            ce = F.cross_entropy(logits, y)
            kd = F.kl_div(F.log_softmax(logits / T_kd, 1), F.softmax(t_logits / T_kd, 1),
                          reduction="batchmean") * T_kd ** 2
            loss = ce + w_kd * kd
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema.update(model.module)
            tot += torch.stack([ce.detach(), kd.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(tot)

        acc = evaluate(model.module, val_loader, device)
        acc_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("train/ce", (tot[0] / tot[2]).item(), epoch)
            writer.add_scalar("train/kd", (tot[1] / tot[2]).item(), epoch)
            writer.add_scalar("val/student", acc, epoch)
            writer.add_scalar("val/ema", acc_ema, epoch)
            log.info("epoch %d  ce %.3f kd %.3f  student %.2f  ema %.2f  (%.0fs)", epoch,
                     (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item(), acc, acc_ema, time.time() - tic)
            best = max(best, acc_ema)
            state = {"model": model.state_dict(), "ema": ema.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "epoch": epoch, "best": best, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if acc_ema >= best:
                torch.save(ema.state_dict(), os.path.join(args.out, "best_ema.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
