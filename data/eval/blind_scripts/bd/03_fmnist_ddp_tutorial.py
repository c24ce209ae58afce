"""
Fashion-MNIST with DistributedDataParallel -- step by step
==========================================================

Companion code for my blog post "DDP from scratch". Everything happens in this
one file:

    python 03_fmnist_ddp_tutorial.py --epochs 20 --patience 4

The script spawns one process per visible GPU with torch.multiprocessing.spawn.
"""
import os
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


# -----------------------------------------------------------------------------
# Step 1: the model. Nothing distributed here, it's a plain nn.Module.
# -----------------------------------------------------------------------------
class FashionCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(32, 64, kernel_size=3),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc1 = nn.Linear(64 * 6 * 6, 600)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(600, 120)
        self.fc3 = nn.Linear(120, 10)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.view(out.size(0), -1)
        out = self.drop(F.relu(self.fc1(out)))
        out = F.relu(self.fc2(out))
        return self.fc3(out)


# -----------------------------------------------------------------------------
# Step 2: process group helpers (same as the official tutorial)
# -----------------------------------------------------------------------------
def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # set the device first so that NCCL uses the right GPU
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def log(rank, *msg):
    if rank == 0:
        print(*msg, flush=True)


# -----------------------------------------------------------------------------
# Step 3: training and evaluation
# -----------------------------------------------------------------------------
def train_epoch(model, loader, optimizer, criterion, rank, world_size, epoch, log_every):
    model.train()
    for step, (images, labels) in enumerate(loader):
        images = images.cuda(rank, non_blocking=True)
        labels = labels.cuda(rank, non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()

        if step % log_every == 0:
            # average the loss over all GPUs just for printing.
            # every rank reaches this line at the same step because the
            # DistributedSampler gives every rank the same number of batches
            reduced = loss.detach().clone()
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
            reduced /= world_size
            log(rank, f"epoch {epoch} step {step:4d}/{len(loader)} loss {reduced.item():.4f}")


@torch.no_grad()
def evaluate(model, loader, device):
    """Plain single-GPU evaluation on the full test set (used on rank 0 only)."""
    model.eval()
    correct = 0
    total = 0
    loss_sum = 0.0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        out = model(images)
        loss_sum += F.cross_entropy(out, labels, reduction="sum").item()
        correct += (out.argmax(1) == labels).sum().item()
        total += labels.size(0)
    return loss_sum / total, correct / total


# -----------------------------------------------------------------------------
# Step 4: the function every process runs. mp.spawn gives us `rank` first.
# -----------------------------------------------------------------------------
def worker(rank, world_size, args):
    setup(rank, world_size, args.port)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train_set = datasets.FashionMNIST(args.data, train=True, download=False, transform=tf)
    test_set = datasets.FashionMNIST(args.data, train=False, download=False, transform=tf)

    # each process gets its own 1/world_size slice of the training set
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=512, shuffle=False, num_workers=2)

    model = FashionCNN().to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)

    # linear scaling rule: lr grows with the number of GPUs (global batch grows too)
    lr = args.lr * world_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()

    start_epoch = 1
    if args.resume and os.path.exists(args.ckpt):
        # the checkpoint was saved from cuda:0, remap it to this process' GPU
        state = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start_epoch = state["epoch"] + 1
        log(rank, f"resumed at epoch {start_epoch}")

    best_acc, bad_epochs = 0.0, 0
    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)  # different shuffle every epoch
        train_epoch(model, train_loader, optimizer, criterion, rank, world_size, epoch, args.log_every)

        # rank 0 evaluates and decides whether to stop; the decision is
        # broadcast so that all ranks leave the loop together
        stop = torch.zeros(1, device=device)
        if rank == 0:
            test_loss, acc = evaluate(model.module, test_loader, device)
            print(f"==> epoch {epoch}: test loss {test_loss:.4f}, acc {acc * 100:.2f}%")
            torch.save({"model": model.module.state_dict(),
                        "optim": optimizer.state_dict(),
                        "epoch": epoch}, args.ckpt)
            if acc > best_acc:
                best_acc, bad_epochs = acc, 0
                torch.save(model.module.state_dict(), "fmnist_best.pt")
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    print("no improvement, stopping early")
                    stop.fill_(1.0)
        dist.broadcast(stop, src=0)
        if stop.item() == 1.0:
            break

    log(rank, f"best test accuracy: {best_acc * 100:.2f}%")
    cleanup()


def main():
    parser = argparse.ArgumentParser("Fashion-MNIST DDP")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-3, help="lr for one GPU")
    parser.add_argument("--patience", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--ckpt", default="fmnist_last.pt")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    # download in the parent process, before any worker starts
    datasets.FashionMNIST(args.data, train=True, download=True)
    datasets.FashionMNIST(args.data, train=False, download=True)

    world_size = torch.cuda.device_count()
    assert world_size >= 1, "need at least one GPU"
    print(f"spawning {world_size} processes")
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
