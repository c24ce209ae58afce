"""Full UNet fine-tuning of SD 1.5 with Min-SNR loss weighting, EMA and resumable checkpoints.

Runs under Slurm with torchrun on each node; jobs are preempted, so every run resumes from the
latest training_state.pt in --output_dir.

srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 \
     --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 16_unet_finetune_resume.py --output_dir /shared/ckpt/minsnr
"""
import argparse
import glob
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger("minsnr_ft")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", default="runwayml/stable-diffusion-v1-5")
    parser.add_argument("--dataset_name", default="reach-vb/pokemon-blip-captions")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--num_train_epochs", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--snr_gamma", type=float, default=5.0)
    parser.add_argument("--uncond_prob", type=float, default=0.1)
    parser.add_argument("--checkpointing_steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def latest_state(output_dir):
    paths = sorted(glob.glob(os.path.join(output_dir, "training_state_*.pt")),
                   key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
    return paths[-1] if paths else None


def save_training_state(output_dir, unet, ema_unet, optimizer, lr_scheduler, global_step, epoch):
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"training_state_{global_step}.pt")
    tmp = path + ".tmp"
    torch.save({
        "unet": unet.state_dict(),
        "ema": ema_unet.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict(),
        "global_step": global_step,
        "epoch": epoch,
    }, tmp)
    os.replace(tmp, path)
    logger.info("saved %s", path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(args.seed + rank)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    text_encoder.requires_grad_(False).to(device, dtype=torch.bfloat16)
    vae.requires_grad_(False).to(device, dtype=torch.bfloat16)
    unet.to(device)

    ema_unet = EMAModel(unet.parameters(), decay=0.9999, use_ema_warmup=True,
                        model_cls=UNet2DConditionModel, model_config=unet.config)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=1e-2)

    dataset = load_dataset(args.dataset_name, split="train")
    tf = transforms.Compose([
        transforms.Resize(args.resolution), transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize([0.5], [0.5]),
    ])

    def preprocess(examples):
        return {
            "pixel_values": [tf(im.convert("RGB")) for im in examples["image"]],
            "input_ids": tokenizer(examples["text"], max_length=tokenizer.model_max_length, padding="max_length",
                                   truncation=True, return_tensors="pt").input_ids,
        }

    dataset = dataset.with_transform(preprocess)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler, num_workers=4, drop_last=True,
                        collate_fn=lambda ex: {"pixel_values": torch.stack([e["pixel_values"] for e in ex]),
                                               "input_ids": torch.stack([e["input_ids"] for e in ex])})
    max_train_steps = args.num_train_epochs * len(loader)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=500,
                                 num_training_steps=max_train_steps)

    global_step, first_epoch = 0, 0
    resume_path = latest_state(args.output_dir)
    if resume_path is not None:
        state = torch.load(resume_path, map_location="cpu")
        unet.load_state_dict(state["unet"])
        ema_unet.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        global_step, first_epoch = state["global_step"], state["epoch"]
        logger.info("resumed from %s (step %d)", resume_path, global_step)

    ema_unet.to(device)
    unet.enable_gradient_checkpointing()
    unet = DDP(unet, device_ids=[local_rank], output_device=local_rank)
    resume_skip = global_step - first_epoch * len(loader)

    with torch.no_grad():
        null_ids = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length,
                             return_tensors="pt").input_ids.to(device)
        null_emb = text_encoder(null_ids)[0]

    for epoch in range(first_epoch, args.num_train_epochs):
        sampler.set_epoch(epoch)
        unet.train()
        for i, batch in enumerate(loader):
            if epoch == first_epoch and i < resume_skip:
                continue
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, torch.bfloat16)).latent_dist.sample()
                latents = latents.float() * vae.config.scaling_factor
                cond = text_encoder(batch["input_ids"].to(device))[0]
                drop = torch.rand(cond.shape[0], 1, 1, device=device) < args.uncond_prob
                cond = torch.where(drop, null_emb, cond)
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=device).long()
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = unet(noisy, timesteps, cond).sample

            # Min-SNR-gamma weighting (epsilon prediction)
            snr = compute_snr(noise_scheduler, timesteps)
            weights = torch.stack([snr, args.snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0] / snr
            loss = F.mse_loss(pred.float(), noise, reduction="none").mean(dim=[1, 2, 3])
            loss = (loss * weights).mean()

            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ema_unet.step(unet.module.parameters())
            global_step += 1

            if global_step % 50 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f", epoch, global_step, avg.item())

            if global_step % args.checkpointing_steps == 0:
                if rank == 0:
                    save_training_state(args.output_dir, unet, ema_unet, optimizer, lr_scheduler, global_step, epoch)
                dist.barrier()

    if rank == 0:
        unet.module.save_pretrained(os.path.join(args.output_dir, "unet"))
        ema_unet.copy_to(unet.module.parameters())
        unet.module.save_pretrained(os.path.join(args.output_dir, "unet_ema"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
