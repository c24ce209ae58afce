"""Data pruning by EL2N scores (Paul et al., 2021), two stages, DDP.

stage "proxy": train a small proxy network for a few epochs and save it.
stage "main":  load the proxy, score every training sample with
               EL2N = || softmax(f(x)) - onehot(y) ||_2,
               drop the easiest `--prune-frac` of the data and train the
               full model on the hardest remainder.

    torchrun --nproc_per_node=8 20_el2n_pruning_two_stage.py --stage proxy --proxy-epochs 20
    torchrun --nproc_per_node=8 20_el2n_pruning_two_stage.py --stage main --prune-frac 0.3
"""
import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def init_dist():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return Env(dist.get_rank(), dist.get_world_size(), local_rank, torch.device("cuda", local_rank))


def cifar_resnet(arch, num_classes=10):
    m = getattr(torchvision.models, arch)(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def datasets(root, env):
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.ToTensor(), norm])
    if env.rank == 0:
        torchvision.datasets.CIFAR10(root, train=True, download=True)
        torchvision.datasets.CIFAR10(root, train=False, download=True)
    dist.barrier()
    return (torchvision.datasets.CIFAR10(root, train=True, transform=aug),
            torchvision.datasets.CIFAR10(root, train=True, transform=plain),
            torchvision.datasets.CIFAR10(root, train=False, transform=plain))


def train_epochs(model, train_set, env, epochs, batch_size, lr, tag, test_set=None):
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader), pct_start=0.15)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        s = torch.zeros(2, device=env.device)
        for x, y in loader:
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            s += torch.stack([loss.detach().float(), torch.ones((), device=env.device)])
        dist.all_reduce(s)
        msg = f"[{tag}] epoch {epoch} loss {(s[0] / s[1]).item():.4f}"
        if test_set is not None:
            msg += f" test_acc {accuracy(model.module, test_set, env):.4f}"
        if env.rank == 0:
            print(msg, flush=True)


@torch.no_grad()
def accuracy(model, test_set, env):
    model.eval()
    loader = DataLoader(Subset(test_set, range(env.rank, len(test_set), env.world)), batch_size=1000, num_workers=4)
    c = torch.zeros(2, device=env.device)
    for x, y in loader:
        x, y = x.to(env.device), y.to(env.device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


@torch.no_grad()
def el2n_scores(model, score_set, env, num_classes=10):
    model.eval()
    n = len(score_set)
    ids = list(range(env.rank, n, env.world))
    loader = DataLoader(Subset(score_set, ids), batch_size=1000, num_workers=4)
    scores = torch.zeros(n, device=env.device)
    pos = 0
    for x, y in loader:
        x, y = x.to(env.device), y.to(env.device)
        p = model(x).float().softmax(-1)
        err = (p - F.one_hot(y, num_classes).float()).norm(dim=1)
        scores[torch.tensor(ids[pos:pos + len(y)], device=env.device)] = err
        pos += len(y)
    dist.all_reduce(scores)  # disjoint strided shards
    return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["proxy", "main"], required=True)
    ap.add_argument("--root", default="./data")
    ap.add_argument("--proxy-arch", default="resnet18")
    ap.add_argument("--proxy-epochs", type=int, default=20)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="per 512 images")
    ap.add_argument("--prune-frac", type=float, default=0.3)
    ap.add_argument("--workdir", default="runs/el2n")
    args = ap.parse_args()

    env = init_dist()
    torch.manual_seed(0)
    train_aug, train_plain, test = datasets(args.root, env)
    lr = args.lr * args.batch_size * env.world / 512
    proxy_path = os.path.join(args.workdir, f"proxy_{args.proxy_arch}_{args.proxy_epochs}ep.pt")

    if args.stage == "proxy":
        proxy = DDP(cifar_resnet(args.proxy_arch).to(env.device), device_ids=[env.local_rank])
        train_epochs(proxy, train_aug, env, args.proxy_epochs, args.batch_size, lr, "proxy")
        if env.rank == 0:
            os.makedirs(args.workdir, exist_ok=True)
            torch.save(proxy.state_dict(), proxy_path)
        dist.barrier()
    else:
        proxy = cifar_resnet(args.proxy_arch).to(env.device)
        proxy.load_state_dict(torch.load(proxy_path, map_location=env.device))
        scores = el2n_scores(proxy, train_plain, env)
        n_keep = int((1.0 - args.prune_frac) * len(scores))
        keep = scores.argsort(descending=True)[:n_keep].sort().values.cpu()
        if env.rank == 0:
            os.makedirs(args.workdir, exist_ok=True)
            torch.save({"scores": scores.cpu(), "keep": keep}, os.path.join(args.workdir, "el2n_keep.pt"))
            print(f"kept {n_keep}/{len(scores)} samples; mean EL2N kept {scores[keep.to(env.device)].mean():.3f} "
                  f"vs all {scores.mean():.3f}", flush=True)
        del proxy

        model = DDP(cifar_resnet(args.arch).to(env.device), device_ids=[env.local_rank])
        train_epochs(model, Subset(train_aug, keep.tolist()), env, args.epochs, args.batch_size, lr, "main",
                     test_set=test)
        if env.rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.workdir, f"{args.arch}_pruned.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
