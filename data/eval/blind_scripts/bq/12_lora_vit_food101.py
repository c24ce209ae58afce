"""Low-rank adaptation of a frozen ViT-B/16 (timm) to Food-101, distributed over 4 GPUs.

LoRA is injected into the qkv and fc1/fc2 projections of every block; the backbone
stays frozen, only the adapters and the new head are trained. After training, the
adapters are folded into the weights and the plain ViT is exported to TorchScript and ONNX.

    torchrun --standalone --nproc_per_node=4 12_lora_vit_food101.py --root /data/food101
"""
import argparse
import copy
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import Food101


class LoRA(nn.Module):
    def __init__(self, linear: nn.Linear, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.linear = linear
        self.A = nn.Parameter(torch.randn(rank, linear.in_features) / math.sqrt(linear.in_features))
        self.B = nn.Parameter(torch.zeros(linear.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x):
        return self.linear(x) + F.linear(F.linear(x, self.A), self.B) * self.scale

    @torch.no_grad()
    def fold(self) -> nn.Linear:
        self.linear.weight += (self.B @ self.A) * self.scale
        return self.linear


class LoRAViT(nn.Module):
    def __init__(self, name, num_classes, rank, alpha):
        super().__init__()
        self.vit = timm.create_model(name, pretrained=True, num_classes=num_classes)
        for p in self.vit.parameters():
            p.requires_grad = False
        for blk in self.vit.blocks:
            blk.attn.qkv = LoRA(blk.attn.qkv, rank, alpha)
            blk.mlp.fc1 = LoRA(blk.mlp.fc1, rank, alpha)
            blk.mlp.fc2 = LoRA(blk.mlp.fc2, rank, alpha)
        for p in self.vit.head.parameters():
            p.requires_grad = True

    def forward(self, x):
        return self.vit(x)

    def lora_state_dict(self):
        return {k: v for k, v in self.state_dict().items()
                if k.endswith(".A") or k.endswith(".B") or k.startswith("vit.head.")}

    def merge_lora(self):
        for blk in self.vit.blocks:
            blk.attn.qkv = blk.attn.qkv.fold()
            blk.mlp.fc1 = blk.mlp.fc1.fold()
            blk.mlp.fc2 = blk.mlp.fc2.fold()
        return self.vit


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="vit_base_patch16_224.augreg2_in21k_ft_in1k")
    ap.add_argument("--out", default="out/lora_food101")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        t[0] += (logits.argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    model = LoRAViT(args.model, 101, args.rank, args.alpha).to(device)
    cfg = model.vit.pretrained_cfg
    norm = transforms.Normalize(cfg["mean"], cfg["std"])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.35, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.TrivialAugmentWide(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(248), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    if rank == 0:
        Food101(args.root, split="train", download=True)
    dist.barrier()
    train_set = Food101(args.root, split="train", transform=train_tf)
    test_set = Food101(args.root, split="test", transform=test_tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=256,
                         num_workers=args.workers, pin_memory=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler()
    total = args.epochs * len(train_dl)
    warm = len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        print(f"trainable {sum(p.numel() for p in trainable) / 1e6:.2f}M params, global batch {args.bs * world}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"[{epoch}][{i}/{len(train_dl)}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")

        acc = evaluate(model, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch} test acc {acc:.4f} ({time.time() - t0:.0f}s)")
            state = {"lora": model.lora_state_dict(), "epoch": epoch, "acc": acc}
            torch.save(state, os.path.join(args.out, "lora_last.pt"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.out, "lora_best.pt"))
        dist.barrier()

    if rank == 0:
        export = copy.deepcopy(model.module).cpu().float().eval()
        best_ck = torch.load(os.path.join(args.out, "lora_best.pt"), map_location="cpu")
        export.load_state_dict(best_ck["lora"], strict=False)
        vit = export.merge_lora().eval()
        example = torch.randn(1, 3, 224, 224)
        torch.jit.trace(vit, example).save(os.path.join(args.out, "vit_food101_merged.ts"))
        torch.onnx.export(vit, example, os.path.join(args.out, "vit_food101_merged.onnx"),
                          input_names=["pixels"], output_names=["logits"],
                          dynamic_axes={"pixels": {0: "n"}, "logits": {0: "n"}}, opset_version=17)
        print(f"best acc {best:.4f}, exported merged model")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
