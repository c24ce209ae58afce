"""
Low-rank adaptation of a timm ViT-B/16 (AugReg IN-21k) to fine-grained
classification (Stanford Cars / FGVC-Aircraft / CUB via ImageFolder layout).
LoRA is injected into the fused qkv projection and the MLP fc1 of every block;
only LoRA matrices, the final norm and the head are trained. Runs are tracked
in Weights & Biases.

    torchrun --nproc_per_node=4 lora_vit_wandb.py --data /data/stanford_cars --rank 16
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--project", default="lora-vit-fgvc")
    p.add_argument("--out", default="/shared/lora_vit/cars_r16")
    return p.parse_args()


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.r = r
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + (self.drop(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    @torch.no_grad()
    def merged(self):
        lin = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None)
        lin.weight.copy_(self.base.weight + self.scaling * self.lora_B @ self.lora_A)
        if self.base.bias is not None:
            lin.bias.copy_(self.base.bias)
        return lin


def inject_lora(vit, r, alpha):
    for p in vit.parameters():
        p.requires_grad = False
    for blk in vit.blocks:
        blk.attn.qkv = LoRALinear(blk.attn.qkv, r, alpha, dropout=0.1)
        blk.mlp.fc1 = LoRALinear(blk.mlp.fc1, r, alpha, dropout=0.1)
    for p in list(vit.head.parameters()) + list(vit.norm.parameters()):
        p.requires_grad = True
    return vit


def lora_state_dict(vit):
    return {k: v.detach().cpu() for k, v in vit.state_dict().items()
            if "lora_" in k or k.startswith("head.") or k.startswith("norm.")}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        s[0] += F.cross_entropy(out.float(), y, reduction="sum")
        s[1] += (out.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.project, config=vars(args), name=f"vitb16-lora-r{args.rank}")

    train_dir, val_dir = os.path.join(args.data, "train"), os.path.join(args.data, "val")
    num_classes = len(os.listdir(train_dir))
    vit = timm.create_model(args.model, pretrained=True, num_classes=num_classes)
    cfg = resolve_data_config({}, model=vit)
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    val_tf = create_transform(**cfg)
    train_ds, val_ds = ImageFolder(train_dir, train_tf), ImageFolder(val_dir, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 128, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    vit = inject_lora(vit, args.rank, args.alpha).to(device)
    n_train = sum(p.numel() for p in vit.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in vit.parameters())
    model = DDP(vit, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps = args.epochs * len(train_loader)
    warm = args.warmup_epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))

    wandb.config.update({"trainable_params": n_train, "total_params": n_total, "world_size": world})
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"trainable {n_train / 1e6:.2f}M / {n_total / 1e6:.1f}M", flush=True)

    best = 0.0
    gstep = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            gstep += 1
            if gstep % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=gstep)

        val_loss, val_acc = evaluate(model, val_loader, device)
        wandb.log({"val/loss": val_loss, "val/acc": val_acc, "epoch": epoch,
                   "time/epoch_s": time.time() - t0}, step=gstep)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.2f}", flush=True)
            torch.save(lora_state_dict(model.module), os.path.join(args.out, "lora_last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(lora_state_dict(model.module), os.path.join(args.out, "lora_best.pth"))
        dist.barrier()

    run.summary["best_val_acc"] = best
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
