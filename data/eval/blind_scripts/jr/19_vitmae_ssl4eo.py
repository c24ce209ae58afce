"""
Pretrain a 13-band ViTMAE (HF transformers) on SSL4EO-S12 L1C patches stored as a uint16 memmap.

    torchrun --nnodes=1 --nproc_per_node=8 19_vitmae_ssl4eo.py \
        --memmap /scratch/ssl4eo/l1c_264.u16 --index /scratch/ssl4eo/l1c_264.json --output_dir /scratch/runs/vitmae_b16
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ViTMAEConfig, ViTMAEForPreTraining

logger = logging.getLogger("vitmae")


class SSL4EOMemmap(Dataset):
    """N patches of shape (13, 264, 264) uint16, written by our export script; index json holds N and band stats."""

    def __init__(self, memmap_path, index_path, crop=224):
        with open(index_path) as f:
            meta = json.load(f)
        self.n = meta["num_patches"]
        self.shape = (self.n, 13, 264, 264)
        self.path = memmap_path
        self.mean = np.array(meta["mean"], np.float32)[:, None, None]
        self.std = np.array(meta["std"], np.float32)[:, None, None]
        self.crop = crop
        self.data = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.data is None:
            self.data = np.memmap(self.path, dtype=np.uint16, mode="r", shape=self.shape)
        y, x = np.random.randint(0, 264 - self.crop + 1, size=2)
        patch = self.data[i, :, y:y + self.crop, x:x + self.crop].astype(np.float32)
        patch = (patch - self.mean) / self.std
        if np.random.rand() < 0.5:
            patch = patch[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(patch))


def build_model(args):
    config = ViTMAEConfig(
        image_size=args.crop,
        patch_size=16,
        num_channels=13,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        decoder_hidden_size=512,
        decoder_num_hidden_layers=8,
        decoder_num_attention_heads=16,
        decoder_intermediate_size=2048,
        mask_ratio=args.mask_ratio,
        norm_pix_loss=True,
    )
    return ViTMAEForPreTraining(config)


def cosine_with_warmup(step, total, warmup):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memmap", required=True)
    parser.add_argument("--index", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--mask_ratio", type=float, default=0.75)
    parser.add_argument("--per_device_batch_size", type=int, default=128)
    parser.add_argument("--num_epochs", type=int, default=100)
    parser.add_argument("--warmup_epochs", type=int, default=10)
    parser.add_argument("--base_lr", type=float, default=1.5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--num_workers", type=int, default=10)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--wandb_project", default="eo-fm")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, name=os.path.basename(args.output_dir.rstrip("/")), config=vars(args))

    dataset = SSL4EOMemmap(args.memmap, args.index, crop=args.crop)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.per_device_batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)

    model = build_model(args).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_batch = args.per_device_batch_size * world_size
    peak_lr = args.base_lr * global_batch / 256
    no_decay = ("bias", "layernorm", "layer_norm", "position_embeddings", "cls_token", "mask_token")
    groups = [
        {"params": [p for n, p in model.module.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.module.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.95))
    total_steps = args.num_epochs * len(loader)
    warmup_steps = args.warmup_epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, total_steps, warmup_steps))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    logger.info("global batch %d, peak lr %.2e, %d steps", global_batch, peak_lr, total_steps)
    for epoch in range(start_epoch, args.num_epochs):
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(1, device=device)
        for step, pixel_values in enumerate(loader):
            pixel_values = pixel_values.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(pixel_values=pixel_values)
            loss = outputs.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss += loss.detach()
            if rank == 0 and step % 100 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "epoch": epoch + step / len(loader)})
        dist.all_reduce(epoch_loss)
        mean_loss = epoch_loss.item() / (len(loader) * world_size)
        logger.info("epoch %d loss %.4f (%.0fs)", epoch, mean_loss, time.time() - t0)
        if rank == 0:
            wandb.log({"train/epoch_loss": mean_loss, "epoch": epoch + 1})
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint.pt"))
            if (epoch + 1) % 20 == 0:
                model.module.save_pretrained(os.path.join(args.output_dir, f"hf_epoch{epoch + 1}"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
