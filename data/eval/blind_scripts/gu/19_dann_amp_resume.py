"""DANN on Office-Home with fp16 autocast, TensorBoard and resumable checkpoints.

Source and target batches are concatenated and go through the network in a
single forward, so BatchNorm sees both domains at once and DDP sees one forward
per backward.  Evaluation of the (small) target test set runs on rank 0 only.

    torchrun --nproc_per_node=4 19_dann_amp_resume.py --root data/office-home -s Real_World -t Product
    torchrun --nproc_per_node=4 19_dann_amp_resume.py ... --resume runs/dann_amp/checkpoint.pth
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, models, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/office-home")
    p.add_argument("-s", "--source", default="Real_World")
    p.add_argument("-t", "--target", default="Product")
    p.add_argument("--batch-size", type=int, default=32, help="per GPU and domain")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--trade-off", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="runs/dann_amp")
    p.add_argument("--resume", default="")
    return p.parse_args()


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.neg() * ctx.coeff, None


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        base.fc = nn.Identity()
        self.features = base
        self.bottleneck = nn.Sequential(nn.Linear(2048, 256), nn.BatchNorm1d(256), nn.ReLU())
        self.classifier = nn.Linear(256, num_classes)
        self.domain = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.5),
                                    nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 1))

    def forward(self, x, coeff=0.0):
        f = self.bottleneck(self.features(x))
        return self.classifier(f), self.domain(GradReverse.apply(f, coeff))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = total = 0
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = net(x.to(device, non_blocking=True))
        correct += (logits.argmax(1).cpu() == y).sum().item()
        total += y.numel()
    net.train()
    return 100.0 * correct / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = datasets.ImageFolder(os.path.join(args.root, args.source), train_tf)
    tgt = datasets.ImageFolder(os.path.join(args.root, args.target), train_tf)
    s_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    t_sampler = DistributedSampler(tgt, shuffle=True, drop_last=True)
    s_loader = DataLoader(src, args.batch_size, sampler=s_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    t_loader = DataLoader(tgt, args.batch_size, sampler=t_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = None
    if rank == 0:
        test_set = datasets.ImageFolder(os.path.join(args.root, args.target), test_tf)
        test_loader = DataLoader(test_set, 128, shuffle=False, num_workers=args.workers, pin_memory=True)

    net = Net(len(src.classes)).to(device)
    optimizer = torch.optim.SGD([
        {"params": net.features.parameters(), "lr": 0.1 * args.lr},
        {"params": [*net.bottleneck.parameters(), *net.classifier.parameters(), *net.domain.parameters()],
         "lr": args.lr},
    ], momentum=0.9, weight_decay=1e-3, nesterov=True)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    model = DDP(net, device_ids=[local_rank])

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    steps_per_epoch = min(len(s_loader), len(t_loader))
    total_steps = args.epochs * steps_per_epoch

    for epoch in range(start_epoch, args.epochs):
        s_sampler.set_epoch(epoch)
        t_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, ((xs, ys), (xt, _)) in enumerate(zip(s_loader, t_loader)):
            step = epoch * steps_per_epoch + i
            p = step / total_steps
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr * (1 + 10 * p) ** -0.75
            coeff = 2.0 / (1.0 + math.exp(-10 * p)) - 1.0

            x = torch.cat([xs, xt]).to(device, non_blocking=True)
            ys = ys.to(device, non_blocking=True)
            d = torch.cat([torch.ones(len(xs), 1), torch.zeros(len(xt), 1)]).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, dom = model(x, coeff)
                cls_loss = F.cross_entropy(logits[: len(xs)], ys)
                dom_loss = F.binary_cross_entropy_with_logits(dom.float(), d)
                loss = cls_loss + args.trade_off * dom_loss

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if i % 50 == 0:
                logs = torch.stack([cls_loss.detach().float(), dom_loss.detach().float()])
                dist.all_reduce(logs)
                logs /= world
                if writer is not None:
                    writer.add_scalar("train/cls_loss", logs[0].item(), step)
                    writer.add_scalar("train/domain_loss", logs[1].item(), step)
                    writer.add_scalar("train/grl_coeff", coeff, step)
                    writer.add_scalar("train/lr", optimizer.param_groups[1]["lr"], step)

        if rank == 0:
            acc = evaluate(net, test_loader, device)
            best = max(best, acc)
            writer.add_scalar("test/target_acc", acc, epoch)
            print(f"epoch {epoch}: target acc {acc:.2f} (best {best:.2f}) {time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            tmp = os.path.join(args.out, "checkpoint.pth.tmp")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "best": best}, tmp)
            os.replace(tmp, os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
