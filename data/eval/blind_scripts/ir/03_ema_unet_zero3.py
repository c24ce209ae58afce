"""SDXL UNet full fine-tune with DeepSpeed ZeRO-3 and an EMA copy of the UNet.

deepspeed --num_gpus 8 03_ema_unet_zero3.py --data_root /datasets/aesthetic-6plus --output_dir ckpt/sdxl-ft
"""
import argparse
import copy
import json
import logging
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from torchvision import transforms

from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

logger = logging.getLogger("sdxl_zero3")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stabilityai/stable-diffusion-xl-base-1.0")
    parser.add_argument("--data_root", required=True, help="directory of webdataset .tar shards")
    parser.add_argument("--output_dir", default="ckpt/sdxl-ft")
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max_steps", type=int, default=20000)
    parser.add_argument("--ema_decay", type=float, default=0.9995)
    parser.add_argument("--drop_text_prob", type=float, default=0.1)
    parser.add_argument("--save_every", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                       "warmup_num_steps": 500}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }


def make_loader(args):
    tf = transforms.Compose([
        transforms.Resize(1024, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(1024),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    shards = sorted(os.path.join(args.data_root, f) for f in os.listdir(args.data_root) if f.endswith(".tar"))
    dataset = (
        wds.WebDataset(shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(2000)
        .decode("pil")
        .to_tuple("jpg;png", "txt")
        .map_tuple(tf, lambda s: s.strip())
        .batched(args.micro_batch, partial=False)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=8, pin_memory=True)


def encode_prompt(prompts, tokenizers, encoders, device):
    embeds, pooled = [], None
    for tok, enc in zip(tokenizers, encoders):
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids.to(device)
        out = enc(ids, output_hidden_states=True)
        pooled = out[0]  # the projection encoder comes last
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, dim=-1), pooled


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p.detach().to(ema_p.dtype), alpha=1 - decay)


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(name)s %(message)s")
    logger.info("world_size=%d, global batch=%d", world_size, args.micro_batch * args.grad_accum * world_size)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tok1 = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer")
    tok2 = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer_2")
    te1 = CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder", torch_dtype=torch.bfloat16)
    te2 = CLIPTextModelWithProjection.from_pretrained(args.model, subfolder="text_encoder_2",
                                                      torch_dtype=torch.bfloat16)
    vae = AutoencoderKL.from_pretrained("madebyollin/sdxl-vae-fp16-fix", torch_dtype=torch.bfloat16)
    for m in (te1, te2, vae):
        m.requires_grad_(False).eval().to(device)
    noise_scheduler = EulerDiscreteScheduler.from_pretrained(args.model, subfolder="scheduler")
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(device)

    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    unet.enable_gradient_checkpointing()
    ema_unet = copy.deepcopy(unet).requires_grad_(False).to(device, dtype=torch.float32)

    engine, _, _, lr_scheduler = deepspeed.initialize(
        model=unet, model_parameters=[p for p in unet.parameters() if p.requires_grad], config=ds_config(args)
    )

    loader = make_loader(args)
    add_time_ids = torch.tensor([[1024, 1024, 0, 0, 1024, 1024]], device=device, dtype=torch.bfloat16)

    micro_step, step = 0, 0
    engine.train()
    for pixel_values, captions in loader:
        pixel_values = pixel_values.to(device, dtype=torch.bfloat16, non_blocking=True)
        captions = ["" if random.random() < args.drop_text_prob else c for c in captions]
        with torch.no_grad():
            latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
            prompt_embeds, pooled = encode_prompt(captions, [tok1, tok2], [te1, te2], device)

        bsz = latents.shape[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, len(alphas_cumprod), (bsz,), device=device)
        a = alphas_cumprod[t].view(-1, 1, 1, 1).to(latents.dtype)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise

        pred = engine(noisy, t, prompt_embeds,
                      added_cond_kwargs={"text_embeds": pooled, "time_ids": add_time_ids.repeat(bsz, 1)}).sample
        loss = F.mse_loss(pred.float(), noise.float())
        engine.backward(loss)
        engine.step()
        micro_step += 1

        if micro_step % args.grad_accum != 0:
            continue
        step += 1
        update_ema(ema_unet, engine.module, args.ema_decay)

        if step % 50 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            logger.info("step %d loss %.4f lr %.3e", step, l.item(), lr_scheduler.get_last_lr()[0])

        if step % args.save_every == 0 or step == args.max_steps:
            engine.save_checkpoint(args.output_dir, tag=f"step{step}")
            engine.save_16bit_model(os.path.join(args.output_dir, f"step{step}"), "unet.bin")
            if rank == 0:
                ema_unet.save_pretrained(os.path.join(args.output_dir, f"step{step}", "unet_ema"))
                with open(os.path.join(args.output_dir, "latest_step.json"), "w") as f:
                    json.dump({"step": step}, f)
            dist.barrier()

        if step >= args.max_steps:
            break

    logger.info("finished %d optimizer steps", step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
