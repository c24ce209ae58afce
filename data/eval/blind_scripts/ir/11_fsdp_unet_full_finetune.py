"""Full fine-tune of the SD 2.1 UNet with FSDP (multi-node).

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29400 \
    11_fsdp_unet_full_finetune.py --train_shards "/lustre/data/sd-ft/train-{00000..00511}.tar" \
    --val_shards "/lustre/data/sd-ft/val-{00000..00007}.tar" --out /lustre/ckpt/sd21-fsdp
"""
import argparse
import functools
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger("fsdp_unet")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stabilityai/stable-diffusion-2-1")
    ap.add_argument("--train_shards", required=True)
    ap.add_argument("--val_shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None, help="path to a full unet state dict (.pt)")
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--val_every", type=int, default=2500)
    ap.add_argument("--val_batches", type=int, default=20)
    ap.add_argument("--save_every", type=int, default=5000)
    return ap.parse_args()


def make_loader(urls, batch, train):
    tf = transforms.Compose([transforms.Resize(768), transforms.CenterCrop(768), transforms.ToTensor(),
                             transforms.Normalize([0.5], [0.5])])
    # resampled: every rank draws shards independently and never runs dry
    ds = wds.WebDataset(urls, resampled=True, handler=wds.warn_and_continue)
    if train:
        ds = ds.shuffle(5000)
    ds = ds.decode("pil").to_tuple("jpg", "txt").map_tuple(tf, str).batched(batch, partial=False)
    return wds.WebLoader(ds, batch_size=None, num_workers=8, pin_memory=True)


def save_full_unet(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
        log.info("saved %s", path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(rank)

    tokenizer = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder",
                                                 torch_dtype=torch.bfloat16).to(device).eval()
    vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.bfloat16).to(device).eval()
    text_encoder.requires_grad_(False)
    vae.requires_grad_(False)
    noise_scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")

    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    if args.resume:
        unet.load_state_dict(torch.load(args.resume, map_location="cpu"))
        log.info("loaded %s", args.resume)
    unet.enable_gradient_checkpointing()

    model = FSDP(
        unet,
        auto_wrap_policy=ModuleWrapPolicy({BasicTransformerBlock, ResnetBlock2D}),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2, betas=(0.9, 0.99))
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    with torch.no_grad():
        null_ids = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids.to(device)
        null_emb = text_encoder(null_ids)[0]

    def embed(captions, drop):
        with torch.no_grad():
            ids = tokenizer(list(captions), padding="max_length", max_length=77, truncation=True,
                            return_tensors="pt").input_ids.to(device)
            emb = text_encoder(ids)[0]
        if drop > 0:
            mask = torch.rand(emb.shape[0], 1, 1, device=device) < drop
            emb = torch.where(mask, null_emb, emb)
        return emb

    def diffusion_loss(pixels, captions, drop):
        with torch.no_grad():
            lat = vae.encode(pixels.to(device, torch.bfloat16)).latent_dist.sample() * vae.config.scaling_factor
        cond = embed(captions, drop)
        noise = torch.randn_like(lat)
        t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (lat.shape[0],), device=device)
        noisy = noise_scheduler.add_noise(lat, noise, t)
        target = noise_scheduler.get_velocity(lat, noise, t)
        pred = model(noisy, t, cond).sample
        return F.mse_loss(pred.float(), target.float())

    @torch.no_grad()
    def validate():
        model.eval()
        total = torch.zeros(2, device=device)
        for i, (pixels, captions) in enumerate(val_loader):
            if i >= args.val_batches:
                break
            total += torch.stack([diffusion_loss(pixels, captions, 0.0) * len(captions),
                                  torch.tensor(float(len(captions)), device=device)])
        dist.all_reduce(total)
        model.train()
        return (total[0] / total[1]).item()

    train_loader = make_loader(args.train_shards, args.batch, train=True)
    val_loader = make_loader(args.val_shards, args.batch, train=False)
    step, t0 = 0, time.time()
    model.train()
    for pixels, captions in train_loader:
        loss = diffusion_loss(pixels, captions, args.p_uncond)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        warm.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 100 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            log.info("step %d loss %.4f  %.2f it/s", step, l.item(), 100 / (time.time() - t0))
            t0 = time.time()
        if step % args.val_every == 0:
            log.info("step %d val loss %.4f", step, validate())
        if step % args.save_every == 0 or step == args.steps:
            save_full_unet(model, os.path.join(args.out, f"unet_{step:06d}.pt"), rank)
            dist.barrier()
        if step >= args.steps:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
