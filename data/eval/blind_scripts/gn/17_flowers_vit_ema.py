"""Fine-tune a pretrained ViT-B/16 on Oxford Flowers-102 with model EMA, DDP.

Both the live weights and the EMA weights are validated every epoch; whichever
is better is a candidate for the best checkpoint. Early stopping on top-1.

    torchrun --nproc_per_node=4 17_flowers_vit_ema.py --data /data/flowers102 --epochs 50
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import resolve_data_config, create_transform
from timm.utils import ModelEmaV2, get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Flowers102


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/flowers102")
    ap.add_argument("--model", default="vit_base_patch16_224.augreg2_in21k_ft_in1k")
    ap.add_argument("--output", default="runs/flowers_vitb16")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--patience", type=int, default=8)
    return ap.parse_args()


@torch.no_grad()
def top1(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            c[0] += (model(x).argmax(-1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def save_checkpoint(path, args, model, ema, optimizer, epoch, metrics, use_ema):
    state = {
        "arch": args.model,
        "num_classes": model.num_classes,
        "epoch": epoch,
        "metrics": metrics,
        "state_dict": get_state_dict(ema) if use_ema else get_state_dict(model),
        "state_dict_ema": get_state_dict(ema),
        "optimizer": optimizer.state_dict(),
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = timm.create_model(args.model, pretrained=rank == 0, num_classes=102)
    model.to(device)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**data_cfg, is_training=False)

    if rank == 0:
        Flowers102(args.data, split="train", download=True)
    dist.barrier()
    train_ds = torch.utils.data.ConcatDataset([Flowers102(args.data, split="train", transform=train_tf),
                                               Flowers102(args.data, split="val", transform=train_tf)])
    val_ds = Flowers102(args.data, split="test", transform=eval_tf)
    # use 2000 test images for model selection, the rest for the final report
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(val_ds), generator=g).tolist()
    sel_ds, report_ds = Subset(val_ds, perm[:2000]), Subset(val_ds, perm[2000:])

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    sel_loader = DataLoader(Subset(sel_ds, range(rank, len(sel_ds), world)), batch_size=128, num_workers=8)
    report_loader = DataLoader(Subset(report_ds, range(rank, len(report_ds), world)), batch_size=128,
                               num_workers=8)

    # weights are broadcast from rank 0 when DDP is constructed
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.1)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best_path = os.path.join(args.output, "model_best.pth.tar")
    best_acc, stale = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model.module)

        acc = top1(model.module, sel_loader, device)
        acc_ema = top1(ema.module, sel_loader, device)
        cand, use_ema = max((acc, False), (acc_ema, True))
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} top1 {acc:.4f} ema-top1 {acc_ema:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if cand > best_acc:
            best_acc, stale = cand, 0
            if rank == 0:
                save_checkpoint(best_path, args, model, ema, optimizer, epoch,
                                {"top1": acc, "top1_ema": acc_ema}, use_ema)
        else:
            stale += 1
            if stale >= args.patience:
                break
        dist.barrier()

    dist.barrier()
    ckpt = torch.load(best_path, map_location="cpu", weights_only=False)
    model.module.load_state_dict(ckpt["state_dict"])
    final = top1(model.module, report_loader, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} {json.dumps(ckpt['metrics'])} -> held-out top1 {final:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
