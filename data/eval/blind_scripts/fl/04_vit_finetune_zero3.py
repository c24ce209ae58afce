"""Fine-tune a ViT-L/16 on a 1k-class image dataset with DeepSpeed ZeRO-3 and bf16.

The model is constructed under zero.Init so that no rank ever materialises the full
fp32 model on its GPU; pretrained weights are loaded on rank 0 inside a gather.

    deepspeed --num_gpus 8 04_vit_finetune_zero3.py --data /datasets/imagenet \
        --pretrained /models/vit_large_patch16_224.augreg_in21k.pth --epochs 20
"""
import argparse
import os
import time

import deepspeed
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets


def get_args():
    parser = argparse.ArgumentParser("vit-zero3")
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="vit_large_patch16_224")
    parser.add_argument("--pretrained", default="")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--base-lr", type=float, default=5e-4, help="lr for a global batch of 1024")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=float, default=2)
    parser.add_argument("--out", default="output/vit_l_ft")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def build_ds_config(args, world_size, steps_per_epoch):
    global_batch = args.micro_batch * args.grad_accum * world_size
    lr = args.base_lr * global_batch / 1024
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.999], "weight_decay": args.weight_decay}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": int(steps_per_epoch * args.epochs),
                                 "warmup_num_steps": int(steps_per_epoch * args.warmup_epochs),
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 100,
    }


def load_pretrained(model, path, rank):
    # Parameters are partitioned; gather them, let rank 0 write, then re-partition.
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            sd = torch.load(path, map_location="cpu")
            sd = sd.get("model", sd)
            sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
            missing, unexpected = model.load_state_dict(sd, strict=False)
            print(f"loaded {path}: missing={missing} unexpected={unexpected}", flush=True)


@torch.no_grad()
def evaluate(engine, loader, rank, world_size):
    # Every rank must run the same number of forwards under ZeRO-3, so the sampler pads;
    # the padded (repeated) samples are masked out by their global position.
    engine.eval()
    n_total = len(loader.dataset)
    totals = torch.zeros(3, device=engine.device)
    seen = 0
    for images, target in loader:
        images = images.to(engine.device, non_blocking=True).to(torch.bfloat16)
        target = target.to(engine.device, non_blocking=True)
        pos = rank + world_size * (seen + torch.arange(target.numel(), device=engine.device))
        keep = (pos < n_total).float()
        seen += target.numel()
        logits = engine(images).float()
        totals[0] += (F.cross_entropy(logits, target, reduction="none") * keep).sum()
        totals[1] += ((logits.argmax(-1) == target).float() * keep).sum()
        totals[2] += keep.sum()
    dist.all_reduce(totals)
    engine.train()
    return (totals[0] / totals[2]).item(), (100.0 * totals[1] / totals[2]).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, sampler=train_sampler, batch_size=args.micro_batch,
                              num_workers=10, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, sampler=val_sampler, batch_size=64, num_workers=6, pin_memory=True)

    steps_per_epoch = len(train_loader) // args.grad_accum
    ds_config = build_ds_config(args, world_size, steps_per_epoch)

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = timm.create_model(args.model, pretrained=False, num_classes=args.num_classes,
                                  drop_path_rate=0.2)
    if args.pretrained:
        load_pretrained(model, args.pretrained, rank)

    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()

    start_epoch, best_acc = 0, 0.0
    ckpt_dir = os.path.join(args.out, "ds_ckpt")
    if os.path.isdir(ckpt_dir):
        path, client_state = engine.load_checkpoint(ckpt_dir)
        if path is not None:
            start_epoch = client_state["epoch"] + 1
            best_acc = client_state["best_acc"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (images, target) in enumerate(train_loader):
            images = images.to(engine.device, non_blocking=True)
            target = target.to(engine.device, non_blocking=True)
            images, soft_target = mixup(images, target)
            out = engine(images.to(torch.bfloat16))
            loss = criterion(out.float(), soft_target)
            engine.backward(loss)
            engine.step()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss={loss.item():.4f} "
                      f"lr={scheduler.get_last_lr()[0]:.2e} t={time.time() - t0:.0f}s", flush=True)

        val_loss, acc1 = evaluate(engine, val_loader, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} top1 {acc1:.2f}", flush=True)

        engine.save_checkpoint(ckpt_dir, tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "best_acc": max(best_acc, acc1)})
        if acc1 > best_acc:
            best_acc = acc1
            # collective under ZeRO-3: every rank takes part, rank 0 writes the file
            engine.save_16bit_model(args.out, "vit_best_bf16.bin")

    if rank == 0:
        print(f"best top-1: {best_acc:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
