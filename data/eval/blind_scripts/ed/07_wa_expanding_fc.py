"""Weight Aligning (WA, Zhao et al. CVPR 2020) for class-incremental CIFAR-100.

Knowledge distillation from the previous model + exemplar replay, the linear
classifier is expanded by `increment` outputs at every task and the norms of the
new class weights are aligned to the old ones after training.

    torchrun --nproc_per_node=4 07_wa_expanding_fc.py --init_cls 50 --increment 10
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class IncrementalNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        backbone = models.resnet18()
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.fc = nn.Linear(512, n_classes)

    @property
    def n_classes(self):
        return self.fc.out_features

    def expand(self, n_new):
        old = self.fc
        fc = nn.Linear(old.in_features, old.out_features + n_new)
        with torch.no_grad():
            fc.weight[:old.out_features] = old.weight
            fc.bias[:old.out_features] = old.bias
        self.fc = fc

    def align_weights(self, n_old):
        w = self.fc.weight.data
        gamma = w[:n_old].norm(dim=1).mean() / w[n_old:].norm(dim=1).mean()
        w[n_old:] *= gamma
        return gamma.item()

    def forward(self, x):
        return self.fc(self.backbone(x))


def kd_loss(logits, old_logits, T):
    return F.kl_div(F.log_softmax(logits / T, 1), F.softmax(old_logits / T, 1), reduction="batchmean") * T * T


@torch.no_grad()
def accuracy_per_task(net, loader, boundaries, device):
    net.eval()
    correct = np.zeros(len(boundaries) - 1)
    total = np.zeros(len(boundaries) - 1)
    for x, y in loader:
        pred = net(x.to(device)).argmax(1).cpu()
        for k in range(len(boundaries) - 1):
            m = (y >= boundaries[k]) & (y < boundaries[k + 1])
            correct[k] += (pred[m] == y[m]).sum().item()
            total[k] += m.sum().item()
    return 100.0 * correct / np.maximum(total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_path", default="./data")
    ap.add_argument("--logdir", default="./logs/wa")
    ap.add_argument("--init_cls", type=int, default=50)
    ap.add_argument("--increment", type=int, default=10)
    ap.add_argument("--memory_size", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=170)
    ap.add_argument("--init_lr", type=float, default=0.1)
    ap.add_argument("--milestones", type=int, nargs="+", default=[60, 100, 140])
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--base_batch", type=int, default=128, help="batch the lr was tuned for")
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    lr = args.init_lr * args.batch_size * world / args.base_batch

    norm = transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR100(args.data_path, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(args.data_path, train=False, transform=test_tf)

    order = np.random.RandomState(args.seed).permutation(100)
    remap = np.argsort(order)
    train_set.targets = remap[np.asarray(train_set.targets)].tolist()
    test_set.targets = remap[np.asarray(test_set.targets)].tolist()
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    boundaries = [0] + list(range(args.init_cls, 101, args.increment))
    n_tasks = len(boundaries) - 1

    net = IncrementalNet(args.init_cls).to(device)
    old_net = None
    memory = []
    acc_matrix = np.zeros((n_tasks, n_tasks))

    for t in range(n_tasks):
        lo, hi = boundaries[t], boundaries[t + 1]
        if t > 0:
            net.expand(hi - lo)
        model = DDP(net, device_ids=[local_rank], output_device=local_rank)

        idx = np.where((y_train >= lo) & (y_train < hi))[0].tolist() + memory
        data = Subset(train_set, idx)
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed + t)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                            pin_memory=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=args.milestones, gamma=0.1)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            meter = torch.zeros(3, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        old_logits = old_net(x)
                    loss_kd = kd_loss(logits[:, :lo], old_logits, args.T)
                    loss = (lo / hi) * loss_kd + (1 - lo / hi) * loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                meter += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                      torch.tensor(float(len(y)), device=device)])
            sched.step()
            dist.all_reduce(meter)
            if rank == 0 and (epoch + 1) % 10 == 0:
                print(f"task {t} ep {epoch + 1}/{args.epochs} loss {meter[0] / meter[2]:.3f} "
                      f"train acc {100 * meter[1] / meter[2]:.2f}", flush=True)

        if t > 0:
            gamma = net.align_weights(lo)
            if rank == 0:
                print(f"weight aligning gamma = {gamma:.4f}")

        # random exemplars, seeded identically on every rank
        per_class = args.memory_size // hi
        rs = np.random.RandomState(args.seed + t)
        memory = [int(i) for c in range(hi)
                  for i in rs.choice(np.where(y_train == c)[0], per_class, replace=False)]

        if rank == 0:
            test_loader = DataLoader(Subset(test_set, np.where(y_test < hi)[0].tolist()), batch_size=256,
                                     num_workers=4)
            acc_matrix[t, :t + 1] = accuracy_per_task(net, test_loader, boundaries[:t + 2], device)
            print(f"== task {t}: avg acc {acc_matrix[t, :t + 1].mean():.2f} | {acc_matrix[t, :t + 1].round(1)}")
            os.makedirs(args.logdir, exist_ok=True)
            torch.save({"state_dict": net.state_dict(), "n_classes": net.n_classes, "memory": memory},
                       os.path.join(args.logdir, f"wa_task{t}.pth"))
            np.savetxt(os.path.join(args.logdir, "acc_matrix.csv"), acc_matrix, delimiter=",", fmt="%.2f")
        dist.barrier()

        old_net = copy.deepcopy(net).eval()
        old_net.requires_grad_(False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
