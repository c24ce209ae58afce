"""Noisy Student self-training on CIFAR-10 (4k labels), multi-GPU.

teacher_0 is trained on the labelled split only.  In round r the teacher
produces soft targets for the unlabelled split (clean inputs), and a student is
trained with noise (RandAugment + dropout + stochastic depth) on
labelled + soft-pseudo-labelled data.  The student becomes the next teacher.

    torchrun --nproc_per_node=4 noisy_student_wandb.py --rounds 3 --wandb-project noisy-student
"""
import argparse
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/scratch/data")
    p.add_argument("--out", default="/scratch/runs/noisy_student")
    p.add_argument("--n-labeled", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--wandb-project", default="noisy-student")
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


class SoftTargets(Dataset):
    """Wraps a dataset and replaces hard labels by a fixed (N, C) soft label table."""

    def __init__(self, base, indices, soft):
        self.base, self.indices, self.soft = base, indices, soft

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, _ = self.base[self.indices[i]]
        return x, self.soft[i]


class OneHot(Dataset):
    def __init__(self, base, indices, n_classes=10):
        self.base, self.indices, self.n = base, indices, n_classes

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, y = self.base[self.indices[i]]
        return x, F.one_hot(torch.tensor(y), self.n).float()


def make_net(noisy):
    net = timm.create_model("resnet26d", pretrained=False, num_classes=10,
                            drop_rate=0.3 if noisy else 0.0,
                            drop_path_rate=0.2 if noisy else 0.0)
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)


@torch.no_grad()
def soft_labels(net, dataset, indices, device, world, T):
    sub = Subset(dataset, indices)
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=512, sampler=sampler, num_workers=6)
    pos = torch.tensor(list(sampler), device=device)
    net.eval()
    probs = torch.cat([F.softmax(net(x.to(device)) / T, 1) for x, _ in loader])
    all_pos = [torch.empty_like(pos) for _ in range(world)]
    all_p = [torch.empty_like(probs) for _ in range(world)]
    dist.all_gather(all_pos, pos)
    dist.all_gather(all_p, probs)
    out = torch.empty(len(indices), probs.size(1), device=device)
    out[torch.cat(all_pos)] = torch.cat(all_p)
    return out.cpu()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        s[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def train(model, dataset, args, device, rank, rnd, test_loader):
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed + rnd)
    loader = DataLoader(dataset, batch_size=args.bs, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4,
                          nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, target in loader:
            x, target = x.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = torch.sum(-target * F.log_softmax(logits.float(), 1), 1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            wandb.log({f"round{rnd}/loss": loss.item(), f"round{rnd}/test_acc": acc,
                       "lr": sched.get_last_lr()[0]})
    return acc


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.wandb_project, config=vars(args),
               name=f"ns-{args.n_labeled}-r{args.rounds}")

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    weak = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), norm])
    noisy = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                transforms.RandAugment(2, 10), transforms.ToTensor(), norm])
    clean = transforms.Compose([transforms.ToTensor(), norm])

    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    tr_weak = datasets.CIFAR10(args.data, train=True, transform=weak)
    tr_noisy = datasets.CIFAR10(args.data, train=True, transform=noisy)
    tr_clean = datasets.CIFAR10(args.data, train=True, transform=clean)
    test = datasets.CIFAR10(args.data, train=False, transform=clean)
    test_loader = DataLoader(test, batch_size=512, num_workers=4,
                             sampler=DistributedSampler(test, shuffle=False))

    # balanced labelled split, same on every rank
    rng = np.random.RandomState(args.seed)
    y = np.array(tr_weak.targets)
    lab = np.concatenate([rng.choice(np.where(y == c)[0], args.n_labeled // 10, replace=False)
                          for c in range(10)]).tolist()
    lab_set = set(lab)
    unl = [i for i in range(len(y)) if i not in lab_set]

    teacher = DDP(make_net(noisy=False).to(device), device_ids=[local_rank])
    acc = train(teacher, OneHot(tr_weak, lab), args, device, rank, 0, test_loader)
    if rank == 0:
        torch.save(teacher.module.state_dict(), os.path.join(args.out, "teacher_r0.pt"))

    for rnd in range(1, args.rounds + 1):
        soft = soft_labels(teacher.module, tr_clean, unl, device, world, args.temperature)
        data = ConcatDataset([OneHot(tr_noisy, lab), SoftTargets(tr_noisy, unl, soft)])
        student = DDP(make_net(noisy=True).to(device), device_ids=[local_rank])
        acc = train(student, data, args, device, rank, rnd, test_loader)
        if rank == 0:
            print(f"round {rnd}: student acc {acc:.4f}", flush=True)
            wandb.summary[f"acc_round{rnd}"] = acc
            torch.save(student.module.state_dict(), os.path.join(args.out, f"student_r{rnd}.pt"))
        teacher = student

    dist.barrier()
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
