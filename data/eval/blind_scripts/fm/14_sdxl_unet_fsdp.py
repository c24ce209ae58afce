"""SDXL base UNet full fine-tune with FSDP (text encoders + VAE frozen, replicated).

    torchrun --nproc_per_node=8 14_sdxl_unet_fsdp.py --train-data /data/sdxl_ft/metadata.jsonl \
        --output-dir runs/sdxl-ft --resolution 1024 --batch-size 2
"""
import argparse
import functools
import json
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection


class JsonlImages(Dataset):
    def __init__(self, path, resolution):
        with open(path) as f:
            self.items = [json.loads(l) for l in f]
        self.root = os.path.dirname(path)
        self.resize = transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR)
        self.res = resolution
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.root, it["file_name"])).convert("RGB")
        orig = (img.height, img.width)
        img = self.resize(img)
        top = random.randint(0, max(0, img.height - self.res))
        left = random.randint(0, max(0, img.width - self.res))
        img = transforms.functional.crop(img, top, left, self.res, self.res)
        if random.random() < 0.5:
            img = transforms.functional.hflip(img)
        return {
            "pixel_values": self.to_tensor(img),
            "caption": it["text"],
            "time_ids": torch.tensor([orig[0], orig[1], top, left, self.res, self.res], dtype=torch.float32),
        }


@torch.no_grad()
def encode_prompt(text_encoders, tokenizers, prompts, device):
    embeds = []
    pooled = None
    for tok, enc in zip(tokenizers, text_encoders):
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids.to(device)
        out = enc(ids, output_hidden_states=True)
        pooled = out[0]  # only the last (projection) encoder's pooled output is kept
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, dim=-1), pooled


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="stabilityai/stable-diffusion-xl-base-1.0")
    ap.add_argument("--vae", default="madebyollin/sdxl-vae-fp16-fix")
    ap.add_argument("--train-data", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-7)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--noise-offset", type=float, default=0.0357)
    ap.add_argument("--caption-dropout", type=float, default=0.05)
    ap.add_argument("--save-every", type=int, default=2000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    random.seed(rank)
    torch.manual_seed(rank)

    tokenizers = [AutoTokenizer.from_pretrained(args.base, subfolder="tokenizer", use_fast=False),
                  AutoTokenizer.from_pretrained(args.base, subfolder="tokenizer_2", use_fast=False)]
    te1 = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.float16)
    te2 = CLIPTextModelWithProjection.from_pretrained(args.base, subfolder="text_encoder_2", torch_dtype=torch.float16)
    text_encoders = [te1.to(device).requires_grad_(False), te2.to(device).requires_grad_(False)]
    vae = AutoencoderKL.from_pretrained(args.vae, torch_dtype=torch.float16)
    vae.to("cuda:0").requires_grad_(False)
    noise_scheduler = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")

    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet")
    unet.enable_gradient_checkpointing()
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={BasicTransformerBlock, ResnetBlock2D})
    unet = FSDP(unet, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               buffer_dtype=torch.float32),
                device_id=device, use_orig_params=True, limit_all_gathers=True)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2)
    ds = JsonlImages(args.train_data, args.resolution)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, drop_last=True,
                        pin_memory=True)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    def save(tag):
        with FSDP.state_dict_type(unet, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = unet.state_dict()
        if rank == 0:
            out = os.path.join(args.output_dir, tag)
            os.makedirs(out, exist_ok=True)
            torch.save(sd, os.path.join(out, "diffusion_pytorch_model.bin"))
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(dict(unet.config), f, indent=2)
        dist.barrier()

    step = 0
    unet.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)
        for batch in loader:
            captions = [c if random.random() > args.caption_dropout else "" for c in batch["caption"]]
            with torch.no_grad():
                pixels = batch["pixel_values"].to(device, dtype=torch.float16, non_blocking=True)
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                prompt_embeds, pooled = encode_prompt(text_encoders, tokenizers, captions, device)
            latents = latents.float()
            noise = torch.randn_like(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=device)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_scheduler.add_noise(latents, noise, t)
            added = {"text_embeds": pooled.float(), "time_ids": batch["time_ids"].to(device)}
            pred = unet(noisy, t, encoder_hidden_states=prompt_embeds.float(), added_cond_kwargs=added).sample
            loss = F.mse_loss(pred.float(), noise, reduction="mean")
            loss.backward()
            unet.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

            if step % 20 == 0:
                stats = loss_sum.clone()
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {(stats[0] / stats[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if step % args.save_every == 0:
                save(f"checkpoint-{step}")

    save("final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
