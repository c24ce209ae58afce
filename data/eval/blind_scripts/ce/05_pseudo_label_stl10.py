"""Pseudo-Label (Lee, 2013) on STL-10: 5k labelled train images + 100k unlabelled.

torchrun --nproc_per_node=4 05_pseudo_label_stl10.py --data /datasets/stl10 --epochs 60
"""
import argparse
import csv
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/stl10")
    ap.add_argument("--arch", default="resnet26d")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lb-batch", type=int, default=32)
    ap.add_argument("--ulb-batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--t1", type=int, default=10, help="epoch where pseudo-label weight starts rising")
    ap.add_argument("--t2", type=int, default=40, help="epoch where it reaches alpha_f")
    ap.add_argument("--alpha-f", type=float, default=3.0)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="out/pl_stl10")
    return ap.parse_args()


def alpha_weight(epoch, t1, t2, af):
    if epoch < t1:
        return 0.0
    if epoch > t2:
        return af
    return (epoch - t1) / (t2 - t1) * af


def setup():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def loaders(args):
    mean, std = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(96, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4, 0.1),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    labeled = datasets.STL10(args.data, split="train", transform=train_tf)
    unlabeled = datasets.STL10(args.data, split="unlabeled", transform=train_tf)
    test = datasets.STL10(args.data, split="test", transform=test_tf)

    lb_sampler = DistributedSampler(labeled, shuffle=True)
    lb_loader = DataLoader(labeled, batch_size=args.lb_batch, sampler=lb_sampler,
                           num_workers=args.workers // 2, pin_memory=True, drop_last=True)
    ulb_loader = DataLoader(unlabeled, batch_size=args.ulb_batch, shuffle=True,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test, batch_size=256, sampler=DistributedSampler(test, shuffle=False),
                             num_workers=args.workers // 2, pin_memory=True)
    return lb_loader, lb_sampler, ulb_loader, test_loader


@torch.no_grad()
def test_accuracy(model, loader):
    model.eval()
    hits = torch.zeros(2, device="cuda")
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with autocast():
            out = model(x)
        hits[0] += (out.argmax(1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits, op=dist.ReduceOp.SUM)
    return 100.0 * hits[0].item() / hits[1].item()


def main():
    args = parse()
    rank, world, local_rank = setup()
    torch.manual_seed(1234)
    lb_loader, lb_sampler, ulb_loader, test_loader = loaders(args)

    model = timm.create_model(args.arch, pretrained=False, num_classes=10).cuda()
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    steps_per_epoch = len(ulb_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch, pct_start=0.05)
    scaler = GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        csv_f = open(os.path.join(args.out, "log.csv"), "w", newline="")
        csv_w = csv.writer(csv_f)
        csv_w.writerow(["epoch", "sup", "pl", "pl_frac", "test_acc", "secs"])

    best = 0.0
    lb_epoch = 0
    for epoch in range(args.epochs):
        model.train()
        lb_sampler.set_epoch(lb_epoch)
        lb_iter = iter(lb_loader)
        alpha = alpha_weight(epoch, args.t1, args.t2, args.alpha_f)
        sums = torch.zeros(3, device="cuda")
        t0 = time.time()
        for step, (xu, _) in enumerate(ulb_loader):
            try:
                xl, yl = next(lb_iter)
            except StopIteration:
                lb_epoch += 1
                lb_sampler.set_epoch(lb_epoch)
                lb_iter = iter(lb_loader)
                xl, yl = next(lb_iter)
            xl, yl, xu = xl.cuda(non_blocking=True), yl.cuda(non_blocking=True), xu.cuda(non_blocking=True)
            n = xl.size(0)
            with autocast():
                logits = model(torch.cat([xl, xu]))
                sup = F.cross_entropy(logits[:n], yl)
                lu = logits[n:]
                conf, pl = lu.detach().float().softmax(1).max(1)
                keep = (conf > args.threshold).float()
                pl_loss = (F.cross_entropy(lu.float(), pl, reduction="none") * keep).sum() / keep.sum().clamp(min=1.0)
                loss = sup + alpha * pl_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            sums += torch.stack([sup.detach().float(), pl_loss.detach().float(), keep.mean()])

            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} sup {sup.item():.3f} "
                      f"pl {pl_loss.item():.3f} kept {keep.mean().item():.2f} alpha {alpha:.2f}", flush=True)

        dist.all_reduce(sums)
        sums /= world * steps_per_epoch
        acc = test_accuracy(model, test_loader)
        if rank == 0:
            secs = time.time() - t0
            csv_w.writerow([epoch, *[round(v, 4) for v in sums.tolist()], round(acc, 2), round(secs)])
            csv_f.flush()
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict()}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_weights.pt"))
            print(f"== epoch {epoch} test acc {acc:.2f} (best {best:.2f}) {secs:.0f}s", flush=True)

    if rank == 0:
        csv_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
