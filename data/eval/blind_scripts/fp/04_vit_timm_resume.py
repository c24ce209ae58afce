"""ViT-B/16 training with timm under torchrun, resumable mid-epoch.

Preemption-safe: the sampler is deterministic given (seed, epoch), so a restart
can skip exactly the samples that were already consumed in the current epoch.
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import timm
import yaml
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


class StopFlag:
    raised = False

    @classmethod
    def handler(cls, signum, frame):
        cls.raised = True


class ResumableRandomSampler(Sampler):
    """Seeded permutation per epoch; can start from an offset after a restart."""

    def __init__(self, dataset, seed=0):
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def set_epoch(self, epoch, offset=0):
        self.epoch = epoch
        self.offset = offset

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=g).tolist()
        return iter(perm[self.offset:])

    def __len__(self):
        return len(self.dataset) - self.offset


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default="auto", help="'auto', 'none' or a checkpoint path")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = args.resume
    return cfg


def checkpoint_path(cfg, name):
    return os.path.join(cfg["output_dir"], name)


def write_checkpoint(cfg, state):
    os.makedirs(cfg["output_dir"], exist_ok=True)
    final = checkpoint_path(cfg, "last.pth")
    tmp = final + ".writing"
    torch.save(state, tmp)
    os.replace(tmp, final)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc1 = torch.zeros(1, device=device)
    n = torch.zeros(1, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(images)
        acc1 += (logits.argmax(dim=1) == labels).sum()
        n += labels.size(0)
    dist.all_reduce(acc1)
    dist.all_reduce(n)
    return (acc1 / n).item()


def main():
    cfg = load_config()
    signal.signal(signal.SIGTERM, StopFlag.handler)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic")
    train_set = ImageFolder(os.path.join(cfg["data_root"], "train"), train_tf)
    val_set = ImageFolder(os.path.join(cfg["data_root"], "val"), val_tf)

    bs = cfg["batch_size_per_gpu"]
    train_sampler = ResumableRandomSampler(train_set, seed=cfg["seed"])
    train_loader = DataLoader(train_set, batch_size=bs, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=False)
    val_loader = DataLoader(val_set, batch_size=bs, num_workers=6, pin_memory=True,
                            sampler=DistributedSampler(val_set, shuffle=False))

    model = timm.create_model(cfg["model"], pretrained=False, num_classes=1000,
                              drop_path_rate=cfg.get("drop_path", 0.1)).to(device)
    # linear scaling rule: base lr is given for 512 images per step
    lr = cfg["base_lr"] * bs * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
    epochs = cfg["epochs"]
    scheduler = CosineLRScheduler(optimizer, t_initial=epochs, warmup_t=cfg["warmup_epochs"],
                                  warmup_lr_init=1e-6, lr_min=1e-5)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch, start_iter, best = 0, 0, 0.0
    resume_file = checkpoint_path(cfg, "last.pth") if cfg["resume"] == "auto" else cfg["resume"]
    if cfg["resume"] != "none" and os.path.isfile(resume_file):
        state = torch.load(resume_file, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, start_iter, best = state["epoch"], state["iter"], state["best"]
        if rank == 0:
            print(f"=> resumed {resume_file}: epoch {start_epoch} iter {start_iter}")

    model = DistributedDataParallel(model, device_ids=[local_rank])

    stop = torch.zeros(1, device=device)
    for epoch in range(start_epoch, epochs):
        offset_iters = start_iter if epoch == start_epoch else 0
        train_sampler.set_epoch(epoch, offset=offset_iters * bs)
        scheduler.step(epoch)
        model.train()
        tic = time.time()
        for it, (images, labels) in enumerate(train_loader, start=offset_iters):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            images, labels = mixup(images, labels)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - tic:.1f}s)", flush=True)

            stop.fill_(1.0 if StopFlag.raised else 0.0)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or (it + 1) % cfg["save_every_iters"] == 0:
                if rank == 0:
                    write_checkpoint(cfg, {"model": model.module.state_dict(),
                                           "optimizer": optimizer.state_dict(),
                                           "scheduler": scheduler.state_dict(),
                                           "epoch": epoch, "iter": it + 1, "best": best})
                dist.barrier()
            if stop.item():
                break
        if stop.item():
            if rank == 0:
                print("SIGTERM received, checkpoint saved, exiting")
            break

        acc = validate(model, val_loader, device)
        if rank == 0:
            is_best = acc > best
            best = max(best, acc)
            print(f"epoch {epoch}: top1 {acc * 100:.2f} (best {best * 100:.2f})")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "iter": 0, "best": best}
            write_checkpoint(cfg, state)
            if is_best:
                torch.save(state["model"], checkpoint_path(cfg, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
