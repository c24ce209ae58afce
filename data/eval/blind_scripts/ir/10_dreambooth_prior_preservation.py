"""DreamBooth (full UNet) with prior-preservation loss, multi-GPU via torchrun.

torchrun --nproc_per_node 4 10_dreambooth_prior_preservation.py \
  --instance_data_dir data/my_cat --instance_prompt "a photo of sks cat" \
  --class_data_dir data/class_cat --class_prompt "a photo of a cat" --output_dir out/db-cat
"""
import argparse
import hashlib
import itertools
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm

from diffusers import AutoencoderKL, DDPMScheduler, DiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", default="CompVis/stable-diffusion-v1-4")
    parser.add_argument("--instance_data_dir", required=True)
    parser.add_argument("--instance_prompt", required=True)
    parser.add_argument("--class_data_dir", required=True)
    parser.add_argument("--class_prompt", required=True)
    parser.add_argument("--num_class_images", type=int, default=200)
    parser.add_argument("--prior_loss_weight", type=float, default=1.0)
    parser.add_argument("--output_dir", default="out/dreambooth")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=1)
    parser.add_argument("--sample_batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=20)
    parser.add_argument("--learning_rate", type=float, default=5e-6)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class DreamBoothDataset(Dataset):
    def __init__(self, instance_root, instance_prompt, class_root, class_prompt, tokenizer, size):
        self.instance_images = sorted(p for p in Path(instance_root).iterdir() if p.is_file())
        self.class_images = sorted(p for p in Path(class_root).iterdir() if p.suffix == ".jpg")
        self.tokenizer = tokenizer
        self.instance_ids = self._tok(instance_prompt)
        self.class_ids = self._tok(class_prompt)
        self._length = max(len(self.instance_images), len(self.class_images))
        self.tf = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def _tok(self, prompt):
        return self.tokenizer(prompt, truncation=True, padding="max_length",
                              max_length=self.tokenizer.model_max_length, return_tensors="pt").input_ids[0]

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        inst = Image.open(self.instance_images[index % len(self.instance_images)]).convert("RGB")
        cls = Image.open(self.class_images[index % len(self.class_images)]).convert("RGB")
        return {
            "instance_images": self.tf(inst), "instance_prompt_ids": self.instance_ids,
            "class_images": self.tf(cls), "class_prompt_ids": self.class_ids,
        }


def collate_fn(examples):
    # instance and class examples go in one batch so a single forward covers both losses
    pixel_values = [e["instance_images"] for e in examples] + [e["class_images"] for e in examples]
    input_ids = [e["instance_prompt_ids"] for e in examples] + [e["class_prompt_ids"] for e in examples]
    return {"pixel_values": torch.stack(pixel_values).float(), "input_ids": torch.stack(input_ids)}


@torch.no_grad()
def generate_class_images(args, rank, world_size, device):
    class_dir = Path(args.class_data_dir)
    class_dir.mkdir(parents=True, exist_ok=True)
    existing = len(list(class_dir.glob("*.jpg")))
    missing = args.num_class_images - existing
    dist.barrier()  # every rank has counted before anyone writes
    if missing <= 0:
        return
    pipe = DiffusionPipeline.from_pretrained(args.pretrained_model_name_or_path, torch_dtype=torch.float16,
                                             safety_checker=None).to(device)
    pipe.set_progress_bar_config(disable=True)
    indices = list(range(existing, args.num_class_images))[rank::world_size]
    for i in tqdm(range(0, len(indices), args.sample_batch_size), disable=rank != 0, desc="class images"):
        idx = indices[i:i + args.sample_batch_size]
        images = pipe([args.class_prompt] * len(idx)).images
        for j, image in zip(idx, images):
            h = hashlib.sha1(image.tobytes()).hexdigest()[:10]
            image.save(class_dir / f"{j:05d}-{h}.jpg")
    del pipe
    torch.cuda.empty_cache()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    generate_class_images(args, rank, world_size, device)
    dist.barrier()

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    vae.requires_grad_(False).to(device, dtype=torch.float16)
    text_encoder.requires_grad_(False).to(device, dtype=torch.float16)
    unet.to(device)
    unet.enable_gradient_checkpointing()
    unet = DDP(unet, device_ids=[local_rank], output_device=local_rank)

    dataset = DreamBoothDataset(args.instance_data_dir, args.instance_prompt, args.class_data_dir,
                                args.class_prompt, tokenizer, args.resolution)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    dataloader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler,
                            collate_fn=collate_fn, num_workers=2, drop_last=True)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=1e-2)
    max_train_steps = args.num_train_epochs * len(dataloader)
    lr_scheduler = get_scheduler("constant", optimizer, num_warmup_steps=0, num_training_steps=max_train_steps)

    if rank == 0:
        print(f"{len(dataset)} examples, {len(dataloader)} steps/epoch per rank, {max_train_steps} steps total")

    global_step = 0
    progress = tqdm(total=max_train_steps, disable=rank != 0)
    for epoch in range(args.num_train_epochs):
        unet.train()
        for batch in dataloader:
            pixel_values = batch["pixel_values"].to(device, dtype=torch.float16)
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0]
            latents = latents.float()
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states.float()).sample

            model_pred, model_pred_prior = torch.chunk(model_pred.float(), 2, dim=0)
            target, target_prior = torch.chunk(noise, 2, dim=0)
            instance_loss = F.mse_loss(model_pred, target)
            prior_loss = F.mse_loss(model_pred_prior, target_prior)
            loss = instance_loss + args.prior_loss_weight * prior_loss

            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            progress.update(1)

            if global_step % 25 == 0:
                logs = torch.stack([instance_loss.detach(), prior_loss.detach()])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    progress.set_postfix(inst=f"{logs[0].item():.4f}", prior=f"{logs[1].item():.4f}")

    progress.close()
    if rank == 0:
        pipeline = DiffusionPipeline.from_pretrained(
            args.pretrained_model_name_or_path, unet=unet.module, text_encoder=text_encoder.float(),
            vae=vae.float(), safety_checker=None,
        )
        pipeline.save_pretrained(args.output_dir)
        print(f"saved pipeline to {args.output_dir}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
