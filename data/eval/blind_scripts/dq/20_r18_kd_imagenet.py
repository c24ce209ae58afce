"""ResNet-18 <- ResNet-50 logit distillation on ImageNet-1k (baseline for the
edge model card). Channels-last + bf16 autocast, EMA of the student weights.

    torchrun --nproc_per_node=8 20_r18_kd_imagenet.py --data /datasets/imagenet --epochs 100
"""
import argparse
import copy
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.models import ResNet50_Weights, resnet18, resnet50

logger = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser(description="ImageNet KD baseline")
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("-b", "--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="at batch 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--kd-ratio", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("-j", "--workers", type=int, default=12)
    p.add_argument("--logdir", default="logs/r18_kd")
    p.add_argument("--resume", default="")
    return p.parse_args()


class EMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1 - self.decay)
            else:
                e.copy_(m)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct1 = correct5 = n = 0
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        top5 = out.topk(5, 1).indices
        correct1 += (top5[:, 0] == target).sum().item()
        correct5 += (top5 == target[:, None]).any(1).sum().item()
        n += target.size(0)
    return 100.0 * correct1 / n, 100.0 * correct5 / n


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="[%(asctime)s] %(message)s")
    torch.backends.cudnn.benchmark = True

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=250, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    teacher = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
    teacher = teacher.to(device, memory_format=torch.channels_last).eval()
    teacher.requires_grad_(False)

    student = resnet18().to(device, memory_format=torch.channels_last)
    ema = EMA(student, args.ema_decay)
    student = DDP(student, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world_size / 256
    params_bn = [p for n, p in student.named_parameters() if p.ndim <= 1]
    params_w = [p for n, p in student.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": params_w, "weight_decay": args.wd},
                                 {"params": params_bn, "weight_decay": 0.0}],
                                lr=base_lr, momentum=0.9, nesterov=True)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=base_lr, total_steps=args.epochs * iters,
                                                    pct_start=0.05, div_factor=25, final_div_factor=1e4)

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        logger.info(f"resumed from {args.resume} at epoch {start_epoch}")

    writer = SummaryWriter(args.logdir) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_out = teacher(images)
                s_out = student(images)
            s_out, t_out = s_out.float(), t_out.float()
            kd = F.kl_div(F.log_softmax(s_out / args.T, 1), F.softmax(t_out / args.T, 1),
                          reduction="batchmean") * args.T ** 2
            loss = args.kd_ratio * kd + F.cross_entropy(s_out, target)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(student.module)
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])

            if i % 200 == 0:
                logger.info(f"Epoch {epoch} [{i}/{iters}] loss {loss.item():.4f} kd {kd.item():.4f} "
                            f"lr {scheduler.get_last_lr()[0]:.4f}")

        dist.all_reduce(loss_acc)
        acc1, acc5 = validate(student.module, val_loader, device)
        ema_acc1, _ = validate(ema.module, val_loader, device)
        if rank == 0:
            train_loss = (loss_acc[0] / loss_acc[1]).item()
            logger.info(f"Epoch {epoch} done in {time.time() - t0:.0f}s  train loss {train_loss:.4f}  "
                        f"top1 {acc1:.2f} top5 {acc5:.2f} ema top1 {ema_acc1:.2f}")
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/top1", acc1, epoch)
            writer.add_scalar("val/top5", acc5, epoch)
            writer.add_scalar("val/ema_top1", ema_acc1, epoch)
            is_best = max(acc1, ema_acc1) > best_acc
            best_acc = max(best_acc, acc1, ema_acc1)
            state = {"model": student.module.state_dict(), "ema": ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "epoch": epoch, "best_acc": best_acc}
            torch.save(state, os.path.join(args.logdir, "checkpoint.pth"))
            if is_best:
                best_model = ema.module if ema_acc1 >= acc1 else student.module
                torch.save(best_model.state_dict(), os.path.join(args.logdir, "model_best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
