"""Train a Hugging Face CLIPModel (ViT-B/16 config) from scratch on webdataset shards.

We keep the HF model class so checkpoints can be pushed/loaded with from_pretrained.

    torchrun --nproc_per_node=8 13_hf_clipmodel_scratch_wds.py \
        --shards '/data/cc12m-wds/cc12m-train-{0000..2175}.tar' --out ./hf_clip_b16
"""
import argparse
import math
import os
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import transforms
from transformers import CLIPConfig, CLIPModel, CLIPTokenizerFast

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", required=True)
    parser.add_argument("--num-samples", type=int, default=10_000_000, help="samples per epoch")
    parser.add_argument("--tokenizer", default="openai/clip-vit-base-patch16")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=0.2)
    parser.add_argument("--warmup-steps", type=int, default=2000)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=77)
    parser.add_argument("--out", default="./hf_clip_b16")
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args()


def build_model():
    config = CLIPConfig(
        text_config=dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_hidden_layers=12,
                         max_position_embeddings=77),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                           image_size=224, patch_size=16),
        projection_dim=512,
    )
    return CLIPModel(config)


def gather(t):
    world = dist.get_world_size()
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    out[dist.get_rank()] = t
    return torch.cat(out)


def global_contrastive_loss(img, txt, logit_scale):
    rank = dist.get_rank()
    all_img, all_txt = gather(img), gather(txt)
    logits_i2t = logit_scale * img @ all_txt.t()
    logits_t2i = logit_scale * txt @ all_img.t()
    labels = torch.arange(img.size(0), device=img.device) + rank * img.size(0)
    return (F.cross_entropy(logits_i2t, labels) + F.cross_entropy(logits_t2i, labels)) / 2


def make_loader(args, world_size, tokenizer):
    tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(),
        transforms.Normalize(CLIP_MEAN, CLIP_STD),
    ])

    def collate(batch):
        images, captions = zip(*batch)
        enc = tokenizer(list(captions), padding="max_length", truncation=True, max_length=args.max_length,
                        return_tensors="pt")
        return torch.stack(images), enc["input_ids"], enc["attention_mask"]

    urls = list(braceexpand.braceexpand(args.shards))
    num_batches = math.ceil(args.num_samples / (args.batch_size * world_size))
    per_worker = math.ceil(num_batches / args.num_workers)
    pipeline = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.to_tuple("jpg", "txt", handler=wds.warn_and_continue),
        wds.map_tuple(tf, lambda c: c.strip()),
        wds.batched(args.batch_size, collation_fn=collate, partial=False),
    ).with_epoch(per_worker)
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=args.num_workers, persistent_workers=True)
    return loader, per_worker * args.num_workers


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = CLIPTokenizerFast.from_pretrained(args.tokenizer)
    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "layer_norm", "layernorm", "embedding", "logit_scale")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    loader, steps_per_epoch = make_loader(args, world_size, tokenizer)
    total_steps = steps_per_epoch * args.epochs

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {args.batch_size * world_size}, {steps_per_epoch} steps/epoch", flush=True)

    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (pixel_values, input_ids, attention_mask) in enumerate(loader):
            pixel_values = pixel_values.to(device, non_blocking=True)
            input_ids = input_ids.to(device, non_blocking=True)
            attention_mask = attention_mask.to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.float16):
                out = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
                # image_embeds / text_embeds are already L2-normalised by CLIPModel
                loss = global_contrastive_loss(out.image_embeds, out.text_embeds, model.logit_scale.exp())

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            global_step += 1

            if rank == 0 and step % args.log_every == 0:
                dt = (time.time() - t0) / (step + 1)
                print(f"epoch {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {args.batch_size * world_size / dt:.0f} img/s",
                      flush=True)

        if rank == 0:
            save_dir = os.path.join(args.out, f"epoch_{epoch + 1}")
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1, "global_step": global_step},
                       os.path.join(save_dir, "training_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
