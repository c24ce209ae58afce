"""ViT-S/16 fine-tuning on Oxford Flowers-102, port of our big_vision/pmap config.

Config is written the JAX way: the *global* batch size and the lr for that batch
are fixed; the per-device batch and the number of accumulation steps are derived
from the number of devices so the optimisation is identical on 2, 4 or 8 GPUs.

    torchrun --nproc_per_node=4 11_vit_global_batch_accum.py --data /data/flowers102
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CONFIG = dict(
    model="vit_small_patch16_224.augreg_in21k",
    num_classes=102,
    global_batch_size=256,
    max_device_batch=32,  # what fits on one 24GB card
    base_lr=3e-3,  # for global_batch_size above
    weight_decay=1e-4,
    total_epochs=100,
    warmup_epochs=5,
    grad_clip_norm=1.0,
    patience=6,
    workdir="workdirs/vit_flowers",
)


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    for k, v in CONFIG.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    return ap.parse_args()


def derive_batching(cfg, world):
    """global = world * per_device * accum; keep per_device <= max_device_batch."""
    assert cfg.global_batch_size % world == 0, "global batch must divide the number of devices"
    per_replica = cfg.global_batch_size // world
    accum = max(1, math.ceil(per_replica / cfg.max_device_batch))
    while per_replica % accum:
        accum += 1
    return per_replica // accum, accum


def make_data(cfg, rank, world, per_device):
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(mean, std)])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    train = torchvision.datasets.Flowers102(cfg.data, split="train", transform=train_tf, download=False)
    val = torchvision.datasets.Flowers102(cfg.data, split="val", transform=eval_tf, download=False)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train, batch_size=per_device, sampler=sampler, drop_last=True,
                          num_workers=8, pin_memory=True, persistent_workers=True)
    # evaluation runs on the chief only, over the whole split
    val_dl = DataLoader(val, batch_size=128, shuffle=False, num_workers=8, pin_memory=True)
    return sampler, train_dl, val_dl


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    loss, correct, n = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        n += y.numel()
    net.train()
    return loss / n, correct / n


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_chief = rank == 0
    torch.manual_seed(0)

    per_device, accum = derive_batching(cfg, world)
    sampler, train_dl, val_dl = make_data(cfg, rank, world, per_device)
    steps_per_epoch = len(train_dl) // accum
    total_steps = cfg.total_epochs * steps_per_epoch
    warmup_steps = cfg.warmup_epochs * steps_per_epoch

    net = timm.create_model(cfg.model, pretrained=True, num_classes=cfg.num_classes, drop_path_rate=0.1).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.base_lr, momentum=0.9, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup_steps if s < warmup_steps
        else 0.5 * (1 + math.cos(math.pi * (s - warmup_steps) / max(1, total_steps - warmup_steps))))

    writer = None
    if is_chief:
        os.makedirs(cfg.workdir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.workdir, "tb"))
        print(f"devices={world} global_batch={cfg.global_batch_size} per_device={per_device} accum={accum} "
              f"steps/epoch={steps_per_epoch}")

    best_acc, bad_epochs, step = 0.0, 0, 0
    stop = torch.zeros(1, device=device)
    for epoch in range(cfg.total_epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        it = iter(train_dl)
        for _ in range(steps_per_epoch):
            opt.zero_grad(set_to_none=True)
            for micro in range(accum):
                x, y = next(it)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = micro == accum - 1
                ctx = torch.enable_grad() if sync else model.no_sync()
                with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / accum
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
            opt.step()
            sched.step()
            step += 1
            if is_chief and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item() * accum, step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        if is_chief:
            val_loss, val_acc = evaluate(model.module, val_dl, device)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            print(f"epoch {epoch + 1}: val_loss={val_loss:.4f} val_acc={val_acc:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if val_acc > best_acc:
                best_acc, bad_epochs = val_acc, 0
                torch.save(model.module.state_dict(), os.path.join(cfg.workdir, "best.pt"))
            else:
                bad_epochs += 1
            stop.fill_(1.0 if bad_epochs >= cfg.patience else 0.0)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if is_chief:
                print(f"early stopping, best val_acc={best_acc:.4f}")
            break

    if is_chief:
        writer.close()
        test = torchvision.datasets.Flowers102(cfg.data, split="test", transform=val_dl.dataset.transform)
        test_net = timm.create_model(cfg.model, pretrained=False, num_classes=cfg.num_classes).to(device)
        test_net.load_state_dict(torch.load(os.path.join(cfg.workdir, "best.pt"), map_location=device))
        _, test_acc = evaluate(test_net, DataLoader(test, batch_size=128, num_workers=8), device)
        print(f"test accuracy of best checkpoint: {test_acc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
