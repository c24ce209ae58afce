"""
ViT-B/16 backbone pretraining on the product-catalog image corpus (~310M images,
21k leaf categories), stored as webdataset tar shards on the object store.

Kubeflow PyTorchJob `catalog-vitb16-pt` (4 replicas x 8 H100, RDMA NICs), command:

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d \
      --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=$PET_RDZV_ID \
      pretrain_vit_wds.py \
      --train-shards 'pipe:aws s3 cp s3://vision-data/catalog/v4/train-{000000..031999}.tar -' \
      --val-shards 'pipe:aws s3 cp s3://vision-data/catalog/v4/val-{000000..000063}.tar -' \
      --samples-per-epoch 310000000 --epochs 30 --out /mnt/ckpt/catalog-vitb16

MLFLOW_TRACKING_URI points at the internal tracking server (set in the pod spec).
"""
import argparse
import math
import os
import time

import mlflow
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--val-shards", required=True)
    ap.add_argument("--samples-per-epoch", type=int, required=True)
    ap.add_argument("--num-classes", type=int, default=21843)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 4096")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def make_train_loader(args, world):
    tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                          re_prob=0.25, interpolation="bicubic")
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(args.train_shards),
        wds.detshuffle(bufsize=2000, seed=17),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.to_tuple("jpg", "cls"),
        wds.map_tuple(tf, int),
        wds.batched(args.batch_size, partial=False),
    )
    steps = args.samples_per_epoch // (args.batch_size * world)
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True, prefetch_factor=4)
    return loader.repeat(2).with_epoch(steps), steps


def make_val_loader(args):
    tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(args.val_shards),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.decode("pilrgb"),
        wds.to_tuple("jpg", "cls"),
        wds.map_tuple(tf, int),
        wds.batched(256, partial=True),
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=4)


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    for img, tgt in loader:
        img = img.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        tgt = tgt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(img)
        top5 = out.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == tgt).sum()
        stats[1] += (top5 == tgt[:, None]).any(1).sum()
        stats[2] += tgt.numel()
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    model = timm.create_model("vit_base_patch16_224", num_classes=args.num_classes,
                              drop_path_rate=0.1).to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], static_graph=True)

    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") or "pos_embed" in n or "cls_token" in n else decay).append(p)
    lr = args.lr * args.batch_size * world / 4096
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), fused=True)

    train_loader, steps_per_epoch = make_train_loader(args, world)
    val_loader = make_val_loader(args)
    total = steps_per_epoch * args.epochs
    warmup = int(args.warmup_epochs * steps_per_epoch)

    start_epoch, step = 0, 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        mlflow.set_experiment("catalog-backbones")
        mlflow.start_run(run_name=os.path.basename(args.out))
        mlflow.log_params({k: v for k, v in vars(args).items() if "shards" not in k} | {"world_size": world})

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for img, tgt in train_loader:
            img = img.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            tgt = tgt.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total, warmup, lr)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
                loss = F.cross_entropy(logits, tgt, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    ips = 100 * args.batch_size * world / (time.time() - t0)
                    t0 = time.time()
                    mlflow.log_metrics({"train_loss": l.item(), "lr": opt.param_groups[0]["lr"],
                                        "img_per_sec": ips}, step=step)

        top1, top5 = validate(model, val_loader, device)
        if rank == 0:
            mlflow.log_metrics({"val_top1": top1, "val_top5": top5}, step=step)
            print(f"epoch {epoch}: top1 {top1:.4f} top5 {top5:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
