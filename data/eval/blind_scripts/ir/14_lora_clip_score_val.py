"""SD 2.1-base LoRA on a product-photo dataset, validated with CLIP score on held-out prompts.

torchrun --nproc_per_node 4 14_lora_clip_score_val.py configs/products.yaml
"""
import logging
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_from_disk
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, EulerAncestralDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPModel, CLIPProcessor, CLIPTextModel, CLIPTokenizer
import wandb

logger = logging.getLogger(__name__)

DEFAULT_CFG = OmegaConf.create({
    "model": "stabilityai/stable-diffusion-2-1-base",
    "dataset_path": "data/products_hf",
    "val_prompts": "data/products_val_prompts.txt",
    "output_dir": "runs/products-lora",
    "resolution": 512,
    "batch_size": 6,
    "lr": 1e-4,
    "max_steps": 12000,
    "warmup": 250,
    "lora_rank": 32,
    "cfg_drop": 0.1,
    "ema_decay": 0.999,
    "val_every": 1500,
    "val_steps": 30,
    "guidance": 5.0,
    "clip_model": "openai/clip-vit-large-patch14",
    "wandb_project": "products-lora",
    "seed": 11,
})


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def validate(cfg, unet, vae, text_encoder, tokenizer, clip_model, clip_proc, prompts, rank, world, device, step):
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=EulerAncestralDiscreteScheduler.from_pretrained(cfg.model, subfolder="scheduler"),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=device).manual_seed(cfg.seed + rank)

    my_prompts = prompts[rank::world]
    score_sum, n = 0.0, 0
    first_images = []
    for i in range(0, len(my_prompts), 4):
        batch = my_prompts[i:i + 4]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            images = pipe(batch, num_inference_steps=cfg.val_steps, guidance_scale=cfg.guidance,
                          generator=generator).images
        inputs = clip_proc(text=batch, images=images, return_tensors="pt", padding=True, truncation=True)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        img = F.normalize(clip_model.get_image_features(pixel_values=inputs["pixel_values"]), dim=-1)
        txt = F.normalize(clip_model.get_text_features(input_ids=inputs["input_ids"],
                                                       attention_mask=inputs["attention_mask"]), dim=-1)
        score_sum += (100 * (img * txt).sum(-1)).clamp(min=0).sum().item()
        n += len(batch)
        if not first_images:
            first_images = list(zip(batch, images))

    stats = torch.tensor([score_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    clip_score = (stats[0] / stats[1]).item()
    if rank == 0:
        logger.info("step %d: CLIP score %.3f on %d prompts", step, clip_score, int(stats[1]))
        wandb.log({"val/clip_score": clip_score,
                   "val/samples": [wandb.Image(im, caption=p) for p, im in first_images]}, step=step)
    return clip_score


def main():
    cfg = OmegaConf.merge(DEFAULT_CFG, OmegaConf.load(sys.argv[1]) if len(sys.argv) > 1 else {})
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.seed + rank)
    if rank == 0:
        wandb.init(project=cfg.wandb_project, config=OmegaConf.to_container(cfg))

    tokenizer = CLIPTokenizer.from_pretrained(cfg.model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(cfg.model, subfolder="text_encoder", torch_dtype=torch.bfloat16)
    vae = AutoencoderKL.from_pretrained(cfg.model, subfolder="vae", torch_dtype=torch.bfloat16)
    unet = UNet2DConditionModel.from_pretrained(cfg.model, subfolder="unet", torch_dtype=torch.bfloat16)
    noise_scheduler = DDPMScheduler.from_pretrained(cfg.model, subfolder="scheduler")
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False).to(device)
    unet.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora_params = [p for p in unet.parameters() if p.requires_grad]
    for p in lora_params:
        p.data = p.data.float()
    model = DDP(unet, device_ids=[local_rank])
    ema = EMAModel(lora_params, decay=cfg.ema_decay)
    ema.to(device)

    clip_model = CLIPModel.from_pretrained(cfg.clip_model).to(device).eval()
    clip_proc = CLIPProcessor.from_pretrained(cfg.clip_model)
    with open(cfg.val_prompts) as f:
        val_prompts = [l.strip() for l in f if l.strip()]

    tf = transforms.Compose([transforms.Resize(cfg.resolution), transforms.RandomCrop(cfg.resolution),
                             transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    ds = load_from_disk(cfg.dataset_path)

    def to_tensors(batch):
        return {"pixel_values": [tf(im.convert("RGB")) for im in batch["image"]],
                "input_ids": tokenizer(batch["caption"], padding="max_length", truncation=True, max_length=77,
                                       return_tensors="pt").input_ids}

    ds.set_transform(to_tensors)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=8, drop_last=True,
                        collate_fn=lambda b: {"pixel_values": torch.stack([x["pixel_values"] for x in b]),
                                              "input_ids": torch.stack([x["input_ids"] for x in b])})

    optimizer = torch.optim.AdamW(lora_params, lr=cfg.lr, weight_decay=1e-2)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=cfg.warmup, num_training_steps=cfg.max_steps)

    with torch.no_grad():
        null_emb = text_encoder(tokenizer([""], padding="max_length", max_length=77,
                                          return_tensors="pt").input_ids.to(device))[0]

    step, epoch = 0, 0
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            px = batch["pixel_values"].to(device, torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                lat = vae.encode(px).latent_dist.sample() * vae.config.scaling_factor
                enc = text_encoder(batch["input_ids"].to(device))[0]
            drop = torch.rand(enc.shape[0], 1, 1, device=device) < cfg.cfg_drop
            enc = torch.where(drop, null_emb, enc)
            noise = torch.randn_like(lat)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (lat.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noise_scheduler.add_noise(lat, noise, t), t, enc).sample
            loss = F.mse_loss(pred.float(), noise.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_params, 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ema.step(lora_params)
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/lr": lr_scheduler.get_last_lr()[0]}, step=step)

            if step % cfg.val_every == 0 or step == cfg.max_steps:
                ema.store(lora_params)
                ema.copy_to(lora_params)
                model.eval()
                validate(cfg, model.module, vae, text_encoder, tokenizer, clip_model, clip_proc, val_prompts,
                         rank, world, device, step)
                if rank == 0:
                    out = os.path.join(cfg.output_dir, f"step-{step}")
                    sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(model.module))
                    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=sd)
                ema.restore(lora_params)
                model.train()
                dist.barrier()
            if step >= cfg.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
