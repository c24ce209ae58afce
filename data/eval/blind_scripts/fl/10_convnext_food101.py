"""ConvNeXt-B fine-tuning on Food-101 with DeepSpeed ZeRO-2 (CPU optimizer offload).

    deepspeed --num_gpus 8 10_convnext_food101.py --data-root /data --output-dir out/convnext_food101
"""
import argparse
import json
import os
import time

import deepspeed
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import resolve_data_config, create_transform
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Food101


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", default="/data")
    parser.add_argument("--model", default="convnext_base.fb_in22k")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--layer-decay", type=float, default=0.8)
    parser.add_argument("--output-dir", default="out/convnext_food101")
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def layer_decay_groups(model, base_lr, decay, weight_decay=0.05):
    """Per-stage learning rates: later stages get larger lr."""
    n_stages = len(model.stages) + 1
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("stem"):
            layer = 0
        elif name.startswith("stages."):
            layer = int(name.split(".")[1]) + 1
        else:
            layer = n_stages
        no_wd = p.ndim == 1 or name.endswith(".bias")
        key = (layer, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "lr": base_lr * decay ** (n_stages - layer),
                           "weight_decay": 0.0 if no_wd else weight_decay}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def validate(engine, loader):
    engine.eval()
    sums = torch.zeros(4, device=engine.device)
    for x, y in loader:
        x = x.to(engine.device, non_blocking=True).half()
        y = y.to(engine.device, non_blocking=True)
        out = engine(x).float()
        top5 = out.topk(5, dim=1).indices
        sums[0] += F.cross_entropy(out, y, reduction="sum")
        sums[1] += (top5[:, 0] == y).sum()
        sums[2] += (top5 == y[:, None]).any(1).sum()
        sums[3] += y.numel()
    dist.all_reduce(sums)
    engine.train()
    return {"loss": (sums[0] / sums[3]).item(), "top1": (sums[1] / sums[3]).item(),
            "top5": (sums[2] / sums[3]).item()}


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    model = timm.create_model(args.model, pretrained=True, num_classes=101, drop_path_rate=0.3)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**data_cfg, is_training=False)

    train_set = Food101(args.data_root, split="train", transform=train_tf, download=False)
    test_set = Food101(args.data_root, split="test", transform=eval_tf, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=128, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=8, pin_memory=True)

    steps_per_epoch = len(train_loader) // args.grad_accum
    ds_config = {
        "train_batch_size": args.batch_size * args.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps_per_epoch * args.epochs,
                                 "warmup_num_steps": steps_per_epoch, "cos_min_ratio": 1e-3}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 2e8,
        },
        "steps_per_print": 100,
    }
    param_groups = layer_decay_groups(model, args.lr, args.layer_decay)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=param_groups,
                                                           config=ds_config)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    history = []
    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=engine.device)
        for step, (x, y) in enumerate(train_loader):
            x = x.to(engine.device, non_blocking=True).half()
            y = y.to(engine.device, non_blocking=True)
            loss = F.cross_entropy(engine(x).float(), y, label_smoothing=0.1)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} [{step}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[-1]:.2e}", flush=True)

        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (len(train_loader) * world_size)
        metrics = validate(engine, test_loader)
        metrics.update(epoch=epoch, train_loss=train_loss, time=time.time() - t0)
        history.append(metrics)

        if rank == 0:
            print(json.dumps(metrics), flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
                engine.save_checkpoint(args.output_dir, tag=f"epoch_{epoch}",
                                       client_state={"epoch": epoch, "history": history})
            if metrics["top1"] > best_top1:
                best_top1 = metrics["top1"]
                state = {k: v.float().cpu() for k, v in engine.module.state_dict().items()}
                torch.save({"model": state, "arch": args.model, "num_classes": 101},
                           os.path.join(args.output_dir, "best_weights.pth"))
            with open(os.path.join(args.output_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
