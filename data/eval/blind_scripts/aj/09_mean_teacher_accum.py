"""Mean Teacher (Tarvainen & Valpola, 2017) semi-supervised CIFAR-10, 4000 labels.

fp16 with GradScaler, gradient accumulation (no all-reduce on the inner
micro-batches), EMA teacher as the consistency target.

    torchrun --nproc_per_node=4 09_mean_teacher_accum.py --config configs/mt_c10_4k.yaml
"""
import argparse
import contextlib
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision
import torchvision.transforms as T


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = a.resume
    return cfg


def labeled_split(targets, n_labeled, num_classes, seed):
    """Class-balanced labeled subset; seeded so every process picks the same images."""
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    per_class = n_labeled // num_classes
    idx = []
    for c in range(num_classes):
        idx.extend(rng.choice(np.where(targets == c)[0], per_class, replace=False).tolist())
    return sorted(idx)


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1))


class CNN13(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.net = nn.Sequential(
            conv_bn(3, 128), conv_bn(128, 128), conv_bn(128, 128), nn.MaxPool2d(2), nn.Dropout(0.5),
            conv_bn(128, 256), conv_bn(256, 256), conv_bn(256, 256), nn.MaxPool2d(2), nn.Dropout(0.5),
            nn.Conv2d(256, 512, 3), nn.BatchNorm2d(512), nn.LeakyReLU(0.1),
            nn.Conv2d(512, 256, 1), nn.BatchNorm2d(256), nn.LeakyReLU(0.1),
            nn.Conv2d(256, 128, 1), nn.BatchNorm2d(128), nn.LeakyReLU(0.1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.net(x))


def infinite(loader):
    while True:
        yield from loader


@torch.no_grad()
def ema_update(teacher, student, decay):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(decay).add_(s.detach(), alpha=1 - decay)
    for tb, sb in zip(teacher.buffers(), student.buffers()):
        tb.copy_(sb)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (net(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"] + rank)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    weak = T.Compose([T.RandomCrop(32, padding=2, padding_mode="reflect"), T.RandomHorizontalFlip(),
                      T.ToTensor(), norm])
    train_full = torchvision.datasets.CIFAR10(cfg["data_root"], train=True, transform=weak)
    test_set = torchvision.datasets.CIFAR10(cfg["data_root"], train=False,
                                            transform=T.Compose([T.ToTensor(), norm]))
    lab_idx = labeled_split(train_full.targets, cfg["n_labeled"], 10, cfg["split_seed"])
    labeled = Subset(train_full, lab_idx)

    lab_sampler = DistributedSampler(labeled, shuffle=True, seed=cfg["seed"])
    unl_sampler = DistributedSampler(train_full, shuffle=True, seed=cfg["seed"])
    lab_loader = DataLoader(labeled, batch_size=cfg["labeled_bs"], sampler=lab_sampler,
                            num_workers=2, drop_last=True, pin_memory=True)
    unl_loader = DataLoader(train_full, batch_size=cfg["unlabeled_bs"], sampler=unl_sampler,
                            num_workers=6, drop_last=True, pin_memory=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500)

    student = nn.SyncBatchNorm.convert_sync_batchnorm(CNN13()).to(device)
    model = DDP(student, device_ids=[local_rank])
    # copied after DDP has broadcast rank 0's initial weights into `student`
    teacher = copy.deepcopy(student)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    accum = cfg["accum_steps"]
    global_bs = (cfg["labeled_bs"] + cfg["unlabeled_bs"]) * accum * world
    lr = cfg["lr"] * global_bs / cfg["ref_batch"]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                                weight_decay=cfg["wd"])
    total_steps = cfg["epochs"] * cfg["steps_per_epoch"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps,
                                                    pct_start=0.02)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, global_step = 0, 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location=device)
        student.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, global_step = ck["epoch"] + 1, ck["global_step"]

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None

    for epoch in range(start_epoch, cfg["epochs"]):
        lab_sampler.set_epoch(epoch)
        unl_sampler.set_epoch(epoch)
        lab_iter = infinite(lab_loader)
        unl_iter = iter(unl_loader)
        model.train()
        for step in range(cfg["steps_per_epoch"]):
            for micro in range(accum):
                xl, yl = next(lab_iter)
                try:
                    xu, _ = next(unl_iter)
                except StopIteration:
                    unl_iter = iter(unl_loader)
                    xu, _ = next(unl_iter)
                xl, yl, xu = xl.to(device), yl.to(device), xu.to(device)
                x = torch.cat([xl, xu])
                sync = micro == accum - 1
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    with torch.autocast("cuda", dtype=torch.float16):
                        # single forward on the concatenated batch
                        logits = model(x)
                        with torch.no_grad():
                            t_logits = teacher(x)
                        sup = F.cross_entropy(logits[: xl.size(0)], yl)
                        w = cfg["cons_weight"] * min(1.0, global_step / cfg["rampup_steps"])
                        cons = F.mse_loss(logits.float().softmax(1), t_logits.float().softmax(1))
                        loss = (sup + w * cons) / accum
                    scaler.scale(loss).backward()

            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            ema_update(teacher, student, cfg["ema_decay"])
            global_step += 1

            if rank == 0 and global_step % 50 == 0:
                writer.add_scalar("loss/sup", sup.item(), global_step)
                writer.add_scalar("loss/cons", cons.item(), global_step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], global_step)

        acc_s = evaluate(student, test_loader, device)
        acc_t = evaluate(teacher, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: student {acc_s:.2f}  teacher {acc_t:.2f}")
            writer.add_scalar("test/student", acc_s, epoch)
            writer.add_scalar("test/teacher", acc_t, epoch)
            os.makedirs(cfg["ckpt_dir"], exist_ok=True)
            torch.save({"student": student.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "global_step": global_step},
                       os.path.join(cfg["ckpt_dir"], "mt_last.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
