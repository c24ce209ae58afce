"""Fine-tune a pretrained ViT-MoE-B/16 (top-1 routing, 16 experts every other block) on Food-101.

    torchrun --nproc_per_node=4 07_vit_moe_food101_ft.py \
        --pretrained /models/vit_moe_b16_in21k.safetensors --data /datasets/food101 --out runs/food101_moe
    # restart after preemption: same command plus --resume runs/food101_moe/last.pt
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import Food101

log = logging.getLogger("moe_ft")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--data", default="/datasets/food101")
    p.add_argument("--out", default="runs/food101_moe")
    p.add_argument("--resume", default=None)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 512")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=float, default=2.0, help="epochs")
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--capacity", type=float, default=1.25)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    return p


class Top1MoE(nn.Module):
    def __init__(self, dim, n_exp=16, cf=1.25):
        super().__init__()
        self.n_exp, self.cf = n_exp, cf
        self.router = nn.Linear(dim, n_exp)
        self.fc1 = nn.Parameter(torch.empty(n_exp, dim, 4 * dim))
        self.b1 = nn.Parameter(torch.zeros(n_exp, 4 * dim))
        self.fc2 = nn.Parameter(torch.empty(n_exp, 4 * dim, dim))
        self.b2 = nn.Parameter(torch.zeros(n_exp, dim))
        nn.init.trunc_normal_(self.fc1, std=0.02)
        nn.init.trunc_normal_(self.fc2, std=0.02)

    def forward(self, x):
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        N = flat.size(0)
        probs = self.router(flat).float().softmax(-1)
        gate, eidx = probs.max(-1)
        cap = int(math.ceil(self.cf * N / self.n_exp))
        pos = (F.one_hot(eidx, self.n_exp).cumsum(0) - 1).gather(1, eidx[:, None]).squeeze(1)
        keep = pos < cap
        # padded [E, cap, D] buffer: each expert always runs on cap rows
        buf = flat.new_zeros(self.n_exp, cap, D)
        buf[eidx[keep], pos[keep]] = flat[keep]
        h = F.gelu(torch.baddbmm(self.b1[:, None], buf, self.fc1))
        h = torch.baddbmm(self.b2[:, None], h, self.fc2)
        out = flat.new_zeros(N, D)
        out[keep] = (h[eidx[keep], pos[keep]] * gate[keep, None]).to(out.dtype)
        load = F.one_hot(eidx, self.n_exp).float().mean(0)
        aux = self.n_exp * (load * probs.mean(0)).sum()
        return out.view(B, T, D), aux, 1.0 - keep.float().mean()


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = x.new_empty(x.size(0), 1, 1).bernoulli_(1 - self.p)
        return x * mask / (1 - self.p)


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads, moe, cf, dp):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.is_moe = moe
        self.mlp = Top1MoE(dim, cf=cf) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path = DropPath(dp)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop_path(self.attn(h, h, h, need_weights=False)[0])
        if self.is_moe:
            y, aux, drop = self.mlp(self.norm2(x))
        else:
            y, aux, drop = self.mlp(self.norm2(x)), x.new_zeros(()), x.new_zeros(())
        return x + self.drop_path(y), aux, drop


class ViTMoE(nn.Module):
    def __init__(self, num_classes, dim=768, depth=12, heads=12, cf=1.25, drop_path=0.1):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, 16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 197, dim))
        dpr = [drop_path * i / (depth - 1) for i in range(depth)]
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, i % 2 == 1, cf, dpr[i]) for i in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        aux = drop = 0.0
        for blk in self.blocks:
            x, a, d = blk(x)
            aux, drop = aux + a, drop + d
        return self.head(self.norm(x)[:, 0]), aux, drop / (len(self.blocks) // 2)


def param_groups(model, wd, lr, layer_decay):
    depth = len(model.blocks)
    groups = {}
    for n, p in model.named_parameters():
        if n.startswith(("patch", "cls_token", "pos_embed")):
            layer = 0
        elif n.startswith("blocks."):
            layer = int(n.split(".")[1]) + 1
        else:
            layer = depth + 1
        no_wd = p.ndim == 1 or n in ("cls_token", "pos_embed") or n.endswith((".b1", ".b2"))
        key = (layer, no_wd)
        if key not in groups:
            scale = layer_decay ** (depth + 1 - layer)
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd, "lr": lr * scale, "lr_scale": scale}
        groups[key]["params"].append(p)
    return list(groups.values())


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_set = Food101(args.data, split="train", transform=transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(), transforms.ToTensor(), norm]))
    test_set = Food101(args.data, split="test", transform=transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # every test image exactly once: strided shard, no padding
    test_shard = Subset(test_set, range(rank, len(test_set), world))
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_shard, 128, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = ViTMoE(num_classes=101, cf=args.capacity, drop_path=args.drop_path)
    sd = load_file(args.pretrained, device="cpu")
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    log.info("loaded pretrained: missing=%s unexpected=%s", missing, unexpected)
    model.to(device)

    global_bs = args.bs * world
    lr = args.base_lr * global_bs / 512
    opt = torch.optim.AdamW(param_groups(model, args.wd, lr, args.layer_decay), lr=lr)
    model = DDP(model, device_ids=[local_rank])
    scaler_steps = len(train_loader)
    total, warm = args.epochs * scaler_steps, int(args.warmup * scaler_steps)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(4, device=device)  # loss sum, aux sum, drop sum, n
        for it, (img, tgt) in enumerate(train_loader):
            step = epoch * scaler_steps + it
            f = step / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_scale"] * f
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, drop = model(img)
                loss = F.cross_entropy(logits, tgt, label_smoothing=0.1) + args.aux_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            meter += torch.stack([loss.detach().float(), aux.detach().float(), drop.detach().float(),
                                  torch.ones((), device=device)])
            if it % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f aux %.4f drop %.3f", epoch, it, len(train_loader),
                         loss.item(), aux.item(), drop.item())

        dist.all_reduce(meter)
        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for img, tgt in test_loader:
                img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
                logits, _, _ = model.module(img)
                correct[0] += (logits.argmax(-1) == tgt).sum()
                correct[1] += tgt.numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item() * 100
        log.info("epoch %d train_loss %.4f aux %.4f drop %.3f | test acc %.2f",
                 epoch, meter[0] / meter[3], meter[1] / meter[3], meter[2] / meter[3], acc)
        best = max(best, acc)
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if acc >= best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
