"""LiT-style tuning on DataComp-medium shards: locked pretrained image tower, text tower trained.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
    08_lit_wandb_datacomp.py --train-data '/datacomp/medium/shards/{00000000..00001919}.tar' \
    --imagenet-val /datasets/imagenet/val --report-to wandb
"""
import argparse
import logging
import math
import os
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import wandb
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import open_clip
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--num-samples", type=int, default=128_000_000)
    p.add_argument("--imagenet-val", default=None)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="laion2b_s34b_b88k")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--report-to", default="tensorboard")
    p.add_argument("--wandb-project", default="lit-datacomp")
    p.add_argument("--name", default=None)
    p.add_argument("--output", default="/shared/exp/lit")
    p.add_argument("--save-steps", type=int, default=5000)
    return p.parse_args()


def gather_grad(x):
    import torch.distributed.nn as distnn
    return torch.cat(distnn.all_gather(x), dim=0)


def loss_fn(img, txt, scale):
    img_all, txt_all = gather_grad(img), gather_grad(txt)
    logits = scale * img_all @ txt_all.t()
    labels = torch.arange(logits.size(0), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def train_pipeline(args, preprocess, tokenizer, world_size):
    urls = list(braceexpand.braceexpand(args.train_data))
    batches = math.ceil(args.num_samples / (args.batch_size * world_size))
    per_worker = math.ceil(batches / args.workers)
    ds = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=8000, initial=1000),
        wds.select(lambda s: "txt" in s and ("jpg" in s or "png" in s or "webp" in s)),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(per_worker)
    dl = wds.WebLoader(ds, batch_size=None, num_workers=args.workers, persistent_workers=True)
    return dl, per_worker * args.workers


@torch.no_grad()
def imagenet_zeroshot(model, tokenizer, preprocess, root, device):
    ds = torchvision.datasets.ImageFolder(root, transform=preprocess)
    dl = torch.utils.data.DataLoader(ds, batch_size=250, num_workers=8)
    model.eval()
    cls = []
    for name in IMAGENET_CLASSNAMES:
        e = model.encode_text(tokenizer([t(name) for t in OPENAI_IMAGENET_TEMPLATES]).to(device), normalize=True)
        cls.append(F.normalize(e.mean(0), dim=0))
    cls = torch.stack(cls, 1)
    hits, n = 0, 0
    for x, y in dl:
        with torch.autocast("cuda"):
            f = model.encode_image(x.to(device), normalize=True)
        hits += ((f.float() @ cls.float()).argmax(1) == y.to(device)).sum().item()
        n += y.numel()
    model.train()
    return hits / n


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)
    name = args.name or f"lit-{args.model}-{args.pretrained}-b{args.batch_size * world}"

    if args.report_to == "wandb":
        wandb.init(project=args.wandb_project, name=name, config=vars(args), resume="allow")

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.model, pretrained=args.pretrained, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    model.lock_image_tower(unlocked_groups=0, freeze_bn_stats=True)
    ddp = DDP(model, device_ids=[local_rank])

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98), eps=1e-6)
    loader, steps_per_epoch = train_pipeline(args, preprocess_train, tokenizer, world)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()
    out_dir = os.path.join(args.output, name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for images, texts in loader:
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp(images, texts)
                loss = loss_fn(img, txt, scale)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1

            if step % 50 == 0 and rank == 0:
                sps = 50 * args.batch_size * world / (time.time() - t0)
                logging.info("ep %d step %d loss %.4f scale %.2f %.0f samples/s", epoch, step, loss.item(),
                             scale.item(), sps)
                if args.report_to == "wandb":
                    wandb.log({"train/loss": loss.item(), "train/logit_scale": scale.item(),
                               "train/lr": sched.get_last_lr()[0], "train/samples_per_s": sps}, step=step)
                t0 = time.time()

            if step % args.save_steps == 0 and rank == 0:
                torch.save({"step": step, "state_dict": model.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(out_dir, "latest.pt"))

        if rank == 0 and args.imagenet_val:
            top1 = imagenet_zeroshot(model, tokenizer, preprocess_val, args.imagenet_val, device)
            logging.info("epoch %d imagenet zero-shot top1 %.4f", epoch, top1)
            if args.report_to == "wandb":
                wandb.log({"eval/imagenet_top1": top1, "epoch": epoch}, step=step)
        dist.barrier()

    if rank == 0:
        torch.save({"step": step, "state_dict": model.state_dict()}, os.path.join(out_dir, "final.pt"))
    if args.report_to == "wandb":
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
