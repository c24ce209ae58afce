"""Fine-tuning with exemplars (FT-E) baseline, FACIL-style training loop, DDP.

Growing multi-head network (one head per task, heads concatenated for
task-agnostic evaluation), 10% of each class held out as validation, learning
rate decayed on validation-loss plateaus (lr_patience / lr_factor / lr_min),
best-on-validation weights restored at every decay.

    torchrun --nproc_per_node=4 05_facil_finetune_exemplars.py --num_tasks 10 --num_exemplars 2000
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def conv3x3(i, o, s=1):
    return nn.Conv2d(i, o, 3, s, 1, bias=False)


class Block(nn.Module):
    def __init__(self, i, o, s=1):
        super().__init__()
        self.c1, self.b1 = conv3x3(i, o, s), nn.BatchNorm2d(o)
        self.c2, self.b2 = conv3x3(o, o), nn.BatchNorm2d(o)
        self.down = None if (s == 1 and i == o) else nn.Sequential(nn.Conv2d(i, o, 1, s, bias=False), nn.BatchNorm2d(o))

    def forward(self, x):
        r = x if self.down is None else self.down(x)
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + r)


class LLLNet(nn.Module):
    """ResNet-32 backbone + list of task heads."""

    def __init__(self):
        super().__init__()
        layers = [conv3x3(3, 16), nn.BatchNorm2d(16), nn.ReLU()]
        for i, o, s in [(16, 16, 1), (16, 32, 2), (32, 64, 2)]:
            layers += [Block(i, o, s)] + [Block(o, o) for _ in range(4)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.model = nn.Sequential(*layers)
        self.heads = nn.ModuleList()
        self.task_cls = []

    def add_head(self, num_outputs):
        self.heads.append(nn.Linear(64, num_outputs))
        self.task_cls.append(num_outputs)

    def forward(self, x):
        f = self.model(x)
        return [h(f) for h in self.heads]


def criterion(outputs, targets):
    return F.cross_entropy(torch.cat(outputs, dim=1), targets)


@torch.no_grad()
def valid_epoch(net, loader, device):
    net.eval()
    total_loss, total_acc, total_num = 0.0, 0.0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = net(x)
        total_loss += criterion(out, y).item() * len(y)
        total_acc += (torch.cat(out, 1).argmax(1) == y).sum().item()
        total_num += len(y)
    return total_loss / total_num, total_acc / total_num


@torch.no_grad()
def test_task(net, loader, task, offset, device):
    net.eval()
    hits_taw = hits_tag = n = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = net(x)
        hits_taw += (out[task].argmax(1) + offset[task] == y).sum().item()
        hits_tag += (torch.cat(out, 1).argmax(1) == y).sum().item()
        n += len(y)
    return hits_taw / n, hits_tag / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--datasets_path", default="../data")
    p.add_argument("--results_path", default="../results/ft_e")
    p.add_argument("--num_tasks", type=int, default=10)
    p.add_argument("--nepochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lr_min", type=float, default=1e-4)
    p.add_argument("--lr_factor", type=float, default=3.0)
    p.add_argument("--lr_patience", type=int, default=5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=2e-4)
    p.add_argument("--batch_size", type=int, default=128, help="global")
    p.add_argument("--num_exemplars", type=int, default=2000)
    p.add_argument("--validation", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    bs = args.batch_size // world

    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2009, 0.1984, 0.2023))
    trn_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), norm])
    tst_tf = transforms.Compose([transforms.ToTensor(), norm])
    trn_full = datasets.CIFAR100(args.datasets_path, train=True, transform=trn_tf)
    val_full = datasets.CIFAR100(args.datasets_path, train=True, transform=tst_tf)
    tst_full = datasets.CIFAR100(args.datasets_path, train=False, transform=tst_tf)

    # class order / train-val split / exemplar choice all come from one seeded RNG -> identical on all ranks
    rng = np.random.RandomState(args.seed)
    order = rng.permutation(100)
    remap = np.argsort(order)
    trn_targets = remap[np.asarray(trn_full.targets)]
    tst_targets = remap[np.asarray(tst_full.targets)]
    for ds in (trn_full, val_full, tst_full):
        ds.targets = remap[np.asarray(ds.targets)].tolist()
    cpt = 100 // args.num_tasks
    offset = [t * cpt for t in range(args.num_tasks)]

    trn_idx, val_idx = {}, {}
    for c in range(100):
        idx = rng.permutation(np.where(trn_targets == c)[0])
        n_val = int(round(args.validation * len(idx)))
        val_idx[c], trn_idx[c] = idx[:n_val].tolist(), idx[n_val:].tolist()

    net = LLLNet()
    exemplars = []
    acc_taw = np.zeros((args.num_tasks, args.num_tasks))
    acc_tag = np.zeros((args.num_tasks, args.num_tasks))

    for t in range(args.num_tasks):
        classes = range(offset[t], offset[t] + cpt)
        net.add_head(cpt)
        net.to(device)
        model = DDP(net, device_ids=[local_rank])

        trn = Subset(trn_full, [i for c in classes for i in trn_idx[c]] + exemplars)
        val = Subset(val_full, [i for c in classes for i in val_idx[c]])
        trn_sampler = DistributedSampler(trn, shuffle=True, seed=args.seed)
        val_sampler = DistributedSampler(val, shuffle=False)
        trn_loader = DataLoader(trn, batch_size=bs, sampler=trn_sampler, num_workers=4, pin_memory=True)
        val_loader = DataLoader(val, batch_size=bs, sampler=val_sampler, num_workers=4, pin_memory=True)

        lr = args.lr
        best_loss, patience = np.inf, args.lr_patience
        best_model = copy.deepcopy(net.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        for e in range(args.nepochs):
            clock0 = time.time()
            trn_sampler.set_epoch(e)
            model.train()
            for x, y in trn_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10000)
                optimizer.step()

            valid_loss, valid_acc = valid_epoch(net, val_loader, device)
            if rank == 0:
                print(f"| Task {t} Epoch {e + 1:3d}, time={time.time() - clock0:5.1f}s "
                      f"| Valid: loss={valid_loss:.3f}, TAg acc={100 * valid_acc:5.1f}% |", end="")
            if valid_loss < best_loss:
                best_loss = valid_loss
                best_model = copy.deepcopy(net.state_dict())
                patience = args.lr_patience
                if rank == 0:
                    print(" *", end="")
            else:
                patience -= 1
                if patience <= 0:
                    lr /= args.lr_factor
                    if rank == 0:
                        print(f" lr={lr:.1e}", end="")
                    if lr < args.lr_min:
                        if rank == 0:
                            print()
                        break
                    patience = args.lr_patience
                    optimizer.param_groups[0]["lr"] = lr
                    net.load_state_dict(best_model)
            if rank == 0:
                print(flush=True)
        net.load_state_dict(best_model)

        # random exemplars, fixed memory, same RNG on every rank
        per_class = args.num_exemplars // (offset[t] + cpt)
        ex_rng = np.random.RandomState(args.seed + t)
        exemplars = [i for c in range(offset[t] + cpt)
                     for i in ex_rng.choice(trn_idx[c], per_class, replace=False).tolist()]

        if rank == 0:
            for u in range(t + 1):
                tst = Subset(tst_full, np.where((tst_targets >= offset[u]) & (tst_targets < offset[u] + cpt))[0])
                acc_taw[t, u], acc_tag[t, u] = test_task(net, DataLoader(tst, batch_size=256, num_workers=4),
                                                         u, offset, device)
            print(f">>> Task {t}: TAw {100 * acc_taw[t, :t + 1].mean():.1f}% "
                  f"TAg {100 * acc_tag[t, :t + 1].mean():.1f}%", flush=True)
            os.makedirs(args.results_path, exist_ok=True)
            torch.save(net.state_dict(), os.path.join(args.results_path, f"task{t}.ckpt"))
            np.savetxt(os.path.join(args.results_path, "acc_taw.txt"), acc_taw, "%.4f")
            np.savetxt(os.path.join(args.results_path, "acc_tag.txt"), acc_tag, "%.4f")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
