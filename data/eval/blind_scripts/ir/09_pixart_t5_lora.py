#!/usr/bin/env python
# LoRA fine-tuning of PixArt-alpha (DiT + T5-XXL text encoder) with DDP.
#
#   torchrun --standalone --nproc_per_node 8 09_pixart_t5_lora.py --train_dir /data/interior --out runs/pixart-interior
import argparse
import json
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from peft import LoraConfig, get_peft_model
from transformers import T5EncoderModel, T5Tokenizer

logger = logging.getLogger("pixart_lora")
MAX_TOKENS = 120


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="PixArt-alpha/PixArt-XL-2-512x512")
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--out", default="runs/pixart-lora")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--caption_drop", type=float, default=0.1)
    ap.add_argument("--save_every_epochs", type=int, default=3)
    ap.add_argument("--val_prompt", default="a minimalist living room with large windows, morning light")
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class InteriorDataset(Dataset):
    def __init__(self, root, size=512):
        with open(os.path.join(root, "captions.json")) as f:
            self.items = sorted(json.load(f).items())
        self.root = root
        self.tf = transforms.Compose([
            transforms.Resize(size), transforms.CenterCrop(size), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fname, caption = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, fname)).convert("RGB")), caption


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s r%(process)d %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tokenizer = T5Tokenizer.from_pretrained(args.model, subfolder="tokenizer")
    text_encoder = T5EncoderModel.from_pretrained(args.model, subfolder="text_encoder",
                                                  torch_dtype=torch.bfloat16, device_map="auto")
    text_encoder.requires_grad_(False).eval()
    vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.bfloat16).to(device)
    vae.requires_grad_(False).eval()
    transformer = PixArtTransformer2DModel.from_pretrained(args.model, subfolder="transformer")
    noise_scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")

    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_r, lora_dropout=0.0,
                          target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out",
                                          "ff.net.0.proj", "ff.net.2"])
    transformer = get_peft_model(transformer, lora_cfg)
    if rank == 0:
        transformer.print_trainable_parameters()
    transformer.to(device)
    model = DDP(transformer, device_ids=[local_rank])
    params = [p for p in transformer.parameters() if p.requires_grad]

    ds = InteriorDataset(args.train_dir)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=3e-2)
    total = args.epochs * len(dl)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)

    @torch.no_grad()
    def encode_text(captions):
        tok = tokenizer(captions, max_length=MAX_TOKENS, padding="max_length", truncation=True,
                        add_special_tokens=True, return_tensors="pt")
        ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
        emb = text_encoder(ids, attention_mask=mask)[0]
        return emb.to(device), mask

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pixels, captions in dl:
            captions = ["" if random.random() < args.caption_drop else c for c in captions]
            pixels = pixels.to(device, dtype=torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            prompt_emb, prompt_mask = encode_text(captions)

            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_scheduler.add_noise(latents, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(noisy, encoder_hidden_states=prompt_emb, encoder_attention_mask=prompt_mask,
                            timestep=t, added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
            eps = out.chunk(2, dim=1)[0] if out.shape[1] == 2 * latents.shape[1] else out
            loss = F.mse_loss(eps.float(), noise.float())

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                loss_avg = loss.detach()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    logger.info("ep %d step %d/%d loss %.4f lr %.2e", epoch, step, total, loss_avg.item(),
                                sched.get_last_lr()[0])

        if (epoch + 1) % args.save_every_epochs == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_dir = os.path.join(args.out, f"epoch_{epoch + 1:03d}")
                transformer.save_pretrained(save_dir)
                pipe = PixArtAlphaPipeline.from_pretrained(args.model, transformer=transformer.base_model.model,
                                                           text_encoder=text_encoder, vae=vae, tokenizer=tokenizer,
                                                           torch_dtype=torch.bfloat16)
                pipe.set_progress_bar_config(disable=True)
                g = torch.Generator(device).manual_seed(args.seed)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    img = pipe(args.val_prompt, num_inference_steps=20, generator=g).images[0]
                img.save(os.path.join(save_dir, "sample.png"))
                del pipe
                logger.info("saved %s", save_dir)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
