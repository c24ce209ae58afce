#!/usr/bin/env python3
# Class-conditional DiT-XL/2 fine-tuning on a custom ImageNet-style folder, FSDP.
# VAE latents are computed once and cached to disk so later runs skip the encoder.
#
#   torchrun --nproc_per_node=8 04_dit_latent_cache.py --data /data/inat21_256 --cache-dir /shared/cache/inat21
import argparse
import functools
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("dit")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--ckpt-dir", default="ckpts/dit-inat")
    ap.add_argument("--pretrained", default="facebook/DiT-XL-2-256")
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-ema")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--class-dropout", type=float, default=0.1)
    ap.add_argument("--encode-batch", type=int, default=64)
    ap.add_argument("--ckpt-every-epochs", type=int, default=5)
    return ap.parse_args()


class LatentDataset(Dataset):
    def __init__(self, latents, labels):
        self.latents = latents
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        lat = torch.from_numpy(np.array(self.latents[i], dtype=np.float32))
        if torch.rand(()) < 0.5:
            lat = lat.flip(-1)
        return lat, int(self.labels[i])


@torch.no_grad()
def encode_folder(args, device):
    tf = transforms.Compose([
        transforms.Resize(args.image_size),
        transforms.CenterCrop(args.image_size),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    folder = datasets.ImageFolder(args.data, transform=tf)
    loader = DataLoader(folder, batch_size=args.encode_batch, shuffle=False, num_workers=8)
    vae = AutoencoderKL.from_pretrained(args.vae).to(device).eval()
    lat_size = args.image_size // 8
    out = np.zeros((len(folder), 4, lat_size, lat_size), dtype=np.float16)
    labels = np.array(folder.targets, dtype=np.int64)
    idx = 0
    for x, _ in loader:
        z = vae.encode(x.to(device)).latent_dist.sample() * 0.18215
        out[idx: idx + len(z)] = z.cpu().numpy().astype(np.float16)
        idx += len(z)
    del vae
    torch.cuda.empty_cache()
    return out, labels, len(folder.classes)


def load_or_build_cache(args, device):
    os.makedirs(args.cache_dir, exist_ok=True)
    lat_path = os.path.join(args.cache_dir, f"latents_{args.image_size}.npy")
    lab_path = os.path.join(args.cache_dir, f"labels_{args.image_size}.npy")
    if not (os.path.exists(lat_path) and os.path.exists(lab_path)):
        logger.info("encoding %s -> %s", args.data, lat_path)
        latents, labels, _ = encode_folder(args, device)
        np.save(lat_path, latents)
        np.save(lab_path, labels)
    latents = np.load(lat_path, mmap_mode="r")
    labels = np.load(lab_path)
    return latents, labels


def save_checkpoint(model, optimizer, epoch, args, rank):
    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save({"model": model_sd, "optimizer": optim_sd, "epoch": epoch},
                   os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))
        logger.info("checkpoint written for epoch %d", epoch)
    dist.barrier()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    latents, labels = load_or_build_cache(args, device)
    num_classes = int(labels.max()) + 1
    ds = LatentDataset(latents, labels)
    assert args.global_batch % world == 0
    per_gpu = args.global_batch // world
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = DiTTransformer2DModel.from_pretrained(args.pretrained, subfolder="transformer")
    if num_classes != model.config.num_embeds_ada_norm:
        logger.info("re-initialising class embedding for %d classes", num_classes)
        for block in model.transformer_blocks:
            emb = block.norm1.emb.class_embedder
            emb.embedding_table = torch.nn.Embedding(num_classes + 1, emb.embedding_table.embedding_dim)
            emb.num_classes = num_classes
    null_class = num_classes

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BasicTransformerBlock})
    model = FSDP(model, auto_wrap_policy=policy,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                 device_id=local_rank, use_orig_params=True, sync_module_states=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = DDPMScheduler(num_train_timesteps=1000)
    alphas = sched.alphas_cumprod.to(device)

    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for z, y in loader:
            z = z.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            drop = torch.rand(y.shape, device=device) < args.class_dropout
            y = torch.where(drop, torch.full_like(y, null_class), y)
            t = torch.randint(0, 1000, (z.shape[0],), device=device)
            noise = torch.randn_like(z)
            a = alphas[t].view(-1, 1, 1, 1)
            zt = a.sqrt() * z + (1 - a).sqrt() * noise
            out = model(zt, timestep=t, class_labels=y).sample
            eps = out[:, :4]  # learned-sigma head: first 4 channels are epsilon
            loss = F.mse_loss(eps.float(), noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1

        dist.all_reduce(running)
        logger.info("epoch %d loss %.4f (%.1fs)", epoch, (running[0] / running[1]).item(), time.time() - t0)
        if (epoch + 1) % args.ckpt_every_epochs == 0:
            save_checkpoint(model, optimizer, epoch, args, rank)

    save_checkpoint(model, optimizer, args.epochs - 1, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
