"""
Tiny-ImageNet-200 with a ResNet-50 adapted to 64x64 inputs. Logs to Weights & Biases.
One process per GPU via torch.multiprocessing.spawn.

    python 20_tinyimagenet_resnet.py --root tiny-imagenet-200 --gpus 8 --project tinyimnet
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class TinyImageNetVal(Dataset):
    """val/ has one folder of images and val_annotations.txt mapping file -> wnid."""

    def __init__(self, root, class_to_idx, transform):
        self.transform = transform
        self.samples = []
        with open(os.path.join(root, "val", "val_annotations.txt")) as f:
            for line in f:
                fname, wnid = line.split("\t")[:2]
                self.samples.append((os.path.join(root, "val", "images", fname), class_to_idx[wnid]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, y = self.samples[i]
        return self.transform(Image.open(path).convert("RGB")), y


def make_model(num_classes=200):
    m = models.resnet50(weights=None, num_classes=num_classes)
    # 64x64 inputs: 3x3 stem, no max-pool
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="tiny-imagenet-200")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a total batch of 256")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--project", default="tiny-imagenet")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--save-dir", default="ckpt_tin")
    ap.add_argument("--port", type=int, default=29630)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        s[0] += F.cross_entropy(out, y, reduction="sum")
        s[1] += (out.argmax(1) == y).sum()
        s[2] += (out.topk(5, 1).indices == y[:, None]).any(1).sum()
        s[3] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[3]).item(), (s[1] / s[3]).item(), (s[2] / s[3]).item()


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize([0.480, 0.448, 0.398], [0.277, 0.269, 0.282])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(), norm,
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_ds = datasets.ImageFolder(os.path.join(args.root, "train"), transform=train_tf)
    val_ds = TinyImageNetVal(args.root, train_ds.class_to_idx, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    model = make_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    warmup = 5 * len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl) - warmup),
    ], milestones=[warmup])

    best_top1 = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        val_loss, top1, top5 = evaluate(model, val_dl, device)
        wandb.log({"val/loss": val_loss, "val/top1": top1, "val/top5": top5,
                   "epoch": epoch, "epoch_time": time.time() - t0}, step=step)

        if rank == 0:
            print(f"epoch {epoch + 1}: val loss {val_loss:.3f} top1 {top1:.4f} top5 {top5:.4f}")
            os.makedirs(args.save_dir, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
                run.summary["best_top1"] = best_top1

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
