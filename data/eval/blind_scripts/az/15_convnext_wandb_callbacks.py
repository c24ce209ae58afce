"""ConvNeXt-Tiny on Tiny-ImageNet-200 with mixup, Keras-style callback list.

The tf.keras run used wandb.keras.WandbCallback; this file keeps a tiny
callback protocol (on_train_begin / on_epoch_end / on_train_end) and a
W&B callback with the same config keys so old and new runs sit in one project.

    torchrun --nproc_per_node=8 15_convnext_wandb_callbacks.py --data /data/tiny-imagenet-200
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=4e-3, help="for global batch 4096, scaled linearly")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--project", default="tiny-imagenet")
    p.add_argument("--run-name", default=None)
    p.add_argument("--out", default="runs/convnext_tiny")
    return p.parse_args()


class Callback:
    def on_train_begin(self, logs=None): ...
    def on_epoch_end(self, epoch, logs=None): ...
    def on_train_end(self, logs=None): ...


class WandbCallback(Callback):
    def __init__(self, project, name, config):
        self.run = wandb.init(project=project, name=name, config=config, reinit=True)

    def on_epoch_end(self, epoch, logs=None):
        self.run.log({**logs, "epoch": epoch})

    def on_train_end(self, logs=None):
        self.run.finish()


class ModelCheckpoint(Callback):
    def __init__(self, model, path, monitor="val_acc", rank=0):
        self.model, self.path, self.monitor, self.rank = model, path, monitor, rank
        self.best = -1.0

    def on_epoch_end(self, epoch, logs=None):
        if self.rank == 0 and logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save({"epoch": epoch, "model": self.model.module.state_dict(), "best": self.best}, self.path)


class ProgbarLogger(Callback):
    def __init__(self, epochs, rank):
        self.epochs, self.rank = epochs, rank

    def on_epoch_end(self, epoch, logs=None):
        if self.rank == 0:
            print(f"Epoch {epoch + 1}/{self.epochs} - " + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()),
                  flush=True)


def loaders(args, rank, world):
    norm = transforms.Normalize([0.480, 0.448, 0.398], [0.277, 0.269, 0.282])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(), transforms.ToTensor(), norm, transforms.RandomErasing(0.25)]))
    # val/ has been re-organised into class folders by prepare_tiny_imagenet.py
    val = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=256, num_workers=4, pin_memory=True)
    return sampler, train_dl, val_dl


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sampler, train_dl, val_dl = loaders(args, rank, world)
    model = timm.create_model("convnext_tiny", pretrained=False, num_classes=200, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 4096
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    warm = args.warmup_epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm, eta_min=1e-6)], milestones=[warm])
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=200)
    train_loss_fn = SoftTargetCrossEntropy()

    config = dict(vars(args), global_batch=global_batch, scaled_lr=lr, world_size=world)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    callbacks = [
        WandbCallback(args.project, args.run_name, config),
        ProgbarLogger(args.epochs, rank),
        ModelCheckpoint(model, os.path.join(args.out, "best.pt"), rank=rank),
    ]
    for cb in callbacks:
        cb.on_train_begin()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = train_loss_fn(model(x), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        model.eval()
        va = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x).float()
                va += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum().float(),
                                   torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        logs = {"loss": (tr[0] / tr[1]).item(), "val_loss": (va[0] / va[2]).item(),
                "val_acc": (va[1] / va[2]).item(), "lr": sched.get_last_lr()[0], "epoch_time": time.time() - t0}
        for cb in callbacks:
            cb.on_epoch_end(epoch, logs)

    for cb in callbacks:
        cb.on_train_end()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
