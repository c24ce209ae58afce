# Class-incremental Split-CIFAR100 (10 tasks x 10 classes) with EWC regularisation, DDP version
# torchrun --nproc_per_node=2 11_continual_ewc.py --ewc_lambda 5000 --epochs_per_task 30
import os
import copy
import argparse
import datetime

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import torchvision.transforms as transforms
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description='EWC continual learning')
parser.add_argument('--data_dir', default='./data')
parser.add_argument('--n_tasks', type=int, default=10)
parser.add_argument('--epochs_per_task', type=int, default=30)
parser.add_argument('--batch_size', type=int, default=128)
parser.add_argument('--lr', type=float, default=0.1)
parser.add_argument('--ewc_lambda', type=float, default=5000.)
parser.add_argument('--fisher_samples', type=int, default=2000)
parser.add_argument('--class_order_seed', type=int, default=1993)
parser.add_argument('--ckpt_dir', default='ckpt_ewc')
opt = parser.parse_args()


class ResNet32Feat(nn.Module):
    """small resnet used in iCaRL / EWC papers, with one shared classifier for all classes"""

    def __init__(self, num_classes=100):
        super().__init__()
        net = torchvision.models.resnet18(num_classes=num_classes)
        net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        self.net = net
        self.fisher = {}
        self.star = {}

    def forward(self, x):
        return self.net(x)

    @torch.no_grad()
    def consolidate(self, fisher):
        for n, p in self.named_parameters():
            if n in fisher:
                old = self.fisher.get(n, torch.zeros_like(p))
                self.fisher[n] = old + fisher[n]
                self.star[n] = p.detach().clone()

    def ewc_penalty(self):
        if not self.fisher:
            return torch.zeros((), device=next(self.parameters()).device)
        loss = 0.
        for n, p in self.named_parameters():
            if n in self.fisher:
                loss = loss + (self.fisher[n] * (p - self.star[n]) ** 2).sum()
        return loss / 2


def split_tasks(targets, order, n_tasks):
    per = len(order) // n_tasks
    targets = np.asarray(targets)
    tasks = []
    for t in range(n_tasks):
        cls = order[t * per:(t + 1) * per]
        tasks.append((cls, np.where(np.isin(targets, cls))[0].tolist()))
    return tasks


def estimate_fisher(model, dataset, idx, seen_classes, device):
    """diagonal empirical fisher on this rank's share of `idx`, averaged over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    my_idx = idx[:opt.fisher_samples][rank::world]
    loader = DataLoader(Subset(dataset, my_idx), batch_size=1, shuffle=False, num_workers=2)
    fisher = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        model.zero_grad()
        logits = model(x)[:, seen_classes]
        F.log_softmax(logits, 1).gather(1, logits.argmax(1, keepdim=True)).sum().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                fisher[n] += p.grad.detach() ** 2
    count = torch.tensor(float(len(my_idx)), device=device)
    dist.all_reduce(count)
    for n in fisher:
        dist.all_reduce(fisher[n])
        fisher[n] /= count
    model.zero_grad()
    return fisher


@torch.no_grad()
def evaluate(model, test_set, tasks_so_far, seen_classes, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    res = torch.zeros(len(tasks_so_far), 2, device=device)
    for t, (cls, idx) in enumerate(tasks_so_far):
        loader = DataLoader(Subset(test_set, idx[rank::world]), batch_size=256, num_workers=2)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            pred = torch.tensor(seen_classes, device=device)[model(x)[:, seen_classes].argmax(1)]
            res[t, 0] += (pred == y).sum()
            res[t, 1] += y.numel()
    dist.all_reduce(res)
    return (res[:, 0] / res[:, 1]).tolist()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl', timeout=datetime.timedelta(minutes=60))
    rank = dist.get_rank()
    device = torch.device('cuda', local_rank)

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    tr = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), norm])
    te = transforms.Compose([transforms.ToTensor(), norm])
    train_set = torchvision.datasets.CIFAR100(opt.data_dir, train=True, transform=tr)
    fisher_set = torchvision.datasets.CIFAR100(opt.data_dir, train=True, transform=te)
    test_set = torchvision.datasets.CIFAR100(opt.data_dir, train=False, transform=te)
    order = np.random.RandomState(opt.class_order_seed).permutation(100).tolist()
    train_tasks = split_tasks(train_set.targets, order, opt.n_tasks)
    test_tasks = split_tasks(test_set.targets, order, opt.n_tasks)

    torch.manual_seed(0)
    model = DDP(ResNet32Feat(100).to(device), device_ids=[local_rank])
    if rank == 0:
        os.makedirs(opt.ckpt_dir, exist_ok=True)

    seen = []
    for t in range(opt.n_tasks):
        cls, idx = train_tasks[t]
        seen = seen + list(cls)
        label_map = torch.full((100,), -1, dtype=torch.long, device=device)
        label_map[torch.tensor(seen, device=device)] = torch.arange(len(seen), device=device)
        sub = Subset(train_set, idx)
        sampler = DistributedSampler(sub, shuffle=True)
        loader = DataLoader(sub, batch_size=opt.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(opt.epochs_per_task * .6),
                                                                 int(opt.epochs_per_task * .85)], 0.1)
        for ep in range(opt.epochs_per_task):
            sampler.set_epoch(ep)
            model.train()
            stats = torch.zeros(3, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, seen]
                ce = F.cross_entropy(logits, label_map[y])
                reg = model.ewc_penalty()
                loss = ce + opt.ewc_lambda * reg
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                stats += torch.stack([ce.detach(), reg.detach(), torch.ones((), device=device)])
            sched.step()
            dist.all_reduce(stats)
            if rank == 0 and (ep + 1) % 10 == 0:
                print('task %d ep %d ce %.3f ewc %.5f' % (t, ep + 1, stats[0] / stats[2], stats[1] / stats[2]),
                      flush=True)

        fisher = estimate_fisher(model.module, fisher_set, idx, seen, device)
        model.module.consolidate(fisher)
        accs = evaluate(model.module, test_set, test_tasks[:t + 1], seen, device)
        if rank == 0:
            print('after task %d: per-task acc %s avg %.4f' % (t, ['%.3f' % a for a in accs], np.mean(accs)),
                  flush=True)
            torch.save({'model': model.module.state_dict(), 'fisher': model.module.fisher,
                        'star': model.module.star, 'task': t}, os.path.join(opt.ckpt_dir, 'task%d.pt' % t))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
