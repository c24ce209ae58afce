# Dark Experience Replay++ (Buzzega et al., 2020) on Seq-TinyImageNet, multi-GPU.
#
#   torchrun --nproc_per_node=4 03_derpp_seq_tinyimagenet.py \
#       --data-path /scratch/datasets/tiny-imagenet-200 --buffer-size 5120
#
# Each rank owns buffer_size / world_size slots of the rehearsal memory and
# stores (input, label, logits) triples with reservoir sampling.
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_parser():
    parser = argparse.ArgumentParser(description="DER++ / Seq-TinyImageNet")
    parser.add_argument("--data-path", type=str, required=True)
    parser.add_argument("--output", type=str, default="./output/derpp")
    parser.add_argument("--n-tasks", type=int, default=10)
    parser.add_argument("--n-epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="global stream batch")
    parser.add_argument("--minibatch-size", type=int, default=128, help="global replay batch")
    parser.add_argument("--buffer-size", type=int, default=5120, help="total over all ranks")
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--eval-every", type=int, default=0, help="0: only at the end of each task")
    return parser


class Buffer:
    """Reservoir buffer for (x, y, logits)."""

    def __init__(self, size, device):
        self.size = size
        self.device = device
        self.seen = 0
        self.examples = self.labels = self.logits = None

    def _init(self, x, logits):
        self.examples = torch.zeros((self.size, *x.shape[1:]), dtype=torch.float32, device=self.device)
        self.labels = torch.zeros(self.size, dtype=torch.long, device=self.device)
        self.logits = torch.zeros((self.size, logits.shape[1]), dtype=torch.float32, device=self.device)

    def is_empty(self):
        return self.seen == 0

    def add_data(self, x, y, logits):
        if self.examples is None:
            self._init(x, logits)
        for i in range(x.shape[0]):
            if self.seen < self.size:
                idx = self.seen
            else:
                r = np.random.randint(0, self.seen + 1)
                idx = r if r < self.size else -1
            self.seen += 1
            if idx >= 0:
                self.examples[idx] = x[i]
                self.labels[idx] = y[i]
                self.logits[idx] = logits[i]

    def get_data(self, n):
        filled = min(self.seen, self.size)
        choice = np.random.choice(filled, size=min(n, filled), replace=False)
        choice = torch.from_numpy(choice).to(self.device)
        return self.examples[choice], self.labels[choice], self.logits[choice]


def build_backbone(num_classes):
    net = models.resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def tiny_imagenet(root):
    mean, std = (0.4802, 0.4480, 0.3975), (0.2770, 0.2691, 0.2821)
    train_t = transforms.Compose([
        transforms.RandomCrop(64, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_t = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.ImageFolder(os.path.join(root, "train"), train_t)
    test = datasets.ImageFolder(os.path.join(root, "val"), test_t)
    return train, test


def indices_for(targets, lo, hi):
    targets = np.asarray(targets)
    return np.nonzero((targets >= lo) & (targets < hi))[0].tolist()


@torch.no_grad()
def evaluate(net, test_set, n_seen_tasks, cpt, device, rank, world):
    net.eval()
    accs = []
    for t in range(n_seen_tasks):
        idx = indices_for(test_set.targets, t * cpt, (t + 1) * cpt)[rank::world]
        loader = DataLoader(Subset(test_set, idx), batch_size=256, num_workers=4)
        stat = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = net(x)[:, :(n_seen_tasks * cpt)]
            stat[0] += (logits.argmax(1) == y).sum()
            stat[1] += len(y)
        dist.all_reduce(stat)
        accs.append(100.0 * stat[0].item() / stat[1].item())
    net.train()
    return accs


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train_set, test_set = tiny_imagenet(args.data_path)
    n_classes = len(train_set.classes)
    cpt = n_classes // args.n_tasks

    net = build_backbone(n_classes).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank], output_device=local_rank)

    bs = args.batch_size // world
    mbs = args.minibatch_size // world
    buffer = Buffer(args.buffer_size // world, device)
    results = []
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for task in range(args.n_tasks):
        task_idx = indices_for(train_set.targets, task * cpt, (task + 1) * cpt)
        task_data = Subset(train_set, task_idx)
        sampler = DistributedSampler(task_data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(task_data, batch_size=bs, sampler=sampler, num_workers=args.num_workers,
                            pin_memory=True, drop_last=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

        for epoch in range(args.n_epochs):
            sampler.set_epoch(epoch)
            start = time.time()
            loss_meter = 0.0
            for i, (inputs, labels) in enumerate(loader):
                inputs = inputs.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)

                optimizer.zero_grad()
                outputs = model(inputs)
                loss = F.cross_entropy(outputs, labels)

                if not buffer.is_empty():
                    buf_inputs, _, buf_logits = buffer.get_data(mbs)
                    buf_outputs = model(buf_inputs)
                    loss = loss + args.alpha * F.mse_loss(buf_outputs, buf_logits)

                    buf_inputs, buf_labels, _ = buffer.get_data(mbs)
                    buf_outputs = model(buf_inputs)
                    loss = loss + args.beta * F.cross_entropy(buf_outputs, buf_labels)

                loss.backward()
                optimizer.step()
                buffer.add_data(inputs, labels, outputs.detach())
                loss_meter += loss.item()

            if rank == 0:
                print(f"task {task + 1}/{args.n_tasks} epoch {epoch + 1}/{args.n_epochs} "
                      f"loss {loss_meter / len(loader):.4f} [{time.time() - start:.0f}s]", flush=True)
            if args.eval_every and (epoch + 1) % args.eval_every == 0:
                accs = evaluate(net, test_set, task + 1, cpt, device, rank, world)
                if rank == 0:
                    print(f"  interim class-il acc {np.mean(accs):.2f}", flush=True)

        accs = evaluate(net, test_set, task + 1, cpt, device, rank, world)
        results.append(accs)
        if rank == 0:
            print(f"[task {task + 1}] class-il acc per task: {[round(a, 2) for a in accs]} "
                  f"mean {np.mean(accs):.2f}", flush=True)
            torch.save({"state_dict": net.state_dict(), "task": task, "results": results},
                       os.path.join(args.output, "last.pth"))
        dist.barrier()

    if rank == 0:
        final = results[-1]
        fgt = [max(r[j] for r in results[j:-1]) - final[j] for j in range(len(final) - 1)] if len(results) > 1 else [0.0]
        print(f"FINAL  acc {np.mean(final):.2f}  forgetting {np.mean(fgt):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
