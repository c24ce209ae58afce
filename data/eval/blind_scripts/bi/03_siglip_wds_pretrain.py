"""SigLIP (sigmoid loss) image-text pre-training from webdataset tar shards.

    torchrun --nproc_per_node 8 03_siglip_wds_pretrain.py \
        --train-shards "/datasets/laion400m/{00000..41407}.tar" --train-num-samples 400000000
"""
import argparse
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder

import open_clip

IMAGENET_TEMPLATES = ["a photo of a {}.", "a bad photo of a {}.", "a photo of the large {}.",
                      "a photo of the small {}.", "a cropped photo of a {}.", "itap of a {}."]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--train-num-samples", type=int, required=True)
    ap.add_argument("--imagenet-val", default=None)
    ap.add_argument("--classnames", default=None, help="text file, one class name per line")
    ap.add_argument("--model", default="ViT-B-16-SigLIP")
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--ckpt-dir", default="/checkpoints/siglip_b16")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--wandb-project", default=None)
    return ap.parse_args()


def tokenize(text, tokenizer):
    return tokenizer([text])[0]


def make_train_loader(args, preprocess, tokenizer, world_size):
    # Resampled shards: every worker on every rank draws shards with replacement,
    # and with_epoch() fixes the number of batches, so all ranks run the same number of steps.
    pipeline = wds.DataPipeline(
        wds.ResampledShards(args.train_shards),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=partial(tokenize, tokenizer=tokenizer)),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    )
    global_batch = args.batch_size * world_size
    num_batches = args.train_num_samples // global_batch
    per_worker = math.ceil(num_batches / args.workers)
    num_batches = per_worker * args.workers
    pipeline = pipeline.with_epoch(per_worker)
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=True, pin_memory=True)
    return loader, num_batches


def siglip_loss(img_f, txt_f, scale, bias):
    """Sigmoid loss of local images against the texts of all ranks."""
    rank = dist.get_rank()
    all_txt = torch.cat(dist_nn.all_gather(txt_f), dim=0)
    logits = scale * img_f @ all_txt.t() + bias
    n = img_f.shape[0]
    labels = -torch.ones_like(logits)
    labels[:, rank * n:(rank + 1) * n] += 2 * torch.eye(n, device=logits.device, dtype=logits.dtype)
    return -F.logsigmoid(labels * logits).sum() / n


@torch.no_grad()
def zero_shot_imagenet(model, tokenizer, classnames, loader, device):
    model.eval()
    weights = []
    for name in classnames:
        tokens = tokenizer([t.format(name) for t in IMAGENET_TEMPLATES]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = F.normalize(model.encode_text(tokens).float(), dim=-1).mean(0)
        weights.append(F.normalize(emb, dim=0))
    weights = torch.stack(weights, dim=1)

    counts = torch.zeros(3, device=device)  # top1, top5, n
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = F.normalize(model.encode_image(images).float(), dim=-1)
        top5 = (feats @ weights).topk(5, dim=1).indices
        counts[0] += (top5[:, 0] == target).sum()
        counts[1] += (top5 == target[:, None]).any(dim=1).sum()
        counts[2] += target.numel()
    # shards are not padded, so summing the counts gives the exact full-set accuracy
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    loader, steps_per_epoch = make_train_loader(args, preprocess_train, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs

    params_decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit" not in n]
    params_other = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit" in n]
    optimizer = torch.optim.AdamW([{"params": params_decay, "weight_decay": args.wd},
                                   {"params": params_other, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, 1e-3, 1.0, total_iters=args.warmup)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total_steps - args.warmup)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[args.warmup])

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]

    val_loader, classnames = None, None
    if args.imagenet_val:
        val_set = ImageFolder(args.imagenet_val, transform=preprocess_val)
        val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
        val_loader = DataLoader(val_shard, batch_size=256, num_workers=args.workers, pin_memory=True)
        with open(args.classnames) as f:
            classnames = [l.strip() for l in f if l.strip()]

    run = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        if args.wandb_project:
            import wandb
            run = wandb.init(project=args.wandb_project, config=vars(args))

    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        for i, (images, texts) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, scale, bias = model(images, texts)
            loss = siglip_loss(img_f.float(), txt_f.float(), scale.float(), bias.float())

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

            if rank == 0 and i % 100 == 0:
                sps = (i + 1) * args.batch_size * world_size / (time.time() - tic)
                print(f"ep {epoch} {i}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"t={scale.item():.2f} b={bias.item():.2f} {sps:.0f} samples/s", flush=True)
                if run is not None:
                    run.log({"loss": loss.item(), "logit_scale": scale.item(),
                             "logit_bias": bias.item(), "lr": scheduler.get_last_lr()[0]})

        if val_loader is not None:
            top1, top5 = zero_shot_imagenet(model.module, tokenizer, classnames, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch}: imagenet zero-shot top1 {top1:.4f} top5 {top5:.4f}", flush=True)
                if run is not None:
                    run.log({"imagenet/top1": top1, "imagenet/top5": top5, "epoch": epoch})

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
