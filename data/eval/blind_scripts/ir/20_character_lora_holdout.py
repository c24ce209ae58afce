"""Character LoRA (SD 1.5) with a held-out image split for validation loss.

Validation loss is measured at fixed timesteps with fixed noise so it is comparable across evals.

torchrun --nproc_per_node 4 20_character_lora_holdout.py --data_dir /data/chars/mira --trigger "mira_char"
"""
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger("char_lora")
IMG_EXT = (".png", ".jpg", ".jpeg", ".webp")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--trigger", required=True)
    ap.add_argument("--out", default="runs/char-lora")
    ap.add_argument("--val_fraction", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lora_rank", type=int, default=16)
    ap.add_argument("--caption_dropout", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def caption_for(path, trigger):
    txt = os.path.splitext(path)[0] + ".txt"
    cap = open(txt).read().strip() if os.path.exists(txt) else ""
    return f"{trigger}, {cap}" if cap else trigger


class CharDataset(Dataset):
    def __init__(self, files, trigger, tokenizer, repeats=1, caption_dropout=0.0, train=True, size=512):
        self.files = files * repeats
        self.trigger = trigger
        self.tok = tokenizer
        self.caption_dropout = caption_dropout if train else 0.0
        aug = [transforms.RandomHorizontalFlip()] if train else []
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), *aug,
                                      transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        cap = "" if random.random() < self.caption_dropout else caption_for(path, self.trigger)
        ids = self.tok(cap, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids[0]
        return self.tf(Image.open(path).convert("RGB")), ids


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    set_seed(args.seed + rank)

    files = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir) if f.lower().endswith(IMG_EXT))
    random.shuffle(files)
    n_val = max(1, int(round(len(files) * args.val_fraction)))
    val_files, train_files = files[:n_val], files[n_val:]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"train": train_files, "val": val_files}, f, indent=1)
        log.info("%d train / %d val images", len(train_files), len(val_files))

    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.bfloat16).to(device)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.bfloat16).to(device)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.bfloat16).to(device)
    sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    for m in (te, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    model = DDP(unet, device_ids=[local_rank])

    train_ds = CharDataset(train_files, args.trigger, tok, args.repeats, args.caption_dropout, train=True)
    val_ds = CharDataset(val_files, args.trigger, tok, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=2)

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    total = args.epochs * len(train_dl)
    lr_sched = get_scheduler("cosine", opt, num_warmup_steps=int(0.05 * total), num_training_steps=total)

    fixed_t = torch.linspace(100, 900, 5, device=device).long()

    @torch.no_grad()
    def val_loss():
        model.eval()
        g = torch.Generator(device).manual_seed(0)
        tot, cnt = torch.zeros((), device=device), torch.zeros((), device=device)
        for x, ids in val_dl:
            z = vae.encode(x.to(device, torch.bfloat16)).latent_dist.mean * vae.config.scaling_factor
            c = te(ids.to(device))[0]
            for t in fixed_t:
                noise = torch.randn(z.shape, generator=g, device=device, dtype=z.dtype)
                tt = t.repeat(z.shape[0])
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(sched.add_noise(z, noise, tt), tt, c).sample
                tot += F.mse_loss(pred.float(), noise.float(), reduction="sum") / noise[0].numel()
                cnt += z.shape[0]
        model.train()
        return (tot / cnt).item()

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for x, ids in train_dl:
            with torch.no_grad():
                z = vae.encode(x.to(device, torch.bfloat16)).latent_dist.sample() * vae.config.scaling_factor
                c = te(ids.to(device))[0]
            noise = torch.randn_like(z)
            t = torch.randint(0, sched.config.num_train_timesteps, (z.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(sched.add_noise(z, noise, t), t, c).sample
            loss = F.mse_loss(pred.float(), noise.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            lr_sched.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        if rank == 0:
            vl = val_loss()
            log.info("epoch %d step %d train %.4f val %.4f", epoch, step, train_loss, vl)
            lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
            StableDiffusionPipeline.save_lora_weights(os.path.join(args.out, f"epoch-{epoch:02d}"),
                                                      unet_lora_layers=lora_sd)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
