"""iCaRL (Rebuffi et al., CVPR'17) on CIFAR-100, class-incremental, DDP version.

Sigmoid/BCE training with distillation on old classes, herding exemplar
selection with a fixed memory of K images, nearest-mean-of-exemplars (NME)
classifier at test time.

    torchrun --standalone --nproc_per_node=4 02_icarl_ncm.py --data ~/data --increment 10
"""
import argparse
import copy
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger("icarl")


# ----------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = None
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        o = F.relu(self.bn1(self.conv1(x)))
        o = self.bn2(self.conv2(o))
        return F.relu(o + (x if self.shortcut is None else self.shortcut(x)))


class ResNet32(nn.Module):
    def __init__(self, num_classes=100, n=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.stage1 = self._make(16, 16, n, 1)
        self.stage2 = self._make(16, 32, n, 2)
        self.stage3 = self._make(32, 64, n, 2)
        self.fc = nn.Linear(64, num_classes)

    @staticmethod
    def _make(inp, out, n, stride):
        return nn.Sequential(BasicBlock(inp, out, stride), *[BasicBlock(out, out) for _ in range(n - 1)])

    def features(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.stage3(self.stage2(self.stage1(x)))
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, x):
        return self.fc(self.features(x))


# ----------------------------------------------------------------------------- data
class Remap(Dataset):
    def __init__(self, base, indices, remap):
        self.base, self.indices, self.remap = base, list(indices), remap

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, y = self.base[self.indices[i]]
        return x, int(self.remap[y])


@torch.no_grad()
def extract_features(net, dataset, device):
    loader = DataLoader(dataset, batch_size=256, shuffle=False, num_workers=4)
    net.eval()
    feats = []
    for x, _ in loader:
        feats.append(F.normalize(net.features(x.to(device)), dim=1).cpu())
    return torch.cat(feats)


def herding(feats, m):
    mu = feats.mean(0)
    running = torch.zeros_like(mu)
    selected = []
    for k in range(1, min(m, feats.size(0)) + 1):
        d = ((mu.unsqueeze(0) - (running.unsqueeze(0) + feats) / k) ** 2).sum(1)
        if selected:
            d[selected] = float("inf")
        i = int(d.argmin())
        selected.append(i)
        running += feats[i]
    return selected


@torch.no_grad()
def nme_accuracy(net, loader, means, device, n_seen):
    net.eval()
    correct = np.zeros(n_seen)
    count = np.zeros(n_seen)
    for x, y in loader:
        f = F.normalize(net.features(x.to(device)), dim=1)
        pred = torch.cdist(f, means[:n_seen].to(device)).argmin(1).cpu()
        for c in range(n_seen):
            mask = y == c
            count[c] += mask.sum().item()
            correct[c] += (pred[mask] == c).sum().item()
    return correct, count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./checkpoints/icarl")
    parser.add_argument("--increment", type=int, default=10)
    parser.add_argument("--memory", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=70)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--batch_size", type=int, default=128, help="total over all GPUs")
    parser.add_argument("--wd", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=1993)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf)
    train_plain = datasets.CIFAR100(args.data, train=True, transform=test_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf)

    class_order = np.random.RandomState(args.seed).permutation(100)
    remap = np.argsort(class_order)  # original label -> incremental label
    train_targets = remap[np.asarray(train_set.targets)]
    test_targets = remap[np.asarray(test_set.targets)]

    net = ResNet32(num_classes=100).to(device)
    model = DDP(net, device_ids=[local_rank])
    old_net = None
    memory = {}  # incremental class id -> list of train indices (herding order)
    n_tasks = 100 // args.increment
    acc_matrix = np.zeros((n_tasks, n_tasks))
    per_gpu_bs = args.batch_size // world

    for task in range(n_tasks):
        n_old, n_seen = task * args.increment, (task + 1) * args.increment
        new_idx = np.where((train_targets >= n_old) & (train_targets < n_seen))[0].tolist()
        mem_idx = [i for c in sorted(memory) for i in memory[c]]
        data = Remap(train_set, new_idx + mem_idx, remap)
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=per_gpu_bs, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)

        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[49, 63], gamma=0.2)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            stats = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, :n_seen]
                target = F.one_hot(y, 100)[:, :n_seen].float()
                if old_net is not None:
                    with torch.no_grad():
                        target[:, :n_old] = torch.sigmoid(old_net(x)[:, :n_old])
                loss = F.binary_cross_entropy_with_logits(logits, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                stats += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
            sched.step()
            dist.all_reduce(stats)
            if epoch % 10 == 0 or epoch == args.epochs - 1:
                log.info("task %d epoch %d loss %.4f", task, epoch, (stats[0] / stats[1]).item())

        # ---- exemplar management + class means (rank 0), then broadcast
        m = args.memory // n_seen
        payload = [None, None]
        if rank == 0:
            for c in memory:
                memory[c] = memory[c][:m]
            means = torch.zeros(100, net.fc.in_features)
            for c in range(n_seen):
                if c >= n_old:
                    idx = np.where(train_targets == c)[0]
                    feats = extract_features(model, Subset(train_plain, idx.tolist()), device)
                    memory[c] = [int(idx[i]) for i in herding(feats, m)]
                feats = extract_features(net, Subset(train_plain, memory[c]), device)
                means[c] = F.normalize(feats.mean(0), dim=0)
            payload = [memory, means]
        dist.broadcast_object_list(payload, src=0)
        memory, means = payload

        # ---- NME evaluation on all seen tasks
        if rank == 0:
            test_idx = np.where(test_targets < n_seen)[0].tolist()
            tl = DataLoader(Remap(test_set, test_idx, remap), batch_size=256, num_workers=4)
            correct, count = nme_accuracy(net, tl, means, device, n_seen)
            for j in range(task + 1):
                sl = slice(j * args.increment, (j + 1) * args.increment)
                acc_matrix[task, j] = 100.0 * correct[sl].sum() / count[sl].sum()
            log.info("task %d NME acc per task: %s | avg inc acc %.2f", task,
                     np.round(acc_matrix[task, :task + 1], 1).tolist(),
                     100.0 * correct.sum() / count.sum())
            os.makedirs(args.out, exist_ok=True)
            torch.save({"net": net.state_dict(), "memory": memory, "means": means,
                        "acc": acc_matrix, "task": task}, os.path.join(args.out, f"icarl_t{task}.pth"))
        dist.barrier()

        old_net = copy.deepcopy(net).eval()
        old_net.requires_grad_(False)

    if rank == 0:
        np.savetxt(os.path.join(args.out, "acc_matrix.txt"), acc_matrix, fmt="%.2f")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
