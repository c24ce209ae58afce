"""PBT with torch.multiprocessing.spawn, one member per GPU, MobileNetV2 on CIFAR-10.

Each member logs to its own TensorBoard sub-directory (``<logdir>/member_<k>``)
so the whole population shows up as separate runs.  Exploit/explore through
checkpoint files in ``<logdir>/ckpt``.

    python pbt_spawn.py --nprocs 8 --logdir runs/pbt_mbv2
"""
import argparse
import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="./data")
    ap.add_argument("--logdir", default="runs/pbt_mbv2")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--ready", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--resample-prob", type=float, default=0.25)
    return ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SPACE = {
    "lr": lambda r: 10 ** r.uniform(-2.3, -0.7),
    "weight_decay": lambda r: 10 ** r.uniform(-5, -3),
    "label_smoothing": lambda r: r.uniform(0.0, 0.2),
}


def explore(hp, rng, resample_prob):
    new = {}
    for k, v in hp.items():
        if rng.random() < resample_prob:
            new[k] = SPACE[k](rng)
        else:
            new[k] = v * rng.choice([0.8, 1.2])
    new["label_smoothing"] = min(new["label_smoothing"], 0.3)
    return new


def loaders(data_dir, batch_size):
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train = torchvision.datasets.CIFAR10(
        data_dir, train=True, download=False,
        transform=T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR10(data_dir, train=False, download=False,
                                        transform=T.Compose([T.ToTensor(), norm]))
    return (DataLoader(train, batch_size, shuffle=True, num_workers=4, pin_memory=True,
                       drop_last=True, persistent_workers=True),
            DataLoader(test, 1000, num_workers=2, pin_memory=True))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = 0
    for x, y in loader:
        correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
    model.train()
    return correct / len(loader.dataset)


def worker(rank, world_size, args, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    rng = random.Random(rank * 7717 + 13)
    torch.manual_seed(rank)

    hp = {k: f(rng) for k, f in SPACE.items()}
    writer = SummaryWriter(os.path.join(args.logdir, f"member_{rank}"))
    train_loader, test_loader = loaders(args.data, args.batch_size)

    model = torchvision.models.mobilenet_v2(num_classes=10)
    # CIFAR: keep 32x32 resolution longer
    model.features[0][0].stride = (1, 1)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9, nesterov=True,
                          weight_decay=hp["weight_decay"])
    ckpt_dir = os.path.join(args.logdir, "ckpt")

    step = 0
    for epoch in range(1, args.epochs + 1):
        for x, y in train_loader:
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=hp["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        acc = evaluate(model, test_loader, device)
        writer.add_scalar("val/acc", acc, step)
        for k, v in hp.items():
            writer.add_scalar(f"hparams/{k}", v, step)

        if epoch % args.ready or epoch == args.epochs:
            continue

        board = [None] * world_size
        dist.all_gather_object(board, (acc, rank))
        board.sort(key=lambda t: (-t[0], t[1]))
        n = max(1, world_size // 5)
        top = [r for _, r in board[:n]]
        bottom = [r for _, r in board[-n:]]

        if rank in top:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hp": hp},
                       os.path.join(ckpt_dir, f"member_{rank}.pt"))
        dist.barrier()
        if rank in bottom:
            donor = rng.choice(top)
            ck = torch.load(os.path.join(ckpt_dir, f"member_{donor}.pt"), map_location=device)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            hp = explore(ck["hp"], rng, args.resample_prob)
            for g in opt.param_groups:
                g["lr"], g["weight_decay"] = hp["lr"], hp["weight_decay"]
            writer.add_text("pbt", f"epoch {epoch}: exploited member {donor}", step)
        dist.barrier()

    board = [None] * world_size
    dist.all_gather_object(board, (acc, rank, hp))
    best_acc, best_rank, best_hp = max(board, key=lambda t: (t[0], -t[1]))
    if rank == best_rank:
        torch.save({"model": model.state_dict(), "hp": best_hp, "acc": best_acc},
                   os.path.join(args.logdir, "best.pt"))
        print(f"best member {best_rank}: acc {best_acc:.4f} hp {best_hp}", flush=True)
    writer.close()
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    # download once, before the workers exist
    torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    os.makedirs(os.path.join(args.logdir, "ckpt"), exist_ok=True)
    port = free_port()
    mp.spawn(worker, args=(args.nprocs, args, port), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
