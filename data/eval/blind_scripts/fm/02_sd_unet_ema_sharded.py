"""Stable Diffusion UNet fine-tuning with FSDP and a sharded EMA copy.

Frozen VAE and CLIP text encoder live on every GPU in bf16; only the UNet is
sharded. The EMA UNet is wrapped with exactly the same policy so its local
shards line up one-to-one with the training shards.

torchrun --nproc_per_node=8 02_sd_unet_ema_sharded.py --data-root /data/laion-art
"""
import argparse
import copy
import functools
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image
from transformers import CLIPTextModel, CLIPTokenizer

from data import ImageCaptionFolder  # local helper: (pixel_values in [-1,1], caption)

SAMPLE_PROMPTS = [
    "a watercolor painting of a lighthouse at dusk",
    "a corgi wearing sunglasses on a beach",
    "an isometric render of a tiny greenhouse",
    "a portrait of an old fisherman, 35mm film",
]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", default="stabilityai/stable-diffusion-2-1-base")
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--out", default="runs/sd21-ft")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def wrap(module, mixed_precision):
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={BasicTransformerBlock, ResnetBlock2D})
    return FSDP(module, auto_wrap_policy=policy, mixed_precision=mixed_precision,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                device_id=torch.cuda.current_device(), use_orig_params=False)


@torch.no_grad()
def update_ema(ema_model, model, decay):
    # identical wrapping -> the flat local shards have identical shapes and order
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.lerp_(p.detach(), 1.0 - decay)


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts, device):
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids.to(device)
    return text_encoder(ids)[0]


@torch.no_grad()
def sample(ema_unet, vae, tokenizer, text_encoder, device, steps=50, guidance=7.5, res=512):
    # all ranks run the sharded forward with the same prompts and seed; rank 0 writes
    sched = DDIMScheduler.from_pretrained(ARGS.pretrained, subfolder="scheduler")
    sched.set_timesteps(steps)
    cond = encode_prompts(tokenizer, text_encoder, SAMPLE_PROMPTS, device)
    uncond = encode_prompts(tokenizer, text_encoder, [""] * len(SAMPLE_PROMPTS), device)
    emb = torch.cat([uncond, cond])
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(len(SAMPLE_PROMPTS), 4, res // 8, res // 8, generator=g, device=device)
    latents = latents * sched.init_noise_sigma
    for t in sched.timesteps:
        inp = sched.scale_model_input(torch.cat([latents] * 2), t)
        eps = ema_unet(inp, t, encoder_hidden_states=emb).sample
        eps_u, eps_c = eps.chunk(2)
        eps = eps_u + guidance * (eps_c - eps_u)
        latents = sched.step(eps, t, latents).prev_sample
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    return (images.float().clamp(-1, 1) + 1) / 2


def save_sharded(path, step, unet, ema_unet, optimizer):
    with FSDP.state_dict_type(unet, StateDictType.SHARDED_STATE_DICT), \
            FSDP.state_dict_type(ema_unet, StateDictType.SHARDED_STATE_DICT):
        state = {
            "unet": unet.state_dict(),
            "ema": ema_unet.state_dict(),
            "optim": FSDP.optim_state_dict(unet, optimizer),
        }
        dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
    dist.barrier()


def load_sharded(path, unet, ema_unet, optimizer):
    with FSDP.state_dict_type(unet, StateDictType.SHARDED_STATE_DICT), \
            FSDP.state_dict_type(ema_unet, StateDictType.SHARDED_STATE_DICT):
        state = {"unet": unet.state_dict(), "ema": ema_unet.state_dict()}
        dcp.load(state, checkpoint_id=path)
        unet.load_state_dict(state["unet"])
        ema_unet.load_state_dict(state["ema"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state["unet"], optimizer_key="optim",
            storage_reader=dcp.FileSystemReader(path))
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(unet, optimizer, optim_state["optim"]))
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)["step"]


def export_ema(ema_unet, out_dir):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(ema_unet, StateDictType.FULL_STATE_DICT, cfg):
        sd = ema_unet.state_dict()
    if dist.get_rank() == 0:
        plain = UNet2DConditionModel.from_pretrained(ARGS.pretrained, subfolder="unet")
        plain.load_state_dict(sd)
        plain.save_pretrained(os.path.join(out_dir, "unet_ema"))
    dist.barrier()


def main():
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)  # per-rank noise / timesteps

    tokenizer = CLIPTokenizer.from_pretrained(ARGS.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(ARGS.pretrained, subfolder="text_encoder",
                                                 torch_dtype=torch.bfloat16).to(device).eval().requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(ARGS.pretrained, subfolder="vae",
                                        torch_dtype=torch.bfloat16).to(device).eval().requires_grad_(False)
    noise_sched = DDPMScheduler.from_pretrained(ARGS.pretrained, subfolder="scheduler")

    unet = UNet2DConditionModel.from_pretrained(ARGS.pretrained, subfolder="unet")
    unet.enable_gradient_checkpointing()
    ema_unet = copy.deepcopy(unet).requires_grad_(False)

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    unet = wrap(unet, mp)
    ema_unet = wrap(ema_unet, mp)
    ema_unet.eval()

    optimizer = torch.optim.AdamW(unet.parameters(), lr=ARGS.lr, weight_decay=1e-2)

    start_step = 0
    if ARGS.resume:
        start_step = load_sharded(ARGS.resume, unet, ema_unet, optimizer)
        if rank == 0:
            print(f"resumed from {ARGS.resume} at step {start_step}")

    ds = ImageCaptionFolder(ARGS.data_root, resolution=ARGS.resolution)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=ARGS.batch_size, sampler=sampler, num_workers=ARGS.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    step, epoch = start_step, start_step // len(loader)
    unet.train()
    while step < ARGS.max_steps:
        sampler.set_epoch(epoch)
        for pixels, captions in loader:
            pixels = pixels.to(device, dtype=torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                emb = encode_prompts(tokenizer, text_encoder, list(captions), device)
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_sched.add_noise(latents, noise, t)
            pred = unet(noisy, t, encoder_hidden_states=emb).sample
            loss = F.mse_loss(pred.float(), noise.float())

            loss.backward()
            unet.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_ema(ema_unet, unet, ARGS.ema_decay)
            step += 1

            if step % 50 == 0:
                loss_avg = loss.detach()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {loss_avg.item():.4f}", flush=True)

            if step % ARGS.sample_every == 0:
                imgs = sample(ema_unet, vae, tokenizer, text_encoder, device, res=ARGS.resolution)
                if rank == 0:
                    os.makedirs(os.path.join(ARGS.out, "samples"), exist_ok=True)
                    save_image(imgs, os.path.join(ARGS.out, "samples", f"{step:07d}.png"), nrow=2)

            if step % ARGS.ckpt_every == 0:
                save_sharded(os.path.join(ARGS.out, f"ckpt_{step:07d}"), step, unet, ema_unet, optimizer)

            if step >= ARGS.max_steps:
                break
        epoch += 1

    export_ema(ema_unet, ARGS.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    ARGS = get_args()
    main()
