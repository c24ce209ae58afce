# Early-exit student for the wake-up classifier on the MCU+NPU board.
#
# Student: ResNet-like backbone with two auxiliary exits (after stage 2 and 3),
# trained by self + teacher distillation. Exits are switched on progressively:
#   epochs [0, exit3_start)            -> final head only
#   epochs [exit3_start, exit2_start)  -> + exit after stage 3
#   epochs [exit2_start, ...)          -> + exit after stage 2
# so for the first epochs the exit heads take no part in the loss.
#
#   torchrun --nproc_per_node=4 08_early_exit_kd.py --train-list lists/train.txt --val-list lists/val.txt
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import resnet34, resnet152


class ListDataset(Dataset):
    def __init__(self, list_file, transform):
        with open(list_file) as f:
            rows = [line.strip().split() for line in f if line.strip()]
        self.items = [(path, int(label)) for path, label in rows]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), label


class ExitHead(nn.Module):
    def __init__(self, c, num_classes):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(c, 256, 3, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1))


class EarlyExitNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(base.conv1, base.bn1, base.relu, base.maxpool, base.layer1)
        self.layer2, self.layer3, self.layer4 = base.layer2, base.layer3, base.layer4
        self.exit2 = ExitHead(128, num_classes)
        self.exit3 = ExitHead(256, num_classes)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x, exits=("final",)):
        out = {}
        x = self.layer2(self.stem(x))
        if "exit2" in exits:
            out["exit2"] = self.exit2(x)
        x = self.layer3(x)
        if "exit3" in exits:
            out["exit3"] = self.exit3(x)
        x = self.layer4(x)
        out["final"] = self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return out


def active_exits(epoch, args):
    exits = ["final"]
    if epoch >= args.exit3_start:
        exits.append("exit3")
    if epoch >= args.exit2_start:
        exits.append("exit2")
    return tuple(exits)


def distill(s, t, T):
    return F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean") * T ** 2


@torch.no_grad()
def evaluate_rank0(model, loader, device):
    """Runs on rank 0 only, on the unwrapped module: no collectives in here."""
    model.eval()
    names = ("exit2", "exit3", "final")
    correct = {k: 0 for k in names}
    n = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x, exits=names)
        for k in names:
            correct[k] += (out[k].argmax(1) == y).sum().item()
        n += y.numel()
    return {k: 100.0 * v / n for k, v in correct.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--val-list", required=True)
    ap.add_argument("--teacher-ckpt", default="weights/r152_wakeup.pth")
    ap.add_argument("--num-classes", type=int, default=35)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--exit3-start", type=int, default=10)
    ap.add_argument("--exit2-start", type=int, default=20)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.2, help="for the global batch")
    ap.add_argument("--T", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/early_exit_kd")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = ListDataset(args.train_list, transforms.Compose([
        transforms.RandomResizedCrop(192), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_ds = ListDataset(args.val_list, transforms.Compose([
        transforms.Resize(220), transforms.CenterCrop(192), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, shuffle=False, num_workers=args.workers)

    teacher = resnet152(num_classes=args.num_classes)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location=f"cuda:{local_rank}"))
    teacher.to(device).eval().requires_grad_(False)

    student = EarlyExitNet(args.num_classes).to(device)
    # exit heads are idle until their start epoch, hence find_unused_parameters
    student = DDP(student, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()
    exit_w = {"final": 1.0, "exit3": 0.5, "exit2": 0.3}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        exits = active_exits(epoch, args)
        loss_sum = torch.zeros(2, device=device)
        t0 = time.time()
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x).float()
                outs = student(x, exits=exits)
            loss = 0.0
            for name, logits in outs.items():
                logits = logits.float()
                loss = loss + exit_w[name] * (0.7 * distill(logits, t_logits, args.T)
                                              + 0.3 * F.cross_entropy(logits, y))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1

        dist.all_reduce(loss_sum)
        if rank == 0:
            accs = evaluate_rank0(student.module, val_loader, device)
            print(f"epoch {epoch} exits={exits} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"acc exit2/exit3/final {accs['exit2']:.2f}/{accs['exit3']:.2f}/{accs['final']:.2f} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": student.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
