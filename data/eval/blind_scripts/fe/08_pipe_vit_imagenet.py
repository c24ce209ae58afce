"""ViT-g/14 on ImageNet-21k with DeepSpeed pipeline parallelism (bf16).

    deepspeed --num_gpus 8 08_pipe_vit_imagenet.py --deepspeed_config configs/vitg_pp.json \
        --data-root /datasets/in21k --pipe-stages 4 --ckpt-dir /shared/exp/vitg_pp4
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    parser = argparse.ArgumentParser(description="pipeline ViT")
    parser.add_argument("--data-root", type=str, required=True)
    parser.add_argument("--ckpt-dir", type=str, required=True)
    parser.add_argument("--pipe-stages", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--embed-dim", type=int, default=1408)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--mlp-ratio", type=float, default=4.3637)
    parser.add_argument("--num-classes", type=int, default=21843)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=50)
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class PatchEmbed(nn.Module):
    def __init__(self, img_size, patch, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (img_size // patch) ** 2 + 1, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, img):
        x = self.proj(img.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)
        return x + self.pos


class ViTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.heads = heads

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, C))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ClsHead(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.norm(x[:, 0]))


def xent(logits, target):
    return F.cross_entropy(logits.float(), target, label_smoothing=0.1)


def build_model(args):
    layers = [LayerSpec(PatchEmbed, args.img_size, args.patch_size, args.embed_dim)]
    layers += [LayerSpec(ViTBlock, args.embed_dim, args.num_heads, args.mlp_ratio) for _ in range(args.depth)]
    layers += [LayerSpec(ClsHead, args.embed_dim, args.num_classes)]
    return PipelineModule(layers=layers, num_stages=args.pipe_stages, loss_fn=xent,
                          partition_method="type:ViTBlock", activation_checkpoint_interval=1,
                          checkpointable_layers=["ViTBlock"])


def build_datasets(args):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    eval_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(args.img_size),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    return (datasets.ImageFolder(os.path.join(args.data_root, "train"), train_tf),
            datasets.ImageFolder(os.path.join(args.data_root, "val"), eval_tf))


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(args.seed)

    model = build_model(args)
    train_set, val_set = build_datasets(args)

    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad])

    rank = dist.get_rank()
    dp_rank = engine.grid.get_data_parallel_rank()
    dp_world = engine.grid.get_data_parallel_world_size()
    mbs = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()

    # first and last stage of each pipeline must read the same samples: shard by DP rank only
    train_sampler = DistributedSampler(train_set, num_replicas=dp_world, rank=dp_rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=dp_world, rank=dp_rank, shuffle=False,
                                     drop_last=True)
    train_loader = DataLoader(train_set, batch_size=mbs, sampler=train_sampler, drop_last=True,
                              num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=mbs, sampler=val_sampler, drop_last=True,
                            num_workers=args.num_workers, pin_memory=True)

    start_epoch = 0
    if os.path.exists(os.path.join(args.ckpt_dir, "latest")):
        _, state = engine.load_checkpoint(args.ckpt_dir)
        start_epoch = state["epoch"] + 1

    steps_per_epoch = len(train_loader) // gas
    if rank == 0:
        print(f"stages={engine.num_stages} dp={dp_world} mbs={mbs} gas={gas} "
              f"global_batch={engine.train_batch_size()} steps/epoch={steps_per_epoch}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        it = iter(train_loader)
        tic = time.time()
        for step in range(steps_per_epoch):
            loss = engine.train_batch(data_iter=it)
            if rank == 0 and step % 50 == 0:
                ips = engine.train_batch_size() * (step + 1) / (time.time() - tic)
                print(f"epoch {epoch} [{step}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e} {ips:.0f} img/s", flush=True)

        vit = iter(val_loader)
        n_eval = min(args.eval_batches, len(val_loader) // gas)
        val_loss = sum(engine.eval_batch(vit).item() for _ in range(n_eval)) / max(n_eval, 1)
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f}", flush=True)

        engine.save_checkpoint(args.ckpt_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
