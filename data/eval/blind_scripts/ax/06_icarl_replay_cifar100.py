"""Class-incremental CIFAR-100 (10 tasks x 10 classes) with exemplar replay and
logit distillation, iCaRL/LUCIR style. Multi-GPU with DDP.

torchrun --nproc_per_node=4 icarl_replay_cifar100.py --memory 2000
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--ckpt-dir", default="ckpt/icarl")
    p.add_argument("--tasks", type=int, default=10)
    p.add_argument("--memory", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=70)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=2.0, help="distillation temperature")
    p.add_argument("--class-order-seed", type=int, default=1993)
    return p.parse_args()


class IncrementalNet(nn.Module):
    def __init__(self):
        super().__init__()
        bb = torchvision.models.resnet18()
        bb.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        bb.maxpool = nn.Identity()
        bb.fc = nn.Identity()
        self.backbone = bb
        self.out_dim = 512
        self.fc = None

    def update_fc(self, n_classes):
        fc = nn.Linear(self.out_dim, n_classes)
        if self.fc is not None:
            old = self.fc.out_features
            fc.weight.data[:old] = self.fc.weight.data
            fc.bias.data[:old] = self.fc.bias.data
        self.fc = fc

    def extract_vector(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.backbone(x))


@torch.no_grad()
def herding(net, dataset, indices, m, device):
    """Pick m exemplars of one class whose mean feature tracks the class mean."""
    net.eval()
    loader = DataLoader(Subset(dataset, indices), batch_size=256, num_workers=4)
    feats = torch.cat([F.normalize(net.extract_vector(x.to(device)), dim=1) for x, _ in loader])
    mu = feats.mean(0)
    chosen, running = [], torch.zeros_like(mu)
    for k in range(1, min(m, len(indices)) + 1):
        cand = mu - (running + feats) / k
        dists = cand.norm(dim=1)
        if chosen:
            dists[chosen] = float("inf")
        i = int(dists.argmin())
        chosen.append(i)
        running += feats[i]
    return [indices[i] for i in chosen]


@torch.no_grad()
def accuracy(net, dataset, indices, device):
    sampler = DistributedSampler(Subset(dataset, indices), shuffle=False)
    loader = DataLoader(Subset(dataset, indices), batch_size=512, sampler=sampler, num_workers=4)
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        s[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    order = np.random.RandomState(args.class_order_seed).permutation(100)
    remap = np.zeros(100, dtype=np.int64)
    remap[order] = np.arange(100)
    target_tf = lambda y: int(remap[y])  # noqa: E731

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                     T.ColorJitter(0.25, 0.25), T.ToTensor(), T.Normalize(mean, std)])
    plain = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    train_aug = torchvision.datasets.CIFAR100(args.data, True, aug, target_tf)
    train_plain = torchvision.datasets.CIFAR100(args.data, True, plain, target_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, False, plain, target_tf)
    train_y = remap[np.array(train_aug.targets)]
    test_y = remap[np.array(test_set.targets)]

    per_task = 100 // args.tasks
    net = IncrementalNet()
    memory = {}  # class -> list of train indices
    start_task = 0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        start_task = ck["task"] + 1
        net.update_fc(start_task * per_task)
        net.load_state_dict(ck["model"])
        memory = ck["memory"]
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)

    for task in range(start_task, args.tasks):
        known = task * per_task
        total = known + per_task
        old_net = None
        if task > 0:
            old_net = copy.deepcopy(net).eval()
            for p in old_net.parameters():
                p.requires_grad_(False)
        net.update_fc(total)
        net.to(device)
        model = DDP(net, device_ids=[local_rank])

        new_idx = np.where((train_y >= known) & (train_y < total))[0].tolist()
        mem_idx = [i for c in sorted(memory) for i in memory[c]]
        task_set = Subset(train_aug, new_idx + mem_idx)
        sampler = DistributedSampler(task_set, shuffle=True, seed=task)
        loader = DataLoader(task_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=6, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        old_logits = old_net(x)
                    kd = F.kl_div(F.log_softmax(logits[:, :known] / args.T, 1),
                                  F.softmax(old_logits / args.T, 1),
                                  reduction="batchmean") * args.T ** 2
                    loss = loss + kd * known / total
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and epoch % 10 == 0:
                print(f"task {task} epoch {epoch} loss {loss.item():.3f}", flush=True)

        # rebuild the exemplar memory on rank 0 and share it
        m = args.memory // total
        if rank == 0:
            new_memory = {c: v[:m] for c, v in memory.items()}
            for c in range(known, total):
                cls_idx = np.where(train_y == c)[0].tolist()
                new_memory[c] = herding(net, train_plain, cls_idx, m, device)
        else:
            new_memory = None
        box = [new_memory]
        dist.broadcast_object_list(box, src=0)
        memory = box[0]

        seen_test = np.where(test_y < total)[0].tolist()
        acc = accuracy(net, test_set, seen_test, device)
        if rank == 0:
            print(f"== task {task}: classes 0..{total - 1} top-1 {acc:.4f}", flush=True)
            ck = {"task": task, "model": net.state_dict(), "memory": memory, "acc": acc}
            torch.save(ck, os.path.join(args.ckpt_dir, f"task{task}.pt"))
            torch.save(ck, last)
        dist.barrier()
        del model

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
