"""CLIP ViT-B/16 contrastive pretraining on LAION-style webdataset shards.

Global contrastive loss: image and text features are all-gathered with the
autograd-aware gather so every rank gets gradients for its own features.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        02_clip_webdataset_allgather.py --train-shards "/mnt/laion400m/{00000..41455}.tar" \
        --train-num-samples 400000000 --val-shards "/mnt/cc3m_val/{00000..00001}.tar" --out /mnt/ckpt/clip_b16
"""
import argparse
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--train-num-samples", type=int, required=True)
    p.add_argument("--val-shards", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def make_train_loader(args, preprocess, tokenizer, world):
    global_bs = args.batch_size * world
    steps_per_epoch = args.train_num_samples // global_bs
    pipeline = (
        wds.WebDataset(args.train_shards, resampled=True, handler=wds.warn_and_continue,
                       nodesplitter=wds.split_by_node)
        .shuffle(5000, handler=wds.warn_and_continue)
        .decode("pilrgb", handler=wds.warn_and_continue)
        .rename(image="jpg;png;webp", text="txt")
        .map_dict(image=preprocess, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=True, pin_memory=True)
    # resampled shards are an infinite stream; fix the epoch length so every rank runs the same number of steps
    loader = loader.with_epoch(steps_per_epoch)
    return loader, steps_per_epoch


def make_val_loader(args, preprocess, tokenizer):
    pipeline = (
        wds.WebDataset(args.val_shards, shardshuffle=False, nodesplitter=wds.single_node_only)
        .decode("pilrgb")
        .rename(image="jpg;png;webp", text="txt")
        .map_dict(image=preprocess, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(256, partial=True)
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=4)


def clip_loss(img, txt, logit_scale, rank):
    all_img = torch.cat(dist_fn.all_gather(img), dim=0)
    all_txt = torch.cat(dist_fn.all_gather(txt), dim=0)
    # local rows vs. global columns; labels are offset by this rank's block
    logits_i = logit_scale * img @ all_txt.t()
    logits_t = logit_scale * txt @ all_img.t()
    labels = torch.arange(img.size(0), device=img.device) + rank * img.size(0)
    return (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels)) / 2


@torch.no_grad()
def retrieval_eval(model, loader, device):
    model.eval()
    img_feats, txt_feats = [], []
    for images, texts in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img_feats.append(F.normalize(model.encode_image(images.to(device)).float(), dim=-1))
            txt_feats.append(F.normalize(model.encode_text(texts.to(device)).float(), dim=-1))
    img, txt = torch.cat(img_feats), torch.cat(txt_feats)
    sim = img @ txt.t()
    gt = torch.arange(sim.size(0), device=device)
    res = {}
    for k in (1, 5, 10):
        res[f"i2t_R@{k}"] = (sim.topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
        res[f"t2i_R@{k}"] = (sim.t().topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
    model.train()
    return res


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    torch.manual_seed(0)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], static_graph=args.grad_checkpointing)

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in params if exclude(n, p) and p.requires_grad], "weight_decay": 0.0},
        {"params": [p for n, p in params if not exclude(n, p) and p.requires_grad], "weight_decay": args.wd},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    train_loader, steps_per_epoch = make_train_loader(args, preprocess_train, tokenizer, world)
    total_steps = steps_per_epoch * args.epochs

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]

    writer = None
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        ddp_model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(train_loader):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, logit_scale = ddp_model(images, texts)
                loss = clip_loss(img_f.float(), txt_f.float(), logit_scale, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                ddp_model.module.logit_scale.clamp_(0, math.log(100))

            if is_main and i % 100 == 0:
                dt = (time.time() - t0) / (i + 1)
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"scale {logit_scale.item():.2f} {args.batch_size * world / dt:.0f} samples/s", flush=True)
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/logit_scale", logit_scale.item(), step)
            step += 1

        if is_main:
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(args.out, f"epoch_{epoch + 1}.pt"))
            if args.val_shards:
                res = retrieval_eval(model, make_val_loader(args, preprocess_val, tokenizer), device)
                print(f"epoch {epoch} val {res}", flush=True)
                for k, v in res.items():
                    writer.add_scalar(f"val/{k}", v, epoch)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
