"""Dark Experience Replay (DER, Buzzega et al. NeurIPS 2020) on Seq-CIFAR-10.

Multi-GPU port of our single-GPU mammoth-style trainer. Each rank keeps its own
reservoir buffer of (non-augmented image, logits) pairs; the total memory is
--buffer_size split evenly over the ranks.

    torchrun --nproc_per_node=4 04_der_seq_cifar10.py --buffer_size 500 --alpha 0.3
"""
import argparse
import os
from datetime import datetime

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2615]).view(1, 3, 1, 1)
N_TASKS, CPT = 5, 2


class SeqCIFAR10(Dataset):
    """Returns (augmented normalised image, label, non-augmented [0,1] image)."""

    def __init__(self, root, classes, train):
        base = torchvision.datasets.CIFAR10(root, train=train, download=False)
        targets = np.asarray(base.targets)
        keep = np.isin(targets, classes)
        self.data, self.targets = base.data[keep], targets[keep]
        self.train = train
        self.aug = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img = torch.from_numpy(self.data[i]).permute(2, 0, 1).float() / 255.0
        x = self.aug(img) if self.train else img
        x = (x - MEAN[0]) / STD[0]
        return x, int(self.targets[i]), img


class Buffer:
    """Reservoir buffer kept on the rank's GPU."""

    def __init__(self, size, device):
        self.size, self.device = size, device
        self.seen = 0
        self.examples = torch.zeros(size, 3, 32, 32, device=device)
        self.logits = torch.zeros(size, N_TASKS * CPT, device=device)

    def __len__(self):
        return min(self.seen, self.size)

    def add(self, examples, logits):
        for i in range(examples.size(0)):
            if self.seen < self.size:
                j = self.seen
            else:
                j = np.random.randint(0, self.seen + 1)
            if j < self.size:
                self.examples[j] = examples[i]
                self.logits[j] = logits[i]
            self.seen += 1

    def sample(self, n, aug):
        idx = torch.from_numpy(np.random.choice(len(self), size=min(n, len(self)), replace=False)).to(self.device)
        x = torch.stack([aug(img) for img in self.examples[idx]])
        x = (x - MEAN.to(self.device)) / STD.to(self.device)
        return x, self.logits[idx]


def resnet18_cifar(num_classes):
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def evaluate(net, root, n_seen_tasks, device):
    net.eval()
    til, cil = [], []
    for t in range(n_seen_tasks):
        loader = DataLoader(SeqCIFAR10(root, list(range(t * CPT, (t + 1) * CPT)), train=False),
                            batch_size=256, num_workers=4)
        c_cil = c_til = total = 0
        for x, y, _ in loader:
            x, y = x.to(device), y.to(device)
            out = net(x)
            c_cil += (out[:, :n_seen_tasks * CPT].argmax(1) == y).sum().item()
            c_til += (out[:, t * CPT:(t + 1) * CPT].argmax(1) + t * CPT == y).sum().item()
            total += y.numel()
        cil.append(100.0 * c_cil / total)
        til.append(100.0 * c_til / total)
    return cil, til


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./output/der")
    ap.add_argument("--buffer_size", type=int, default=500)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--batch_size", type=int, default=32, help="per-GPU stream batch")
    ap.add_argument("--minibatch_size", type=int, default=32, help="per-GPU replay batch")
    ap.add_argument("--n_epochs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different reservoir draws per rank, same initial weights via DDP broadcast
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    # the stream batch is given per GPU, so scale the single-GPU lr linearly
    lr = args.lr * world

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, datetime.now().strftime("%Y%m%d-%H%M%S")))

    net = resnet18_cifar(N_TASKS * CPT).to(device)
    model = DDP(net, device_ids=[local_rank])
    buffer = Buffer(args.buffer_size // world, device)
    gpu_aug = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()])
    results = []
    step = 0

    for t in range(N_TASKS):
        train_ds = SeqCIFAR10(args.data, list(range(t * CPT, (t + 1) * CPT)), train=True)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        for epoch in range(args.n_epochs):
            sampler.set_epoch(epoch)
            model.train()
            for inputs, labels, not_aug in loader:
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                not_aug = not_aug.to(device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                outputs = model(inputs)
                loss = F.cross_entropy(outputs, labels)
                if len(buffer) > 0:
                    buf_inputs, buf_logits = buffer.sample(args.minibatch_size, gpu_aug)
                    buf_outputs = model(buf_inputs)
                    loss = loss + args.alpha * F.mse_loss(buf_outputs, buf_logits)
                loss.backward()
                opt.step()
                buffer.add(not_aug, outputs.detach())
                if writer is not None and step % 50 == 0:
                    writer.add_scalar("train/loss", loss.item(), step)
                step += 1
            if rank == 0 and epoch % 10 == 0:
                print(f"task {t + 1}/{N_TASKS} epoch {epoch} loss {loss.item():.4f} buffer {len(buffer)}",
                      flush=True)

        if rank == 0:
            cil, til = evaluate(net, args.data, t + 1, device)
            results.append(cil)
            print(f"[task {t + 1}] class-il {np.mean(cil):.2f} task-il {np.mean(til):.2f} per-task {cil}",
                  flush=True)
            writer.add_scalar("eval/class_il", np.mean(cil), t + 1)
            writer.add_scalar("eval/task_il", np.mean(til), t + 1)
            torch.save({"model": net.state_dict(), "task": t, "results": results},
                       os.path.join(args.out, "der_last.pt"))
        dist.barrier()

    if rank == 0:
        fgt = [max(r[j] for r in results[j:-1]) - results[-1][j] for j in range(N_TASKS - 1)]
        print(f"final class-il acc {np.mean(results[-1]):.2f}, forgetting {np.mean(fgt):.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
