"""DER++ (Dark Experience Replay++) on Split CIFAR-10, class-incremental, DDP.

Each process keeps a reservoir buffer of (image, label, logits) for the
samples it has seen; the replay term matches stored logits (MSE) and stored
labels (CE).  A checkpoint with model, optimizer and buffer is written after
every task so that a long sequence can be resumed.

    torchrun --nproc_per_node=4 derpp_replay_buffer.py --buffer-size 2000 --resume
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--ckpt", default="./checkpoints/derpp")
    p.add_argument("--n-tasks", type=int, default=5)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--minibatch-size", type=int, default=32)
    p.add_argument("--buffer-size", type=int, default=2000, help="total over all ranks")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class ReservoirBuffer:
    def __init__(self, size, device):
        self.size, self.device, self.seen = size, device, 0
        self.x = self.y = self.logits = None

    def __len__(self):
        return min(self.seen, self.size)

    def add(self, x, y, logits):
        if self.x is None:
            self.x = torch.zeros((self.size, *x.shape[1:]), dtype=x.dtype, device=self.device)
            self.y = torch.zeros(self.size, dtype=torch.long, device=self.device)
            self.logits = torch.zeros((self.size, logits.size(1)), device=self.device)
        for i in range(x.size(0)):
            if self.seen < self.size:
                j = self.seen
            else:
                j = int(torch.randint(0, self.seen + 1, (1,)))
            self.seen += 1
            if j < self.size:
                self.x[j], self.y[j], self.logits[j] = x[i], y[i], logits[i]

    def sample(self, n, transform):
        idx = torch.randint(0, len(self), (n,), device=self.device)
        return transform(self.x[idx]), self.y[idx], self.logits[idx]

    def state_dict(self):
        return {"seen": self.seen, "x": self.x, "y": self.y, "logits": self.logits}

    def load_state_dict(self, sd):
        self.seen, self.x, self.y, self.logits = sd["seen"], sd["x"], sd["y"], sd["logits"]


class PairView(Dataset):
    """(augmented image, plain image, label); the plain one goes to the buffer."""

    def __init__(self, base, aug, plain):
        self.base, self.aug, self.plain = base, aug, plain

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        return self.aug(img), self.plain(img), y


def resnet18_cifar(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def gpu_augment(x):
    """Random crop + flip on a batch of normalised tensors already on the GPU."""
    n = x.size(0)
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    i = torch.randint(0, 9, (n,), device=x.device)
    j = torch.randint(0, 9, (n,), device=x.device)
    out = torch.stack([padded[k, :, i[k]:i[k] + 32, j[k]:j[k] + 32] for k in range(n)])
    flip = torch.rand(n, device=x.device) < 0.5
    out[flip] = out[flip].flip(3)
    return out


@torch.no_grad()
def eval_tasks(net, test_set, targets, n_tasks_seen, device):
    net.eval()
    accs = []
    for t in range(n_tasks_seen):
        idx = [i for i, y in enumerate(targets) if y // 2 == t]
        sub = Subset(test_set, idx)
        loader = DataLoader(sub, batch_size=500, sampler=DistributedSampler(sub, shuffle=False))
        s = torch.zeros(2, device=device)
        for x, y in loader:
            s[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
            s[1] += y.numel()
        dist.all_reduce(s)
        accs.append((s[0] / s[1]).item())
    return accs


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)  # different reservoir draws per process

    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    plain_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
        os.makedirs(args.ckpt, exist_ok=True)
    dist.barrier()
    train_set = PairView(torchvision.datasets.CIFAR10(args.data, train=True), train_tf, plain_tf)
    train_targets = train_set.base.targets
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=plain_tf)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(resnet18_cifar()).to(device)
    model = DDP(net, device_ids=[local_rank])
    buffer = ReservoirBuffer(args.buffer_size // world, device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    start_task = 0
    ckpt_file = os.path.join(args.ckpt, "derpp_last.pt")
    if args.resume and os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        buffer.load_state_dict(ck["buffer"])
        start_task = ck["task"] + 1
        if rank == 0:
            print(f"resumed after task {ck['task']}", flush=True)

    for task in range(start_task, args.n_tasks):
        task_idx = [i for i, y in enumerate(train_targets) if y // 2 == task]
        task_set = Subset(train_set, task_idx)
        sampler = DistributedSampler(task_set, shuffle=True, seed=task)
        loader = DataLoader(task_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        t0 = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, x_plain, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                n = x.size(0)
                if len(buffer) > 0:
                    bx1, _, bl1 = buffer.sample(args.minibatch_size, gpu_augment)
                    bx2, by2, _ = buffer.sample(args.minibatch_size, gpu_augment)
                    out = model(torch.cat([x, bx1, bx2]))
                    logits, o1, o2 = out[:n], out[n:n + len(bx1)], out[n + len(bx1):]
                    loss = F.cross_entropy(logits, y)
                    loss = loss + args.alpha * F.mse_loss(o1, bl1) + args.beta * F.cross_entropy(o2, by2)
                else:
                    logits = model(x)
                    loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                # store the un-augmented images with the logits of this step
                with torch.no_grad():
                    buffer.add(x_plain.to(device, non_blocking=True), y, logits.detach())
            if rank == 0 and epoch % 10 == 0:
                print(f"task {task} epoch {epoch} loss {loss.item():.4f} "
                      f"buffer {len(buffer)} ({time.time() - t0:.0f}s)", flush=True)

        accs = eval_tasks(net, test_set, test_set.targets, task + 1, device)
        if rank == 0:
            print(f"== after task {task}: " + " ".join(f"{a:.3f}" for a in accs)
                  + f" | mean {sum(accs) / len(accs):.4f}", flush=True)
        torch.save({"task": task, "model": net.state_dict(), "opt": opt.state_dict(),
                    "buffer": buffer.state_dict()}, ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
