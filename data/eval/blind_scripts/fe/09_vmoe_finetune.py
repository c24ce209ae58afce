#!/usr/bin/env python
# V-MoE fine-tuning: ViT-L/16 backbone whose last-N MLPs are DeepSpeed MoE layers.
# Dense weights come from our ViT-L pretraining run; experts start as copies.
#
#   deepspeed --num_gpus 8 09_vmoe_finetune.py --deepspeed --deepspeed_config configs/vmoe_fp16.json \
#       --init /shared/ckpt/vitl16_in21k/best.pt --data /datasets/imagenet --out /shared/exp/vmoe_l16
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True, help="dense ViT checkpoint")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--moe-last", type=int, default=8, help="number of trailing blocks made sparse")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux", type=float, default=0.005)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class FFN(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads, moe=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = moe is not None
        self.mlp = moe if self.moe else FFN(dim)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.moe:
            y, l_aux, _ = self.mlp(self.norm2(x))
        else:
            y, l_aux = self.mlp(self.norm2(x)), 0.0
        return x + y, l_aux


class VMoE(nn.Module):
    def __init__(self, args, num_classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, args.dim, 16, 16)
        self.cls = nn.Parameter(torch.zeros(1, 1, args.dim))
        self.pos = nn.Parameter(torch.zeros(1, 197, args.dim))
        blocks = []
        for i in range(args.depth):
            sparse = i >= args.depth - args.moe_last and i % 2 == 1
            moe = MoE(hidden_size=args.dim, expert=FFN(args.dim), num_experts=args.experts,
                      ep_size=args.ep_size, k=args.top_k, capacity_factor=1.05,
                      eval_capacity_factor=1.25, min_capacity=4) if sparse else None
            blocks.append(EncoderBlock(args.dim, args.heads, moe))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
        aux = 0.0
        for b in self.blocks:
            x, l = b(x)
            aux = aux + l
        return self.head(self.norm(x[:, 0])), aux


def load_dense_init(model, path):
    ckpt = torch.load(path)
    state = ckpt["model"] if "model" in ckpt else ckpt
    state = {k: v for k, v in state.items() if not k.startswith("head.")}  # new label space
    missing, unexpected = model.load_state_dict(state, strict=False)
    for i, blk in enumerate(model.blocks):
        if blk.moe:
            for expert in blk.mlp.deepspeed_moe.experts.deepspeed_experts:
                expert.load_state_dict({k.split("mlp.", 1)[1]: v for k, v in state.items()
                                        if k.startswith(f"blocks.{i}.mlp.")})
    return missing, unexpected


def loaders(args, micro_bs, rank, world):
    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    val = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    ts = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    vs = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False)
    return (DataLoader(train, micro_bs, sampler=ts, num_workers=args.workers, pin_memory=True, drop_last=True),
            DataLoader(val, micro_bs, sampler=vs, num_workers=args.workers, pin_memory=True), ts)


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    correct = torch.zeros(2, device=engine.device)
    for x, y in loader:
        x, y = x.to(engine.device).half(), y.to(engine.device)
        logits, _ = engine(x)
        correct[0] += (logits.argmax(1) == y).sum()
        correct[1] += y.numel()
    dist.all_reduce(correct)
    engine.train()
    return (correct[0] / correct[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    model = VMoE(args)
    missing, unexpected = load_dense_init(model, args.init)
    if rank == 0:
        print(f"init from {args.init}: {len(missing)} missing, {len(unexpected)} unexpected keys")

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "all"})
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups)
    train_loader, val_loader, train_sampler = loaders(args, engine.train_micro_batch_size_per_gpu(), rank, world)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x = x.to(engine.device, non_blocking=True).half()
            y = y.to(engine.device, non_blocking=True)
            logits, aux = engine(x)
            loss = F.cross_entropy(logits.float(), y) + args.aux * aux
            engine.backward(loss)
            engine.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i} loss {loss.item():.4f} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
        acc = evaluate(engine, val_loader)
        if rank == 0:
            print(f"ep {epoch} top1 {acc * 100:.2f}")
        if acc > best:
            best = acc
            engine.save_checkpoint(args.out, tag="best", client_state={"epoch": epoch, "acc": acc})
        engine.save_checkpoint(args.out, tag=f"ep{epoch}", client_state={"epoch": epoch, "acc": acc})

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
