"""Small ViT on CIFAR-10 with the whole DDP training step captured in one CUDA graph.

The model is tiny, so at 8 GPUs the step is dominated by kernel launch
latency. We capture forward + backward (including DDP's all-reduce) +
optimizer.step once and replay it, feeding new batches through static
input buffers.

    torchrun --standalone --nproc_per_node=8 ddp_cudagraph_step.py --data ~/data/cifar10 --out runs/vit_cg
"""
import argparse
import math
import os

# DDP's watchdog-based async error handling can't coexist with collectives
# captured in a graph (PyTorch < 2.2 reads the first name, newer the second).
os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "0")
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

DDP_WARMUP_ITERS = 15  # DDP needs >= 11 eager iterations before capture


class PatchViT(nn.Module):
    def __init__(self, img=32, patch=4, dim=384, depth=8, heads=6, num_classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        n = (img // patch) ** 2
        self.pos = nn.Parameter(torch.zeros(1, n, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        x = self.encoder(x)
        return self.head(self.norm(x).mean(dim=1))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="~/data/cifar10")
    p.add_argument("--out", default="runs/vit_cg")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="peak lr at global batch 512")
    p.add_argument("--warmup-epochs", type=int, default=10)
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    root = os.path.expanduser(args.data)
    if rank == 0:
        datasets.CIFAR10(root, train=True, download=True)
        datasets.CIFAR10(root, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR10(root, train=True, transform=train_tf)
    test_set = datasets.CIFAR10(root, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    # drop_last: the graph was captured for exactly batch_size samples
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 500, sampler=test_sampler, num_workers=4, pin_memory=True)

    model = PatchViT().to(device)
    raw_model = model

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world
    peak_lr = args.lr * global_bs / 512
    lr_t = torch.tensor(peak_lr, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_t, weight_decay=0.05, capturable=True)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup_steps:
            return peak_lr * (step + 1) / warmup_steps
        return 0.5 * peak_lr * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))

    static_x = torch.zeros(args.batch_size, 3, 32, 32, device=device)
    static_y = torch.zeros(args.batch_size, dtype=torch.long, device=device)

    def train_step():
        # autocast's weight-cast cache must be off when the step is captured
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = model(static_x)
            loss = F.cross_entropy(out.float(), static_y, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        return loss

    # warm-up on the side stream with real data so DDP builds its buckets
    warm_iter = iter(train_loader)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(DDP_WARMUP_ITERS):
            x, y = next(warm_iter)
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    del warm_iter

    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = train_step()

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        for x, y in train_loader:
            lr_t.fill_(lr_at(step))
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            graph.replay()
            loss_sum += static_loss.detach()
            step += 1

        # eval runs eagerly on the unwrapped module; it shares the graph's parameters
        raw_model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = raw_model(x).argmax(1)
                stats[0] += (pred == y).sum()
                stats[1] += y.numel()
        stats[2] = loss_sum / steps_per_epoch
        dist.all_reduce(stats)
        raw_model.train()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {stats[2].item() / world:.4f} "
                  f"test acc {100 * stats[0].item() / stats[1].item():.2f}% lr {lr_at(step):.2e}", flush=True)
            if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": raw_model.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"vit_ep{epoch + 1:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
